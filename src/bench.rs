//! Helpers shared by the whole-job benchmarks (`benches/`).

use std::path::Path;
use std::process::Command;
use std::time::Instant;

/// A whole-job bench's start: `None` when `cargo test --benches` lists it (it passes
/// `--list`), else the release build of the current code is made and the jobs per
/// figure are returned ([`reps`]).
#[must_use]
pub fn start() -> Option<usize> {
    if std::env::args().any(|a| a == "--list") {
        return None;
    }
    crate::paths::build_release();
    Some(reps())
}

/// Jobs per figure: `DUCTILE_BENCH_REPS`, else 5.
#[must_use]
pub fn reps() -> usize {
    std::env::var("DUCTILE_BENCH_REPS").ok().and_then(|v| v.parse().ok()).filter(|&r| r > 0).unwrap_or(5)
}

/// The median of `v` (the upper one of an even count).
///
/// # Panics
/// When `v` is empty.
#[must_use]
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `mpirun -n np` over Open MPI's ob1 with the shared-memory and loopback TCP BTLs.
#[must_use]
pub fn mpirun(np: u32) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe", "-n", &np.to_string(), "--mca", "pml", "ob1"]);
    c.args(["--mca", "btl", "self,vader,tcp", "--mca", "btl_tcp_if_include", "lo"]);
    c
}

/// Wall time of a whole `mpirun -n procs` of the empty peer (`spawn 0`: initializes
/// and finalizes), ms.
///
/// # Panics
/// When mpirun cannot be started or fails.
#[must_use]
pub fn ompi_relaunch(peer: &Path, procs: u32) -> f64 {
    let t = Instant::now();
    let out = mpirun(procs).arg(peer).arg("0").output().expect("start mpirun");
    assert!(out.status.success(), "mpirun relaunch failed: {out:?}");
    t.elapsed().as_secs_f64() * 1e3
}
