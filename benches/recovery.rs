//! Recovery benchmark: a failed process as a shrink the job did not ask for (`ductile run
//! --on-failure shrink`), against the same shrink planned, and against what a job does
//! without recovery: end, and start again on the processes left. All in the same run.
//!
//! ```text
//! benches/peers/build.sh          # the Open MPI peer (installs Open MPI as root if missing)
//! cargo bench --bench recovery    # DUCTILE_BENCH_REPS=5 by default
//! ```
//!
//! Every job runs `examples/fault.rs recover` on P processes, one per node, with D MiB of
//! registered data (a distributed array of u64), one step of an allreduce and a
//! checkpoint after another:
//! - **failure**: the last rank exits with an error at step 3. The figure is the
//!   reconfiguration's `total` in the job report: from the launcher seeing the failure
//!   to the survivors in their new group, the data moved (its `redistribute` phase is
//!   given too, the slowest survivor's). A quarter to an eighth of the data is lost, so
//!   less moves than in the planned shrink.
//! - **planned**: the policy shrinks P → P-1 nodes at checkpoint 3. Its `total` runs
//!   from rank 0's checkpoint to the released process and its agent gone.
//! - **relaunch**: the wall time of `mpirun -n P-1` of an empty MPI program (Open
//!   MPI's start-up and finalization alone, before any data is read back), the least a
//!   job without recovery pays to go on. Skipped, loudly, without Open MPI.
//!
//! Results go to `target/bench-recovery.json`.

use ductile_suite::bench::{median, ompi_relaunch};
use ductile_suite::paths::{ductile_bin, example, mpi_peer, profile_dir};
use serde_json::json;
use std::process::Command;

const PROCS: [u32; 2] = [4, 8];
const MIB: [u64; 2] = [64, 256];

/// One job of P processes with `mib` MiB registered; `fail` makes the last rank fail at
/// step 3, else the policy shrinks to P-1 there. Returns (total, redistribute) in ms.
fn job(procs: u32, mib: u64, fail: bool) -> (f64, f64) {
    let report = std::env::temp_dir().join(format!("ductile-bench-recovery-{}.json", std::process::id()));
    let (n, elements) = (procs.to_string(), (mib << 20) / 8);
    let mut c = Command::new(ductile_bin());
    c.args(["run", "-n", &n, "--nodes", &n, "--timeout", "120", "--report", report.to_str().expect("utf-8")]);
    let policy = format!("steps:{}", procs - 1);
    let dies = if fail {
        c.args(["--on-failure", "shrink"]);
        (procs - 1).to_string()
    } else {
        c.args(["--policy", &policy, "--period", "3"]);
        "none".to_string()
    };
    c.arg("--").arg(example("fault")).args(["recover", &dies, "3", "5", "0", &elements.to_string()]);
    let out = c.output().expect("start ductile run");
    assert!(out.status.success(), "ductile job failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("report")).expect("report is JSON");
    let _ = std::fs::remove_file(&report);
    let r = v["reconfigurations"].as_array().expect("reconfigurations");
    assert_eq!(r.len(), 1, "expected one shrink: {r:?}");
    assert_eq!(r[0]["trigger"], if fail { "failure" } else { "policy" }, "{r:?}");
    let phase = |p: &str| r[0]["phases_ms"][p].as_f64().expect("phase");
    (phase("total"), phase("redistribute"))
}

fn main() {
    let Some(reps) = ductile_suite::bench::start() else { return };
    let peer = mpi_peer("spawn");
    let mut rows = Vec::new();
    println!("recovery benchmark, median of {reps} jobs per figure, ms (redistribute phase in brackets)");
    println!("{:>5} {:>5} | {:>18} {:>18} | {:>9}", "procs", "MiB", "failure", "planned shrink", "relaunch");
    for &procs in &PROCS {
        for &mib in &MIB {
            let fail: Vec<(f64, f64)> = (0..reps).map(|_| job(procs, mib, true)).collect();
            let plan: Vec<(f64, f64)> = (0..reps).map(|_| job(procs, mib, false)).collect();
            let m = |v: &[(f64, f64)], f: fn(&(f64, f64)) -> f64| median(v.iter().map(f).collect());
            let (ft, fr, pt, pr) = (m(&fail, |x| x.0), m(&fail, |x| x.1), m(&plan, |x| x.0), m(&plan, |x| x.1));
            let relaunch = peer.as_ref().map(|p| median((0..reps).map(|_| ompi_relaunch(p, procs - 1)).collect()));
            let both = |t: f64, r: f64| format!("{t:.1} [{r:.1}]");
            println!(
                "{procs:>5} {mib:>5} | {:>18} {:>18} | {:>9}",
                both(ft, fr),
                both(pt, pr),
                relaunch.map_or_else(|| "-".to_string(), |x| format!("{x:.1}"))
            );
            rows.push(json!({
                "procs": procs, "mib": mib,
                "failure_ms": {"total": ft, "redistribute": fr},
                "planned_shrink_ms": {"total": pt, "redistribute": pr},
                "ompi_relaunch_ms": relaunch,
            }));
        }
    }
    let out = profile_dir().parent().map(|t| t.join("bench-recovery.json")).expect("target directory");
    let doc = json!({"reps": reps, "rows": rows});
    match std::fs::write(&out, serde_json::to_string_pretty(&doc).expect("json") + "\n") {
        Ok(()) => println!("results: {}", out.display()),
        Err(e) => eprintln!("cannot write {}: {e}", out.display()),
    }
}
