//! Failure handling demo: `fault exit R CODE` makes rank R exit with CODE while the
//! others wait for a message from it; `fault chatter` makes every rank print lines
//! without end; `fault hang` makes every rank wait for a message
//! that never comes; `fault leave-crash CODE` reaches checkpoints until a shrink, where
//! every released process exits with CODE instead of leaving cleanly; `fault join-crash
//! CODE` reaches checkpoints until a growth, where every new process exits with CODE as
//! soon as it has joined; `fault join-exit FILE CODE` (one initial rank) does the same
//! before it even starts joining: the first process creates FILE, later ones exit (with
//! CODE `hang`, they sleep for 10 minutes instead);
//! `fault join-slow FILE MS` (one initial rank) makes every new process take MS
//! milliseconds to start before it joins, and the job ends after the growth;
//! `fault signals` makes every rank say it is ready and wait (30 s at most each) for a
//! SIGUSR1, then a SIGUSR2, which `ductile run` passes on to the ranks, then end well;
//! `fault recover DIES AT STEPS PAUSE_MS` is for `ductile run --on-failure shrink`: the
//! process that is rank DIES at step AT exits with code 3 (`none`: no one does; a test
//! kills a node instead) and the others recover, checking their data (see [`recover`]);
//! `fault late-exit RANK CODE` makes every rank finalize, then rank RANK exit with CODE
//! after the others have ended; `fault leave-late KEEP GO [quiet]` (for a policy that
//! shrinks to KEEP processes at the first checkpoint) makes every rank from KEEP on
//! print its pid and wait before that checkpoint until file GO exists (60 s at most),
//! for a test to kill it as it leaves (see [`leave_late`]).
//! The launcher must
//! end the job either way (first failing rank's code, or Ctrl-C / `--timeout`), leaving
//! no process behind.
//!
//! `ductile run -n 4 --nodes 2 -- target/debug/examples/fault exit 2 3; echo $?`

use anyhow::{bail, Context};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("join-exit") => return join_exit(&args[1..]),
        Some("join-slow") => return join_slow(&args[1..]),
        Some("recover") => return recover(&args[1..]),
        Some("late-exit") => return late_exit(&args[1..]),
        _ => {}
    }
    let mut session = ductile::init()?;
    if args.first().map(String::as_str) == Some("join-crash") {
        let code: i32 = args.get(1).context("fault join-crash CODE")?.parse()?;
        if session.joined().is_some() {
            std::process::exit(code);
        }
        for _ in 0..1000 {
            session.checkpoint()?;
        }
        return Ok(session.finalize()?);
    }
    if args.first().map(String::as_str) == Some("leave-crash") {
        let code: i32 = args.get(1).context("fault leave-crash CODE")?.parse()?;
        for _ in 0..1000 {
            if let ductile::Checkpoint::Released(_) = session.checkpoint()? {
                std::process::exit(code);
            }
        }
        return Ok(session.finalize()?);
    }
    if args.first().map(String::as_str) == Some("leave-late") {
        let usage = "fault leave-late KEEP GO [quiet]";
        let keep: usize = args.get(1).context(usage)?.parse()?;
        let go = std::path::Path::new(args.get(2).context(usage)?);
        return leave_late(session, (keep, go), args.get(3).is_some_and(|a| a == "quiet"));
    }
    let world = session.world();
    let r = world.rank();
    world.barrier()?;
    match args.first().map(String::as_str) {
        Some("exit") => {
            let who: usize = args.get(1).context("fault exit RANK CODE")?.parse()?;
            let code: i32 = args.get(2).context("fault exit RANK CODE")?.parse()?;
            if r == who {
                std::process::exit(code);
            }
            if let Err(e) = world.recv::<u8>(Some(who), Some(1)) {
                // The launcher ends the job at the first failure, rank `who`'s: give it
                // time (5 s at most) to hear of that exit before this consequence of it,
                // which on a loaded machine could otherwise reach it first.
                std::thread::sleep(std::time::Duration::from_secs(5));
                return Err(e.into());
            }
        }
        Some("hang") => {
            println!("rank {r} waiting");
            world.recv::<u8>(None, Some(1))?;
        }
        Some("chatter") => {
            // Output without end (until the job is ended), as fast as it is taken.
            println!("rank {r} waiting");
            for line in 0u64.. {
                println!("rank {r} line {line}");
            }
        }
        Some("signals") => {
            use tokio::signal::unix::{signal, SignalKind};
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(async {
                let mut usr1 = signal(SignalKind::user_defined1())?;
                let mut usr2 = signal(SignalKind::user_defined2())?;
                println!("rank {r} ready");
                let limit = std::time::Duration::from_secs(30);
                for (name, s) in [("SIGUSR1", &mut usr1), ("SIGUSR2", &mut usr2)] {
                    tokio::time::timeout(limit, s.recv()).await.with_context(|| format!("rank {r}: no {name}"))?;
                    println!("rank {r} got {name}");
                }
                anyhow::Ok(())
            })?;
            world.barrier()?;
        }
        _ => bail!(
            "usage: fault exit RANK CODE | fault hang | fault chatter | fault signals | fault leave-crash CODE | fault join-crash CODE | fault join-exit FILE CODE [background] | fault join-slow FILE MS | fault recover DIES AT STEPS PAUSE_MS [ELEMENTS] | fault late-exit RANK CODE | fault leave-late KEEP GO [quiet]"
        ),
    }
    session.finalize()?;
    Ok(())
}

/// `join-exit FILE CODE [background]`: the process that creates FILE (the job's one
/// initial rank) reaches 1000 checkpoints (background ones if asked); every later
/// process (a new one) exits with CODE before it joins, or with CODE `hang` sleeps 10
/// minutes instead.
fn join_exit(args: &[String]) -> anyhow::Result<()> {
    let file = args.first().context("fault join-exit FILE CODE")?;
    let code = args.get(1).context("fault join-exit FILE CODE")?;
    if std::fs::OpenOptions::new().write(true).create_new(true).open(file).is_err() {
        if code == "hang" {
            std::thread::sleep(std::time::Duration::from_secs(600));
        }
        std::process::exit(code.parse()?);
    }
    let background = args.get(2).is_some_and(|a| a == "background");
    let mut session = ductile::init()?;
    for _ in 0..1000 {
        if background {
            // Computing between checkpoints, while the growth starts.
            session.checkpoint_background()?;
            std::thread::sleep(std::time::Duration::from_millis(3));
        } else {
            session.checkpoint()?;
        }
    }
    let _ = std::fs::remove_file(file);
    Ok(session.finalize()?)
}

/// `join-slow FILE MS`: the process that creates FILE (the job's one initial rank)
/// reaches checkpoints until a growth; every later process (a new one) sleeps MS
/// milliseconds before it joins. Everyone finalizes after the growth.
fn join_slow(args: &[String]) -> anyhow::Result<()> {
    let file = args.first().context("fault join-slow FILE MS")?;
    let ms: u64 = args.get(1).context("fault join-slow FILE MS")?.parse()?;
    let first = std::fs::OpenOptions::new().write(true).create_new(true).open(file).is_ok();
    if !first {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    let mut session = ductile::init()?;
    if first {
        while !matches!(session.checkpoint()?, ductile::Checkpoint::Resized(_)) {}
        let _ = std::fs::remove_file(file);
    }
    Ok(session.finalize()?)
}

/// Elements of the array `recover` registers unless told: not a multiple of any
/// process count used.
const RECOVER_ELEMENTS: u64 = 1_000_003;

/// The value of element `g` of the array `recover` registers: never zero, so that a
/// lost element (zero) is told apart.
fn value(g: u64) -> u64 {
    g.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
}

/// `recover DIES AT STEPS PAUSE_MS [ELEMENTS]`: every rank registers a block of a
/// distributed array (of ELEMENTS u64, default [`RECOVER_ELEMENTS`]) and the step
/// counter, then runs STEPS steps of an allreduce and a checkpoint, PAUSE_MS apart; a
/// process released by a shrink leaves. At step AT the process that is rank DIES exits with code 3. The
/// others' calls fail; each then calls the checkpoint, which returns `Recovered`, and
/// checks its new block: zero exactly where the recovery says data was lost, every
/// other element as it was. It fills the lost elements in again (as an application
/// would from its own checkpoint), takes the step counter from the registry (the
/// survivors may have been a step apart), and goes on. At the end every block is whole.
fn recover(args: &[String]) -> anyhow::Result<()> {
    let usage = "fault recover DIES AT STEPS PAUSE_MS [ELEMENTS]";
    let dies: Option<usize> = match args.first().context(usage)?.as_str() {
        "none" => None,
        r => Some(r.parse()?),
    };
    let at: u64 = args.get(1).context(usage)?.parse()?;
    let steps: u64 = args.get(2).context(usage)?.parse()?;
    let pause = std::time::Duration::from_millis(args.get(3).context(usage)?.parse()?);
    let n: u64 = args.get(4).map_or(Ok(RECOVER_ELEMENTS), |a| a.parse())?;
    let mut s = ductile::init()?;
    let range = ductile::block_range(n, s.world().size() as u32, s.world().rank() as u32);
    s.distribute("data", n, &range.map(value).collect::<Vec<u64>>())?;
    let mut step = 0u64;
    s.replicate("step", &step)?;
    while step < steps {
        step += 1;
        let (r, size) = (s.world().rank(), s.world().size());
        if step == at && dies == Some(r) {
            eprintln!("rank {r}: failing at step {step}");
            std::process::exit(3);
        }
        match s.world().allreduce(&[1u64], ductile::ReduceOp::Sum) {
            Ok(n) if n[0] != size as u64 => bail!("rank {r}: {} processes counted, {size} in the world", n[0]),
            Ok(_) => {}
            Err(e) if e.is_failure() => eprintln!("rank {r}: step {step}: {e}"),
            Err(e) => return Err(e.into()),
        }
        if r == 0 {
            println!("step {step}: {size} processes");
        }
        std::thread::sleep(pause);
        s.replicate("step", &step)?;
        match s.checkpoint()? {
            ductile::Checkpoint::Recovered(rc) => {
                step = s.replicated("step")?;
                check_recovered(&mut s, &rc, (n, step))?;
            }
            ductile::Checkpoint::Released(_) => return Ok(s.finalize()?),
            _ => {}
        }
    }
    let range = s.block_range("data")?;
    if !s.block::<u64>("data")?.iter().zip(range).all(|(v, g)| *v == value(g)) {
        bail!("rank {}: the data is not whole at the end", s.world().rank());
    }
    if s.world().rank() == 0 {
        println!("recover: done with {} processes, the data whole", s.world().size());
    }
    Ok(s.finalize()?)
}

/// After a recovery: the new block is zero where data was lost and intact elsewhere;
/// the lost elements are filled in again.
fn check_recovered(s: &mut ductile::Session, rc: &ductile::Recovery, (n, step): (u64, u64)) -> anyhow::Result<()> {
    let old = rc.resize.old_size as u32;
    let mut expected: Vec<(String, std::ops::Range<u64>)> =
        rc.failed.iter().map(|&f| ("data".to_string(), ductile::block_range(n, old, f as u32))).collect();
    expected.retain(|(_, r)| !r.is_empty());
    if rc.lost != expected {
        bail!("lost {:?}, expected {expected:?}", rc.lost);
    }
    let range = s.block_range("data")?;
    let lost = |g: u64| rc.lost.iter().any(|(_, r)| r.contains(&g));
    let block = s.block_mut::<u64>("data")?;
    for (v, g) in block.iter_mut().zip(range) {
        let want = if lost(g) { 0 } else { value(g) };
        if *v != want {
            bail!("element {g} is {v:#x} after the recovery, expected {want:#x}");
        }
        *v = value(g);
    }
    if s.world().rank() == 0 {
        println!(
            "recovered at step {step}: ranks {:?} of {old} failed ({}), lost {:?}; {} processes",
            rc.failed,
            rc.why,
            rc.lost.iter().map(|(_, r)| r.clone()).collect::<Vec<_>>(),
            rc.resize.new_size
        );
    }
    Ok(())
}

/// `late-exit RANK CODE`: every rank finalizes; then rank RANK waits until the others
/// have exited (at most 30 s), and half a second more for their agent to see it, and
/// exits with CODE.
///
/// How it knows: every rank holds an exclusive `flock` on a file of its own, which the
/// kernel releases when the process ends; rank RANK takes each of the others' in turn.
/// (A fixed pause assumed the others ended within it, which a loaded machine need not
/// do.)
fn late_exit(args: &[String]) -> anyhow::Result<()> {
    use nix::fcntl::{Flock, FlockArg};
    let who: usize = args.first().context("fault late-exit RANK CODE")?.parse()?;
    let code: i32 = args.get(1).context("fault late-exit RANK CODE")?.parse()?;
    let session = ductile::init()?;
    let world = session.world();
    let (r, size) = (world.rank(), world.size());
    let job = session.info().job;
    let path = |k: usize| std::env::temp_dir().join(format!("ductile-late-exit-{job}-{k}"));
    let mine = std::fs::File::create(path(r))?;
    // Held until the process ends.
    let _held = Flock::lock(mine, FlockArg::LockExclusive).map_err(|(_, e)| anyhow::anyhow!("flock: {e}"))?;
    // Every lock is taken before rank RANK looks for them.
    world.barrier()?;
    session.finalize()?;
    if r == who {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        for k in (0..size).filter(|&k| k != r) {
            let mut file = std::fs::File::open(path(k))?;
            loop {
                match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                    Ok(_) => break,
                    Err((f, _)) if std::time::Instant::now() < until => {
                        file = f;
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                    Err(_) => bail!("rank {k} did not exit within 30 s"),
                }
            }
            std::fs::remove_file(path(k))?;
        }
        std::fs::remove_file(path(r))?;
        // Time for their agent to see them end before it sees this one fail.
        std::thread::sleep(std::time::Duration::from_millis(500));
        std::process::exit(code);
    }
    Ok(())
}

/// `leave-late KEEP GO [quiet]`: every process first sends every other one a value, so
/// that each has heard from each and its transport sees any of them end (not with
/// `quiet`: then none has heard from any). Ranks from KEEP on then print their pid and
/// wait before the first checkpoint until file GO exists (60 s at most), while the
/// shrink to KEEP waits for them there: a test kills one of them, before it has handed
/// anything over, and then lets the others go on. They finish the shrink, or recover
/// from it, and end well, if they can.
fn leave_late(mut session: ductile::Session, (keep, go): (usize, &std::path::Path), quiet: bool) -> anyhow::Result<()> {
    let world = session.world();
    let r = world.rank();
    if !quiet {
        let n = world.size();
        let values: Vec<Vec<u64>> = (0..n).map(|k| vec![(r * n + k) as u64]).collect();
        let got = world.alltoallv(&values)?;
        if got.iter().enumerate().any(|(k, v)| v != &[(k * n + r) as u64]) {
            bail!("rank {r}: wrong values from the alltoallv: {got:?}");
        }
    }
    if r >= keep {
        println!("leave-late: rank {r} pid {} waits", std::process::id());
        let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !go.exists() && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    match session.checkpoint()? {
        ductile::Checkpoint::Resized(_) => println!("leave-late: rank {r} resized"),
        ductile::Checkpoint::Recovered(_) => {
            println!("leave-late: rank {r} recovered as rank {} of {}", session.world().rank(), session.world().size());
        }
        _ => {}
    }
    Ok(session.finalize()?)
}
