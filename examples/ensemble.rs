//! An ensemble with retries, built on child jobs (`Group::launch`, paper 002): the job
//! (or, with `--per-node`, each node's group) runs a sequence of tasks, each a child job
//! of one process per member, and tries a task again when its child job fails.
//!
//! `ductile run -n 4 --nodes 2 -- target/release/examples/ensemble [--tasks T]
//! [--tries N] [--fail-attempts K] [--fail-how exit|crash|hang] [--timeout SECS]
//! [--per-node] [--mismatch] [--time] [--async]`
//!
//! The last child of the first K attempts of every task fails (`exit`: code 3;
//! `crash`: abort; `hang`: sleeps until the child job's timeout ends it); the other
//! children allreduce their ranks and check the sum. `--timeout` bounds those first K
//! attempts' child jobs; the later ones get at least 60 s (on a loaded machine a child
//! job that should succeed may take longer than a hang is worth waiting for). `--mismatch`: member 1 asks for a
//! different child job, which every member must refuse. Exit code: 0 if every task
//! succeeded, 3 if one failed every try, 4 if a launch was refused. `--time`: the
//! first member prints how long the launches took (`benches/launch.rs`). `--async`:
//! launches with `AsyncGroup::launch`, run on the session's runtime.

use anyhow::{bail, Context};
use ductile::{Launch, ReduceOp};
use std::time::Duration;

struct Opts {
    tasks: u32,
    tries: u32,
    fail_attempts: u32,
    fail_how: String,
    timeout: u64,
    per_node: bool,
    mismatch: bool,
    time: bool,
    asynchronous: bool,
}

fn parse() -> anyhow::Result<Opts> {
    let mut o = Opts {
        tasks: 2,
        tries: 3,
        fail_attempts: 0,
        fail_how: "exit".into(),
        timeout: 60,
        per_node: false,
        mismatch: false,
        time: false,
        asynchronous: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().with_context(|| format!("{name} needs a value"));
        match a.as_str() {
            "--tasks" => o.tasks = value("--tasks")?.parse().context("--tasks")?,
            "--tries" => o.tries = value("--tries")?.parse().context("--tries")?,
            "--fail-attempts" => o.fail_attempts = value("--fail-attempts")?.parse().context("--fail-attempts")?,
            "--fail-how" => o.fail_how = value("--fail-how")?,
            "--timeout" => o.timeout = value("--timeout")?.parse().context("--timeout")?,
            "--per-node" => o.per_node = true,
            "--mismatch" => o.mismatch = true,
            "--time" => o.time = true,
            "--async" => o.asynchronous = true,
            other => bail!("unknown argument {other:?}"),
        }
    }
    if !["exit", "crash", "hang"].contains(&o.fail_how.as_str()) {
        bail!("--fail-how must be exit, crash or hang");
    }
    Ok(o)
}

/// A child of a task's attempt: `--child TASK ATTEMPT FAIL_ATTEMPTS HOW`.
fn child(args: &[String]) -> anyhow::Result<()> {
    let [task, attempt, fail_attempts, how] = args else { bail!("--child TASK ATTEMPT FAIL_ATTEMPTS HOW") };
    let (attempt, fail_attempts): (u32, u32) = (attempt.parse()?, fail_attempts.parse()?);
    let s = ductile::init()?;
    let w = s.world();
    let (r, p) = (w.rank() as u64, w.size() as u64);
    if attempt < fail_attempts && r == p - 1 {
        match how.as_str() {
            "crash" => std::process::abort(),
            "hang" => std::thread::sleep(Duration::from_secs(3600)),
            _ => std::process::exit(3),
        }
    }
    let sum = w.allreduce(&[r], ReduceOp::Sum)?[0];
    if sum != p * (p - 1) / 2 {
        bail!("child {r}: sum {sum}, expected {}", p * (p - 1) / 2);
    }
    if r == 0 {
        println!("child job of task {task}, attempt {attempt}: {p} processes, ranks sum to {sum}");
    }
    s.finalize()?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("--child") {
        return child(&argv[2..]);
    }
    let o = parse()?;
    let exe = std::env::current_exe()?.display().to_string();
    let s = ductile::init()?;
    let g = if o.per_node { s.group(&s.pset(&format!("node/{}", s.info().node.0))?)? } else { s.world().clone() };
    let me = s.world().rank();
    let label = if o.per_node { format!("node {}", s.info().node.0) } else { "job".to_string() };
    let (mut failed, mut launches) = (0, 0);
    let started = std::time::Instant::now();
    for task in 0..o.tasks {
        let mut done = false;
        for attempt in 0..o.tries {
            let mut what = Launch::new(exe.clone())
                .args(["--child".to_string(), task.to_string(), attempt.to_string()])
                .args([o.fail_attempts.to_string(), o.fail_how.clone()])
                .timeout(Duration::from_secs(if attempt < o.fail_attempts { o.timeout } else { o.timeout.max(60) }));
            if o.mismatch && g.rank() == 1 {
                what = what.arg("extra");
            }
            launches += 1;
            let launched =
                if o.asynchronous { s.handle()?.block_on(g.as_async().launch(&what)) } else { g.launch(&what) };
            let status = match launched {
                Ok(st) => st,
                Err(e) => {
                    println!("ensemble: rank {me}: launch refused: {e}");
                    s.finalize()?;
                    std::process::exit(4);
                }
            };
            // Every member got the same status: check it.
            let code = u64::from(status.code.unsigned_abs());
            let (lo, hi) = (g.allreduce(&[code], ReduceOp::Min)?[0], g.allreduce(&[code], ReduceOp::Max)?[0]);
            if lo != hi {
                bail!("members disagree on the status of task {task}: {lo} against {hi}");
            }
            if g.rank() == 0 {
                let why = status.failure.as_deref().map(|f| format!(" ({f})")).unwrap_or_default();
                println!("ensemble: {label}: task {task} attempt {attempt}: status {}{why}", status.code);
            }
            if status.success() {
                done = true;
                break;
            }
        }
        failed += u32::from(!done);
    }
    if g.rank() == 0 {
        println!("ensemble: {label}: {} of {} tasks succeeded", o.tasks - failed, o.tasks);
        if o.time {
            println!("ensemble: {label}: {launches} launches in {:.1} ms", started.elapsed().as_secs_f64() * 1e3);
        }
    }
    s.finalize()?;
    if failed > 0 {
        std::process::exit(3);
    }
    Ok(())
}
