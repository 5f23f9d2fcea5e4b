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
//! SIGUSR1, then a SIGUSR2, which `ductile run` passes on to the ranks, then end well.
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
            world.recv::<u8>(Some(who), Some(1))?;
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
            "usage: fault exit RANK CODE | fault hang | fault chatter | fault signals | fault leave-crash CODE | fault join-crash CODE | fault join-exit FILE CODE [background] | fault join-slow FILE MS"
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
