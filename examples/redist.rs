//! Checks registered data bit for bit through a run of resizes.
//!
//! Registers distributed items of several element types and sizes (0 elements, fewer
//! elements than processes, sizes no process count divides, and an item larger than
//! one redistribution segment) whose every element is a known function of its global
//! index. At each checkpoint the launcher's policy may resize the job; after every
//! change each process compares its new blocks with the function, element by element,
//! and the job fails naming the first wrong element. The run ends after `--changes`
//! changes.
//!
//! ```text
//! ductile run --nodes 1 --policy steps:2,1,3 --redistribution rma -- target/release/examples/redist --changes 3
//! ductile run --nodes 1 --policy steps:2,1,3 --background -- target/release/examples/redist --changes 3 --background
//! ```

use anyhow::{bail, Context};
use clap::Parser;
use ductile::{Checkpoint, Method, Session};
use std::time::{Duration, Instant};

#[derive(Debug, Parser)]
struct Args {
    /// Stop after this many changes.
    #[arg(long, default_value_t = 1)]
    changes: u64,
    /// Elements of the largest item (u64).
    #[arg(long, default_value_t = (3 << 20) + 7)]
    large: u64,
    /// Give every item its own method instead of the job's: one of each.
    #[arg(long)]
    per_item: bool,
    /// Fault injection: this rank registers one more element of "odd" than the others.
    #[arg(long, value_name = "RANK")]
    mismatch: Option<usize>,
    /// Fault injection: this rank registers "odd" as u64 instead of f64 (the same size).
    #[arg(long, value_name = "RANK")]
    mismatch_type: Option<usize>,
    /// Background checkpoints; every item but "bytes" is registered constant ("empty"
    /// and "tiny" too, whose blocks are empty on some ranks), so under `ductile run
    /// --background` they move while the processes keep checkpointing.
    #[arg(long)]
    background: bool,
    /// Check at every change that this process's peak memory grew by at most the new
    /// blocks it receives plus 64 MiB (no whole-array copies). Linux only.
    #[arg(long)]
    check_memory: bool,
    /// With `--background`: once constant items move, wait on the move's handle until
    /// this process's part has ended, then complete the change with a blocking
    /// checkpoint.
    #[arg(long)]
    wait_move: bool,
    /// After every change, rank 0 says in how many shared-memory files its block of
    /// "large" lies (blocks whose pages were handed over between processes lie in
    /// several; see `DUCTILE_PAGE_HANDOVER`). Linux only.
    #[arg(long)]
    report_files: bool,
    /// After every change, each process says how many page faults it took during the
    /// change for how many pages of new blocks it holds (one-sided moves over tcp
    /// recycle old pages instead of faulting fresh ones; see `DUCTILE_PAGE_RECYCLE`).
    /// Linux only.
    #[arg(long)]
    report_faults: bool,
    /// After every change, rank 0 says how many file descriptors, threads and mappings
    /// of shared memory (`/dev/shm`) it holds (a change must leave nothing open:
    /// connections to processes that left are closed, their regions unmapped). Linux
    /// only.
    #[arg(long)]
    report_open: bool,
    /// Fault injection: this rank aborts while constant items move (with
    /// `--background`), in the middle of the first change.
    #[arg(long, value_name = "RANK")]
    die_while_moving: Option<usize>,
    /// When a checkpoint fails, go on as an application that ignores the error would:
    /// say what the next checkpoint and a block read answer, then stay alive this many
    /// seconds before failing (the launcher should end the job before then).
    #[arg(long, value_name = "SECS")]
    keep_going: Option<u64>,
}

/// "F fds, T threads and M shm mappings" of this process.
fn held_open() -> anyhow::Result<String> {
    let (fds, threads) = (entries("/proc/self/fd")?, entries("/proc/self/task")?);
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let shm = maps.lines().filter(|l| l.contains("/dev/shm/")).count();
    Ok(format!("{fds} fds, {threads} threads and {shm} shm mappings"))
}

/// Waits, 3 s at most, until this process holds no more than `target` descriptors if
/// given, else until its count has not changed for 500 ms (a leak stays; connections
/// to processes that left close as they end, which a starved leaver may delay).
fn settle_fds(target: Option<usize>) -> anyhow::Result<()> {
    let (step, still, limit) = (Duration::from_millis(50), 10, Instant::now() + Duration::from_secs(3));
    let (mut last, mut same) = (entries("/proc/self/fd")?, 0);
    while Instant::now() < limit {
        match target {
            Some(t) if last <= t => break,
            None if same >= still => break,
            _ => {}
        }
        std::thread::sleep(step);
        let now = entries("/proc/self/fd")?;
        same = if now == last { same + 1 } else { 0 };
        last = now;
    }
    Ok(())
}

/// Entries of a directory (of `/proc`).
fn entries(dir: &str) -> anyhow::Result<usize> {
    Ok(std::fs::read_dir(dir).with_context(|| format!("reading {dir}"))?.count())
}

/// Headroom beyond the incoming blocks that a change may use.
const MEMORY_SLACK: u64 = 64 << 20;

/// Resets the peak resident size and returns the current one, in bytes.
fn memory_mark() -> anyhow::Result<u64> {
    std::fs::write("/proc/self/clear_refs", "5").context("resetting the peak RSS")?;
    status_kib("VmRSS").map(|k| k << 10)
}

/// A `/proc/self/status` field in KiB.
fn status_kib(field: &str) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string("/proc/self/status")?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':')?.trim().strip_suffix(" kB")?.parse().ok())
        .with_context(|| format!("no {field} in /proc/self/status"))
}

/// Minor page faults this process has taken, by `/proc/self/stat`.
fn minor_faults() -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").context("reading /proc/self/stat")?;
    // After the command name (in parentheses): state, ppid, pgrp, session, tty_nr,
    // tpgid, flags, minflt.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("no command name in /proc/self/stat")?;
    rest.split_whitespace().nth(7).and_then(|f| f.parse().ok()).context("no minflt in /proc/self/stat")
}

/// Bytes of the blocks this process holds now.
fn held_bytes(s: &Session, args: &Args) -> anyhow::Result<u64> {
    let mut total = 0;
    for (name, _) in item_names(args) {
        let r = s.block_range(name)?;
        let elem = match name {
            "bytes" => 1,
            _ => 8,
        };
        total += (r.end - r.start) * elem;
    }
    Ok(total)
}

/// A group of an ended membership refuses to address its members, saying why.
fn stale(g: &ductile::Group) -> anyhow::Result<()> {
    match g.barrier() {
        Err(ductile::Error::StaleGroup) => Ok(()),
        other => bail!("a group kept from before the change: expected it to be stale, got {other:?}"),
    }
}

/// A released process holds no block: asking for one, of any element type, or for its
/// range, or registering data, is an error that says so.
fn released_holds_nothing(s: &mut Session, args: &Args) -> anyhow::Result<()> {
    for (name, _) in item_names(args) {
        let registered = [s.distribute::<u64>("late", 0, &[]).err(), s.replicate("late", &1u32).err()];
        let errors = [s.block::<u8>(name).err(), s.block::<u128>(name).err(), s.block_range(name).err()];
        let errors = errors.into_iter().chain(registered);
        for e in errors {
            match e {
                Some(e) if e.to_string().contains("released") => {}
                other => bail!("{name:?} on a released process: expected an error saying so, got {other:?}"),
            }
        }
    }
    Ok(())
}

/// The distinct runtime block files (`memfd:ductile-block`) mapped over `block`, by
/// `/proc/self/maps`.
fn block_files(block: &[u64]) -> anyhow::Result<usize> {
    let (lo, hi) = (block.as_ptr() as usize, block.as_ptr() as usize + std::mem::size_of_val(block));
    let maps = std::fs::read_to_string("/proc/self/maps").context("reading /proc/self/maps")?;
    let mut inodes: Vec<&str> = maps
        .lines()
        .filter(|l| l.contains("/memfd:ductile-block"))
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (range, inode) = (f.next()?, f.nth(3)?);
            let (a, b) = range.split_once('-')?;
            let (a, b) = (usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?);
            (a < hi && b > lo).then_some(inode)
        })
        .collect();
    inodes.sort_unstable();
    inodes.dedup();
    Ok(inodes.len())
}

/// The value of element `g` of item `seed`, as 64 bits.
fn value(seed: u64, g: u64) -> u64 {
    (g.wrapping_add(1)).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed.wrapping_mul(0xD6E8_FEB8_6659_FD93)
}

fn item_names(args: &Args) -> [(&'static str, u64); 5] {
    [("empty", 0), ("tiny", 5), ("odd", 1_000_003), ("bytes", 12_345), ("large", args.large)]
}

fn register(s: &mut Session, args: &Args) -> anyhow::Result<()> {
    let (rank, size) = (s.world().rank() as u32, s.world().size() as u32);
    for (k, (name, mut global)) in item_names(args).into_iter().enumerate() {
        if name == "odd" && args.mismatch == Some(rank as usize) {
            global += 1;
        }
        let range = ductile::block_range(global, size, rank);
        let seed = k as u64;
        let method = Method::ALL[k % Method::ALL.len()];
        match name {
            "bytes" => {
                let block: Vec<u8> = range.map(|g| value(seed, g) as u8).collect();
                add(s, args, name, global, &block, method)?;
            }
            "odd" if args.mismatch_type != Some(rank as usize) => {
                let block: Vec<f64> = range.map(|g| f64::from_bits(value(seed, g))).collect();
                add(s, args, name, global, &block, method)?;
            }
            _ => {
                let block: Vec<u64> = range.map(|g| value(seed, g)).collect();
                add(s, args, name, global, &block, method)?;
            }
        }
    }
    Ok(())
}

/// Registers one item: by its own method with `--per-item`, constant with
/// `--background` unless it is "bytes" (which then moves at the switch).
fn add<T: ductile::bytemuck::Pod>(
    s: &mut Session,
    args: &Args,
    name: &str,
    global: u64,
    block: &[T],
    method: Method,
) -> anyhow::Result<()> {
    let constant = args.background && name != "bytes";
    match (constant, args.per_item) {
        (true, true) => s.distribute_constant_by(name, global, block, method)?,
        (true, false) => s.distribute_constant(name, global, block)?,
        (false, true) => s.distribute_by(name, global, block, method)?,
        (false, false) => s.distribute(name, global, block)?,
    }
    Ok(())
}

/// Checks that every item moved by its own method (`--per-item`) or else the job's.
fn check_methods(s: &Session, args: &Args) -> anyhow::Result<()> {
    for (k, (name, _)) in item_names(args).into_iter().enumerate() {
        let want = if args.per_item { Method::ALL[k % Method::ALL.len()] } else { s.redistribution() };
        match s.moved_by(name)? {
            Some(by) if by == want => {}
            by => bail!("{name}: moved by {by:?}, expected {want}"),
        }
    }
    Ok(())
}

/// Compares every element this process holds with its expected value.
fn verify(s: &Session, args: &Args) -> anyhow::Result<()> {
    verify_after(s, args, &[])
}

/// As [`verify`], after a recovery that lost `lost` (item, global range): there, every
/// element must be zero; everywhere else, as expected.
fn verify_after(s: &Session, args: &Args, lost: &[(String, std::ops::Range<u64>)]) -> anyhow::Result<()> {
    for (k, (name, _)) in item_names(args).into_iter().enumerate() {
        let seed = k as u64;
        let range = s.block_range(name)?;
        let bits: Vec<u64> = match name {
            "bytes" => s.block::<u8>(name)?.iter().map(|&b| u64::from(b)).collect(),
            "odd" => s.block::<f64>(name)?.iter().map(|v| v.to_bits()).collect(),
            _ => s.block::<u64>(name)?.to_vec(),
        };
        if bits.len() as u64 != range.end - range.start {
            bail!("{name}: holds {} elements for range {range:?}", bits.len());
        }
        let mask = if name == "bytes" { 0xff } else { u64::MAX };
        let gone = |g: u64| lost.iter().any(|(item, r)| item == name && r.contains(&g));
        let expected = |g: u64| if gone(g) { 0 } else { value(seed, g) & mask };
        if let Some(i) = (0..bits.len()).find(|&i| bits[i] != expected(range.start + i as u64)) {
            bail!(
                "{name}: element {} is {:#x}, expected {:#x}",
                range.start + i as u64,
                bits[i],
                expected(range.start + i as u64)
            );
        }
    }
    Ok(())
}

/// Gives the elements a recovery lost (`lost`: item, global range) their values again,
/// as an application rebuilds them.
fn mend(s: &mut Session, args: &Args, lost: &[(String, std::ops::Range<u64>)]) -> anyhow::Result<()> {
    for (k, (name, _)) in item_names(args).into_iter().enumerate() {
        let (seed, range) = (k as u64, s.block_range(name)?);
        let gone = |g: &u64| lost.iter().any(|(item, r)| item == name && r.contains(g));
        let fix = range.clone().enumerate().filter(|(_, g)| gone(g));
        match name {
            "bytes" => {
                let b = s.block_mut::<u8>(name)?;
                fix.for_each(|(i, g)| b[i] = value(seed, g) as u8);
            }
            "odd" => {
                let b = s.block_mut::<f64>(name)?;
                fix.for_each(|(i, g)| b[i] = f64::from_bits(value(seed, g)));
            }
            _ => {
                let b = s.block_mut::<u64>(name)?;
                fix.for_each(|(i, g)| b[i] = value(seed, g));
            }
        }
    }
    Ok(())
}

/// After checkpoint error `e`: what the session answers then, and `secs` of staying
/// alive regardless.
fn keep_going(s: &mut Session, e: ductile::Error, secs: u64) -> anyhow::Result<()> {
    let rank = s.world().rank();
    eprintln!("redist: rank {rank}: checkpoint failed: {e}; going on");
    match s.checkpoint() {
        Ok(_) => bail!("a checkpoint after a failed one succeeded"),
        Err(e) => eprintln!("redist: rank {rank}: the next checkpoint: {e}"),
    }
    match s.block::<u64>("large") {
        Ok(_) => bail!("a block read after a failed checkpoint succeeded"),
        Err(e) => eprintln!("redist: rank {rank}: reading a block: {e}"),
    }
    std::thread::sleep(std::time::Duration::from_secs(secs));
    bail!("rank {rank} was not ended within {secs} s of its failed checkpoint")
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut s = ductile::init()?;
    if s.joined().is_some() {
        verify(&s, &args).context("a joining process checks its blocks")?;
        check_methods(&s, &args)?;
    } else {
        register(&mut s, &args)?;
    }
    let mut overlapped = 0u64;
    let mut worst = 0u64;
    let mut waited = None;
    // With --report-open, rank 0's descriptors the first time it was left alone.
    let mut alone_fds = None;
    while s.epoch() < args.changes {
        let mark = if args.check_memory && !s.moving() { Some(memory_mark()?) } else { None };
        let faults = if args.report_faults { minor_faults()? } else { 0 };
        // A group kept across a change that switches the job to another membership no
        // longer works: it does not follow the job.
        let before = s.world().clone();
        let cp = if args.background && waited.is_none() { s.checkpoint_background() } else { s.checkpoint() };
        let cp = match (cp, args.keep_going) {
            (Ok(cp), _) => cp,
            (Err(e), Some(secs)) => return keep_going(&mut s, e, secs),
            (Err(e), None) => return Err(e.into()),
        };
        let faults = if args.report_faults { minor_faults()? - faults } else { 0 };
        if let (Some(rss0), Checkpoint::Resized(_) | Checkpoint::Released(_)) = (mark, &cp) {
            let extra = (status_kib("VmHWM")? << 10).saturating_sub(rss0);
            let incoming = if matches!(cp, Checkpoint::Released(_)) { 0 } else { held_bytes(&s, &args)? };
            if extra > incoming + MEMORY_SLACK {
                bail!("peak memory grew by {} MiB in a change that brought {} MiB", extra >> 20, incoming >> 20);
            }
            worst = worst.max(extra.saturating_sub(incoming));
        }
        if s.moving() && args.die_while_moving == Some(s.world().rank()) {
            eprintln!("redist: rank {} aborts while constant items move", s.world().rank());
            std::process::abort();
        }
        if s.moving() {
            // The constant items are on their way; the old ones stay readable.
            verify(&s, &args).context("while constant items move")?;
            overlapped += 1;
            if args.wait_move {
                let h = s.background_move().context("constant items move, but there is no handle")?;
                if !h.wait(std::time::Duration::from_secs(120)) {
                    bail!("this process's part of the background move did not end within 120 s");
                }
                waited = Some(h);
            }
        } else if let Some(h) = waited.take() {
            // The blocking checkpoint completed the change.
            if s.background_move().is_some() || !h.test() {
                bail!("a move handle still pending after its change completed");
            }
        }
        match cp {
            Checkpoint::Released(_) => {
                released_holds_nothing(&mut s, &args)?;
                stale(&before)?;
                return Ok(s.finalize()?);
            }
            Checkpoint::Resized(r) => {
                stale(&before)?;
                verify(&s, &args)
                    .with_context(|| format!("after change {} ({} -> {})", r.seq, r.old_size, r.new_size))?;
                check_methods(&s, &args)?;
                if args.report_faults {
                    let (rank, pages) = (s.world().rank(), held_bytes(&s, &args)? / 4096);
                    println!("redist: change {}: rank {rank} took {faults} faults for {pages} pages", s.epoch());
                }
                if s.world().rank() == 0 {
                    println!("redist: change {}: {} -> {} processes, data intact", s.epoch(), r.old_size, r.new_size);
                    if args.report_open {
                        if r.new_size < r.old_size {
                            // The processes that left close their ends as they finalize:
                            // wait (3 s at most) until rank 0, alone again, holds what it
                            // held alone before, or else until nothing has closed for
                            // 500 ms.
                            settle_fds(alone_fds.filter(|_| r.new_size == 1))?;
                        }
                        println!("redist: change {}: rank 0 holds {}", s.epoch(), held_open()?);
                        if r.new_size == 1 && alone_fds.is_none() {
                            alone_fds = Some(entries("/proc/self/fd")?);
                        }
                        if s.epoch() == args.changes {
                            // The job ends next, and with it the launcher's and agents'
                            // descriptors: a reader counting them over the 500 ms after
                            // this line (as the tests do) counts before that.
                            std::thread::sleep(Duration::from_secs(1));
                        }
                    }
                    if args.report_files {
                        let files = block_files(s.block::<u64>("large")?)?;
                        println!("redist: change {}: large lies in {files} files", s.epoch());
                    }
                }
            }
            Checkpoint::Recovered(rc) => {
                verify_after(&s, &args, &rc.lost)
                    .with_context(|| format!("after the recovery to epoch {}", s.epoch()))?;
                mend(&mut s, &args, &rc.lost)?;
                if s.world().rank() == 0 {
                    let lost: u64 = rc.lost.iter().map(|(_, r)| r.end - r.start).sum();
                    println!(
                        "redist: recovery to epoch {}: {} -> {} processes, {lost} elements lost, the others intact",
                        s.epoch(),
                        rc.resize.old_size,
                        rc.resize.new_size
                    );
                }
            }
            _ => std::thread::sleep(std::time::Duration::from_millis(1)),
        }
    }
    if args.report_open {
        // One more checkpoint, without a change: the processes that left at the last
        // one are gone by now, and their transports let go of them.
        if !matches!(s.checkpoint()?, Checkpoint::Unchanged) {
            bail!("a change at the checkpoint after the last");
        }
        if s.world().rank() == 0 {
            println!("redist: after the last change and a checkpoint: rank 0 holds {}", held_open()?);
        }
    }
    if s.world().rank() == 0 {
        println!("redist: {} changes by {}, every element intact", s.epoch(), s.redistribution());
        if args.background {
            println!("redist: {overlapped} checkpoints passed while constant items moved");
        }
        if args.check_memory {
            println!("redist: peak memory beyond the incoming blocks: {} MiB at most on rank 0", worst >> 20);
        }
    }
    Ok(s.finalize()?)
}
