//! Child-job benchmark (paper 002's task rate): how many child jobs of P processes a
//! job of P processes runs per second with `Group::launch`, side by side in the same
//! run with a fresh top-level job of the same program (`ductile run`) and with Open
//! MPI's way of running a job from a job, a whole `mpirun -n P` of an empty program
//! (paper 002's prototype calls `mpiexec`).
//!
//! ```text
//! benches/peers/build.sh          # the Open MPI peer (installs Open MPI as root if missing)
//! cargo bench --bench launch      # DUCTILE_BENCH_REPS=5 by default
//! ```
//!
//! ductile's child jobs are the ensemble example's: each child initializes, allreduces
//! its rank over the child job and finalizes; the parent (`examples/ensemble --tasks
//! T --time`) times its launch loop on its first member. A fresh job is the wall time of
//! `ductile run -n P --nodes P` of one such child; Open MPI's the wall time of `mpirun
//! -n P` of the empty peer (`spawn 0`). Each figure is the median of
//! `DUCTILE_BENCH_REPS` jobs (of `TASKS` launches each for ductile's child jobs).
//! Results go to `target/bench-launch.json`.

use ductile_suite::bench::{median, ompi_relaunch};
use ductile_suite::paths::{ductile_bin, example, mpi_peer, profile_dir};
use ductile_suite::plot::{self, Bars};
use serde_json::json;
use std::process::Command;
use std::time::Instant;

const PROCS: [u32; 3] = [1, 2, 4];
const TASKS: u32 = 10;

/// ms per child job launched by a job of `procs` processes.
fn ductile_launches(procs: u32) -> f64 {
    let n = procs.to_string();
    let out = Command::new(ductile_bin())
        .args(["run", "-n", &n, "--nodes", &n, "--timeout", "300", "--"])
        .arg(example("ensemble"))
        .args(["--tasks", &TASKS.to_string(), "--time"])
        .output()
        .expect("start ductile run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ensemble failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    let ms: f64 = text
        .lines()
        .find_map(|l| l.split(" launches in ").nth(1)?.strip_suffix(" ms")?.parse().ok())
        .unwrap_or_else(|| panic!("no launch time in {text}"));
    ms / f64::from(TASKS)
}

/// Wall ms of a top-level ductile job of one ensemble child on `procs` processes.
fn ductile_fresh(procs: u32) -> f64 {
    let n = procs.to_string();
    let t = Instant::now();
    let out = Command::new(ductile_bin())
        .args(["run", "-n", &n, "--nodes", &n, "--timeout", "300", "--"])
        .arg(example("ensemble"))
        .args(["--child", "0", "0", "0", "exit"])
        .output()
        .expect("start ductile run");
    assert!(out.status.success(), "ductile run failed: {}", String::from_utf8_lossy(&out.stderr));
    t.elapsed().as_secs_f64() * 1e3
}

fn main() {
    let Some(reps) = ductile_suite::bench::start() else { return };
    let peer = mpi_peer("spawn");
    println!("launch benchmark, median of {reps} jobs per figure, ms per job (jobs per second)");
    println!("{:>5} | {:>16} {:>16} {:>16}", "procs", "ductile launch", "ductile run", "mpirun");
    let mut rows = Vec::new();
    for procs in PROCS {
        let launch = median((0..reps).map(|_| ductile_launches(procs)).collect());
        let fresh = median((0..reps).map(|_| ductile_fresh(procs)).collect());
        let ompi = peer.as_ref().map(|p| median((0..reps).map(|_| ompi_relaunch(p, procs)).collect()));
        let cell = |ms: f64| format!("{ms:.1} ({:.1}/s)", 1e3 / ms);
        println!("{procs:>5} | {:>16} {:>16} {:>16}", cell(launch), cell(fresh), ompi.map_or("-".into(), cell));
        rows.push(json!({"procs": procs, "launch_ms": launch, "ductile_run_ms": fresh, "mpirun_ms": ompi}));
    }
    let path = profile_dir().parent().expect("target dir").join("bench-launch.json");
    let doc = json!({"reps": reps, "tasks": TASKS, "rows": rows});
    std::fs::write(&path, serde_json::to_string_pretty(&doc).expect("json")).expect("write results");
    println!("results: {}", path.display());
    let series = [("Group::launch", "launch_ms"), ("fresh ductile run", "ductile_run_ms"), ("mpirun", "mpirun_ms")];
    let bars = Bars {
        title: "a child job of P processes, ms per job (median of jobs)",
        y: "ms",
        groups: rows.iter().map(|r| format!("P = {}", r["procs"])).collect(),
        series: series
            .iter()
            .map(|(name, key)| (name.to_string(), rows.iter().map(|r| r[key].as_f64()).collect()))
            .collect(),
        log: false,
    };
    plot::write_beside(&path, &bars);
}
