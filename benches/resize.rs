//! Resize benchmark: expansion from 1 node to N nodes and shrink back, side by side with
//! Open MPI's `MPI_Comm_spawn` + `MPI_Intercomm_merge` for the same process counts and
//! with a full relaunch (`mpirun -n K`), all in the same run.
//!
//! ```text
//! benches/peers/build.sh          # the Open MPI peer (installs Open MPI as root if missing)
//! cargo bench --bench resize      # DUCTILE_BENCH_REPS=5 by default
//! ```
//!
//! A whole-job benchmark, so it is a plain harness rather than criterion: each figure
//! is the median of `DUCTILE_BENCH_REPS` jobs. ductile's times come from the job
//! report (`--report`): a growth's `total` runs from rank 0's checkpoint reaching the
//! controller to the new group being complete (new processes started, bound, joined,
//! state handed over); a shrink's `total` runs to the moment every released process and
//! agent is gone. Open MPI's figure is measured by its rank 0 from before
//! `MPI_Comm_spawn` to after a barrier on the merged communicator. The relaunch figure
//! is the wall time of `mpirun -n K` of an empty MPI program. Results go to
//! `target/bench-resize.json`.

use ductile_suite::bench::{median, mpirun, ompi_relaunch};
use ductile_suite::paths::{ductile_bin, example, mpi_peer, profile_dir};
use ductile_suite::plot::{self, Bars};
use serde_json::json;
use std::path::Path;
use std::process::Command;

const NODES: [u32; 4] = [2, 4, 8, 16];
const SLOTS: [u32; 2] = [1, 4];
const VARIANTS: [(&str, &str); 4] =
    [("parallel", "merge"), ("single", "merge"), ("parallel", "baseline"), ("single", "baseline")];

/// One ductile job growing 1 -> `n` nodes and shrinking back; (grow ms, shrink ms).
fn ductile_job(n: u32, slots: u32, strategy: &str, method: &str) -> (f64, f64) {
    let report = std::env::temp_dir().join(format!("ductile-bench-resize-{}.json", std::process::id()));
    let (nodes, slots_s, policy) = (n.to_string(), slots.to_string(), format!("steps:{n},1"));
    let out = Command::new(ductile_bin())
        .args(["run", "--nodes", "1", "--slots", &slots_s, "--max-nodes", &nodes, "--policy", &policy])
        .args(["--spawn", strategy, "--method", method, "--timeout", "120"])
        .args(["--report", report.to_str().expect("utf-8 temp dir"), "--"])
        .arg(example("jacobi"))
        .args(["--points", "4096", "--iters", "4", "--every", "1"])
        .output()
        .expect("start ductile run");
    assert!(out.status.success(), "ductile job failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("report")).expect("report is JSON");
    let _ = std::fs::remove_file(&report);
    let r = v["reconfigurations"].as_array().expect("reconfigurations");
    assert_eq!(r.len(), 2, "expected a growth and a shrink: {r:?}");
    let total = |i: usize| r[i]["phases_ms"]["total"].as_f64().expect("total");
    (total(0), total(1))
}

/// Open MPI: `parents` processes spawn `children` and merge; ms.
fn ompi_spawn(peer: &Path, parents: u32, children: u32) -> f64 {
    let out = mpirun(parents).arg(peer).arg(children.to_string()).output().expect("start mpirun");
    assert!(out.status.success(), "mpirun spawn failed: {out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let ns: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("elapsed_ns="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no elapsed_ns in {text}"));
    ns / 1e6
}

fn main() {
    let Some(reps) = ductile_suite::bench::start() else { return };
    let peer = mpi_peer("spawn");
    let mut rows = Vec::new();
    println!("resize benchmark, median of {reps} jobs per figure, ms");
    println!(
        "{:>5} {:>5} {:>6} | {:>9} {:>9} {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>7}",
        "nodes",
        "slots",
        "procs",
        "par/merge",
        "sgl/merge",
        "par/base",
        "sgl/base",
        "ompi_spwn",
        "relaunch",
        "shrink",
        "ompi/par"
    );
    for &slots in &SLOTS {
        for &n in &NODES {
            let mut grow = Vec::new();
            let mut shrink = Vec::new();
            for (strategy, method) in VARIANTS {
                let runs: Vec<(f64, f64)> = (0..reps).map(|_| ductile_job(n, slots, strategy, method)).collect();
                grow.push(median(runs.iter().map(|r| r.0).collect()));
                if (strategy, method) == ("parallel", "merge") {
                    shrink = runs.iter().map(|r| r.1).collect();
                }
            }
            let shrink = median(shrink);
            let (spawn, relaunch) = match &peer {
                Some(p) => (
                    Some(median((0..reps).map(|_| ompi_spawn(p, slots, slots * (n - 1))).collect())),
                    Some(median((0..reps).map(|_| ompi_relaunch(p, slots * n)).collect())),
                ),
                None => (None, None),
            };
            let f = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |x| format!("{x:.1}"));
            let ratio = spawn.map(|s| s / grow[0]);
            println!(
                "{n:>5} {slots:>5} {:>6} | {:>9.1} {:>9.1} {:>9.1} {:>9.1} | {:>9} {:>9} | {:>9.1} {:>7}",
                n * slots,
                grow[0],
                grow[1],
                grow[2],
                grow[3],
                f(spawn),
                f(relaunch),
                shrink,
                ratio.map_or_else(|| "-".to_string(), |r| format!("{r:.1}x"))
            );
            rows.push(json!({
                "nodes": n, "slots": slots, "procs_after": n * slots,
                "ductile_grow_ms": {"parallel_merge": grow[0], "single_merge": grow[1],
                                    "parallel_baseline": grow[2], "single_baseline": grow[3]},
                "ductile_shrink_ms": shrink,
                "ompi_spawn_merge_ms": spawn, "ompi_relaunch_ms": relaunch,
            }));
        }
    }
    let out = profile_dir().parent().map(|t| t.join("bench-resize.json")).expect("target directory");
    let doc = json!({"reps": reps, "rows": rows});
    if let Err(e) = std::fs::write(&out, serde_json::to_string_pretty(&doc).expect("json") + "\n") {
        eprintln!("cannot write {}: {e}", out.display());
    } else {
        println!("results: {}", out.display());
    }
    plot::write_beside(&out, &plot_of(&rows));
}

/// The figures as bars: one group per growth 1 → N nodes of S slots, log scale (Open
/// MPI's times are one to two orders above).
fn plot_of(rows: &[serde_json::Value]) -> Bars<'static> {
    let series = [
        ("ductile parallel/merge", "/ductile_grow_ms/parallel_merge"),
        ("ductile single/merge", "/ductile_grow_ms/single_merge"),
        ("ductile parallel/baseline", "/ductile_grow_ms/parallel_baseline"),
        ("ductile single/baseline", "/ductile_grow_ms/single_baseline"),
        ("ductile shrink N → 1", "/ductile_shrink_ms"),
        ("Open MPI spawn + merge", "/ompi_spawn_merge_ms"),
        ("mpirun relaunch", "/ompi_relaunch_ms"),
    ];
    Bars {
        title: "growth 1 → N nodes of S slots (N×S) and its shrink back, median ms",
        y: "ms",
        groups: rows.iter().map(|r| format!("{}×{}", r["nodes"], r["slots"])).collect(),
        series: series
            .iter()
            .map(|(name, at)| (name.to_string(), rows.iter().map(|r| r.pointer(at).and_then(|v| v.as_f64())).collect()))
            .collect(),
        log: true,
    }
}
