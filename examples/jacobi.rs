//! A malleable Jacobi solver of the 1-D heat equation.
//!
//! The rod (`--points` values, block-distributed) is registered with the session, as is
//! the iteration counter; every `--every` iterations the job reaches a checkpoint where
//! the launcher may grow or shrink it. The registry moves the data; processes that join
//! pick up the counter and their block; released ones leave. The checksum at the end
//! (a wrapping sum of the values' bit patterns, so it does not depend on the order of
//! summation) equals that of a run of the same parameters on any fixed number of
//! processes.
//!
//! Run with `ductile run --on-failure shrink`, the solver survives the failure of
//! processes (or of whole nodes): the others recover at their next checkpoint, and
//! since the rod's lost parts cannot be rebuilt without their history, the solver
//! starts again from the initial condition on the processes left (an application with
//! checkpoints of its own would reload its last one instead). The checksum is then
//! still that of a fixed-size run. `--fail-at RANK:ITER[:EPOCH]` makes a process fail, for
//! drills and tests.
//!
//! ```text
//! ductile run --nodes 1 --slots 2 --policy steps:2,8,4,1 -- target/release/examples/jacobi
//! ```

use anyhow::{bail, Context};
use clap::Parser;
use ductile::{Checkpoint, Group, ReduceOp, Session};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Command line of the example.
#[derive(Debug, Parser)]
struct Args {
    /// Points of the rod.
    #[arg(long, default_value_t = 1 << 20)]
    points: u64,
    /// Iterations.
    #[arg(long, default_value_t = 200)]
    iters: u64,
    /// Iterations between checkpoints.
    #[arg(long, default_value_t = 25)]
    every: u64,
    /// Use background checkpoints (new processes start while the solver computes).
    #[arg(long)]
    background: bool,
    /// Keep iterating past --iters until this many changes have happened (for driving
    /// the job with `ductile resize`; bound it with `ductile run --timeout`).
    #[arg(long, default_value_t = 0, value_name = "K")]
    until_changes: u64,
    /// Also register a constant table of this many MiB that the solver does not read
    /// (geometry, a lookup table): with `ductile run --background` it moves while the
    /// solver computes, which is how the slowdown ω of overlapped iterations is
    /// measured. Every element is checked at the end.
    #[arg(long, default_value_t = 0, value_name = "MIB")]
    table_mib: u64,
    /// Ask for this many processes at the first checkpoint (an evolving job).
    #[arg(long, value_name = "P")]
    ask: Option<u32>,
    /// The process that is rank RANK at iteration ITER exits with code 3, before any
    /// change, or in epoch EPOCH (a failure drill for `ductile run --on-failure
    /// shrink`).
    #[arg(long, value_name = "RANK:ITER[:EPOCH]", value_parser = parse_fail_at)]
    fail_at: Option<(usize, u64, u64)>,
    /// The process that is rank RANK exits with code 3 at its first iteration while a
    /// change's constant data moves in the background (with `--background`).
    #[arg(long, value_name = "RANK")]
    fail_while_moving: Option<usize>,
    /// After each change, rank 0 prints `HOLD <epoch>` and waits for the file
    /// `<DIR>/go-<epoch>` (for tests that inspect the job in between).
    #[arg(long, value_name = "DIR")]
    hold: Option<PathBuf>,
}

fn parse_fail_at(s: &str) -> Result<(usize, u64, u64), String> {
    let bad = || format!("{s:?} is not RANK:ITER[:EPOCH]");
    let (r, rest) = s.split_once(':').ok_or_else(bad)?;
    let (i, e) = rest.split_once(':').unwrap_or((rest, "0"));
    Ok((r.parse().map_err(|_| bad())?, i.parse().map_err(|_| bad())?, e.parse().map_err(|_| bad())?))
}

const TAG_TO_LEFT: u32 = 1;
const TAG_TO_RIGHT: u32 = 2;

/// The initial temperature at point `g` of `n`: a smooth bump plus a sharp step, fixed
/// at zero on both ends.
fn initial(g: u64, n: u64) -> f64 {
    let x = g as f64 / (n - 1) as f64;
    let bump = (std::f64::consts::PI * x).sin();
    let step = if (0.4..0.6).contains(&x) { 1.0 } else { 0.0 };
    bump + step
}

/// The diffusion coefficient of every point (all 0.25: the constant item `k` is as large
/// as the rod, so it has a realistic share of the data to move, without changing the
/// numbers).
const K: f64 = 0.25;

/// One Jacobi sweep over this rank's block `u` (global elements `start..start+len`) with
/// coefficients `k`; returns the new block.
fn sweep(world: &Group, u: &[f64], k: &[f64], start: u64, n: u64) -> ductile::Result<Vec<f64>> {
    let (r, p) = (world.rank(), world.size());
    if r > 0 {
        world.send(r - 1, TAG_TO_LEFT, &u[..1])?;
    }
    if r + 1 < p {
        world.send(r + 1, TAG_TO_RIGHT, &u[u.len() - 1..])?;
    }
    // The neighbours' edge values land in place (`recv_into`: no buffer per message).
    let (mut left, mut right) = ([0.0f64], [0.0f64]);
    if r > 0 {
        world.recv_into(Some(r - 1), Some(TAG_TO_RIGHT), &mut left)?;
    }
    if r + 1 < p {
        world.recv_into(Some(r + 1), Some(TAG_TO_LEFT), &mut right)?;
    }
    let (left, right) = (left[0], right[0]);
    let mut new = u.to_vec();
    let last = u.len() - 1;
    for (i, v) in new.iter_mut().enumerate() {
        let g = start + i as u64;
        if g == 0 || g == n - 1 {
            continue;
        }
        let l = if i == 0 { left } else { u[i - 1] };
        let rr = if i == last { right } else { u[i + 1] };
        *v = u[i] + k[i] * (l - 2.0 * u[i] + rr);
    }
    Ok(new)
}

/// Durations of the latest iterations, with when each ended.
#[derive(Default)]
struct Timeline(std::collections::VecDeque<(Instant, Duration)>);

impl Timeline {
    const KEEP: usize = 4096;

    fn push(&mut self, end: Instant, took: Duration) {
        if self.0.len() == Self::KEEP {
            self.0.pop_front();
        }
        self.0.push_back((end, took));
    }

    /// Iterations that ended during `(from, to]`, and the slowdown ω of their mean
    /// duration over the mean of the (up to 20) iterations that ended before `quiet`
    /// (when the change began: new processes starting also take the cores).
    fn overlap(&self, from: Instant, to: Instant, quiet: Instant) -> (usize, f64) {
        let mean = |d: &[Duration]| d.iter().map(Duration::as_secs_f64).sum::<f64>() / d.len().max(1) as f64;
        let during: Vec<Duration> = self.0.iter().filter(|(e, _)| *e > from && *e <= to).map(|x| x.1).collect();
        let before: Vec<Duration> = self.0.iter().filter(|(e, _)| *e <= quiet.min(from)).map(|x| x.1).collect();
        let before = &before[before.len().saturating_sub(20)..];
        let omega = if before.is_empty() || during.is_empty() { f64::NAN } else { mean(&during) / mean(before) };
        (during.len(), omega)
    }
}

fn hold(s: &Session, dir: &Path) -> anyhow::Result<()> {
    if s.world().rank() == 0 {
        println!("HOLD {} {}", s.epoch(), s.world().size());
        let go = dir.join(format!("go-{}", s.epoch()));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !go.exists() {
            if Instant::now() > deadline {
                bail!("{} did not appear within 60 s", go.display());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    s.world().barrier()?;
    Ok(())
}

/// After a change at iteration `it` from `before` processes: checks the process sets
/// and says what changed (rank 0), with the iterations that overlapped a background
/// move (`timeline`; the change's first background checkpoint was at `first_pending`).
fn resized(
    s: &Session,
    r: &ductile::Resize,
    (it, before): (u64, usize),
    timeline: &Timeline,
    first_pending: Option<Instant>,
) -> anyhow::Result<()> {
    // The runtime's process sets agree with what the checkpoint said.
    let added = s.pset(&format!("rc/{}/added", r.seq))?;
    if added.ranks().map(|a| a as usize).collect::<Vec<_>>() != r.added {
        bail!("rc/{}/added is {added}, the checkpoint said {:?}", r.seq, r.added);
    }
    if s.world().rank() == 0 {
        println!("jacobi: iteration {it}: {before} -> {} processes on {} nodes", r.new_size, s.info().nodes);
        if let Some((from, to)) = r.overlap {
            let (during, omega) = timeline.overlap(from, to, first_pending.unwrap_or(from));
            println!(
                "jacobi: change {}: constant data moved in {:.1} ms while {during} iterations ran, omega {omega:.2}",
                r.seq,
                to.duration_since(from).as_secs_f64() * 1e3
            );
        }
    }
    Ok(())
}

/// After a recovery: the rod starts again from its initial condition on the processes
/// left, with the constant items filled in again where they were lost. Returns the
/// iteration to go on from (0).
fn restart(s: &mut Session, rc: &ductile::Recovery, n: u64) -> anyhow::Result<u64> {
    let range = s.block_range("u")?;
    for (v, g) in s.block_mut::<f64>("u")?.iter_mut().zip(range) {
        *v = initial(g, n);
    }
    s.block_mut::<f64>("k")?.fill(K);
    if let Ok(range) = s.block_range("table") {
        for (v, g) in s.block_mut::<u64>("table")?.iter_mut().zip(range) {
            *v = g;
        }
    }
    s.replicate("iter", &0u64)?;
    if s.world().rank() == 0 {
        println!(
            "jacobi: ranks {:?} of {} failed ({}); starting again from iteration 0 on {} processes",
            rc.failed, rc.resize.old_size, rc.why, rc.resize.new_size
        );
    }
    Ok(0)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut s = ductile::init()?;
    let n = args.points;
    if n < 3 || n < s.world().size() as u64 * 2 {
        bail!("--points must be at least 3 and twice the number of processes");
    }
    let mut it: u64 = if s.joined().is_some() {
        if let Some(dir) = &args.hold {
            // The old ranks hold right after the change too.
            hold(&s, dir)?;
        }
        s.replicated("iter").context("a joining process gets the iteration counter")?
    } else {
        let r = s.world();
        let range = ductile::block_range(n, r.size() as u32, r.rank() as u32);
        let k = vec![K; (range.end - range.start) as usize];
        let block: Vec<f64> = range.map(|g| initial(g, n)).collect();
        s.distribute("u", n, &block)?;
        s.distribute_constant("k", n, &k)?;
        if args.table_mib > 0 {
            let len = args.table_mib << 17;
            let part = ductile::block_range(len, s.world().size() as u32, s.world().rank() as u32);
            s.distribute_constant("table", len, &part.collect::<Vec<u64>>())?;
        }
        s.replicate("iter", &0u64)?;
        0
    };
    let started = Instant::now();
    let mut timeline = Timeline::default();
    // When the change under way first returned Pending (its start, seen from here).
    let mut first_pending: Option<Instant> = None;
    // The epoch counts the changes so far, in old and new processes alike.
    while it < args.iters || s.epoch() < args.until_changes {
        let t_iter = Instant::now();
        let world = s.world().clone();
        let start = s.block_range("u")?.start;
        if args.fail_at == Some((world.rank(), it + 1, s.epoch())) {
            eprintln!("jacobi: rank {} fails at iteration {} (--fail-at)", world.rank(), it + 1);
            std::process::exit(3);
        }
        if args.fail_while_moving == Some(world.rank()) && s.background_move().is_some() {
            eprintln!("jacobi: rank {} fails while data moves in the background", world.rank());
            std::process::exit(3);
        }
        let new = match sweep(&world, s.block::<f64>("u")?, s.block::<f64>("k")?, start, n) {
            Ok(new) => new,
            Err(e) if e.is_failure() => {
                // Processes failed: the checkpoint recovers (`--on-failure shrink`).
                match s.checkpoint()? {
                    Checkpoint::Recovered(rc) => it = restart(&mut s, &rc, n)?,
                    _ => bail!("{e}, and the job did not recover"),
                }
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        s.block_mut::<f64>("u")?.copy_from_slice(&new);
        drop(new);
        it += 1;
        if !it.is_multiple_of(args.every) || (it == args.iters && s.epoch() >= args.until_changes) {
            timeline.push(Instant::now(), t_iter.elapsed());
            continue;
        }
        if it >= args.iters {
            // Waiting for resizes from outside: do not spin through iterations.
            std::thread::sleep(Duration::from_millis(2));
        }
        s.replicate("iter", &it)?;
        if let Some(p) = args.ask.filter(|_| it == args.every) {
            s.request_procs(p);
        }
        let before = s.world().size();
        let cp = if args.background { s.checkpoint_background()? } else { s.checkpoint()? };
        timeline.push(Instant::now(), t_iter.elapsed());
        if matches!(cp, Checkpoint::Pending) && first_pending.is_none() {
            first_pending = Some(t_iter);
        }
        match cp {
            Checkpoint::Released(_) => return Ok(s.finalize()?),
            Checkpoint::Recovered(rc) => it = restart(&mut s, &rc, n)?,
            Checkpoint::Resized(r) => {
                resized(&s, &r, (it, before), &timeline, first_pending)?;
                first_pending = None;
                if let Some(dir) = &args.hold {
                    hold(&s, dir)?;
                }
            }
            _ => {}
        }
    }
    if args.table_mib > 0 {
        let range = s.block_range("table")?;
        if let Some(i) = s.block::<u64>("table")?.iter().zip(range).position(|(v, g)| *v != g) {
            bail!("table element {} is wrong after the changes", s.block_range("table")?.start + i as u64);
        }
    }
    let mine: u64 = s.block::<f64>("u")?.iter().fold(0u64, |a, v| a.wrapping_add(v.to_bits()));
    let world = s.world().clone();
    let sum = world.allreduce(&[mine], ReduceOp::Sum)?[0];
    let max = world.allreduce(&[s.block::<f64>("u")?.iter().fold(0.0f64, |a, &v| a.max(v))], ReduceOp::Max)?[0];
    if world.rank() == 0 {
        println!(
            "jacobi: points {n} iterations {it} processes {} max {max:.12} checksum {sum:016x} ({:.2} s)",
            world.size(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(s.finalize()?)
}
