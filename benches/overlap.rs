//! Background redistribution benchmark: how many iterations of the Jacobi solver run
//! while a constant item moves in the background, and how much slower they are (the
//! slowdown ω of paper 003: mean iteration time during the move over the mean of the
//! 20 iterations before it), for every executor.
//!
//! ```text
//! cargo bench --bench overlap        # DUCTILE_BENCH_REPS=5 by default
//! ```
//!
//! Each job is `ductile run --background` of `examples/jacobi.rs --background
//! --table-mib 256`: the solver computes on 2^20 points (8 MiB of variable data, 8 MiB
//! of constant coefficients) and registers a 256 MiB constant table it does not read,
//! so the move competes with the solver for the cores and the memory bandwidth and
//! with nothing else. One resize per job (the pair's growth or shrink) at the 60th
//! checkpoint; a checkpoint after every iteration. ω's baseline is the 20 iterations
//! before the change began (before new processes started, for a growth). The solver prints the overlapped iterations, ω and the move's
//! duration; the figure of each cell is the median over the repetitions. The same job
//! without `--background` gives the time the solver is stopped for the same move (the
//! report's `redistribute` phase), shown beside it. The move is paced as the ranks'
//! `DUCTILE_BACKGROUND_SHARE` says (inherited from the bench's environment; 0.15 by
//! default, 1 moves at full speed). `DUCTILE_BENCH_TRANSPORT` picks the transport:
//! `tcp` (the default), `quic`, or `fabric:PROVIDER` (e.g. `fabric:shm`).

use ductile_suite::bench::{median, reps};
use ductile_suite::paths::{ductile_bin, example};
use std::process::Command;

const METHODS: [&str; 3] = ["collective", "p2p", "rma"];
const PAIRS: [(u32, u32); 3] = [(1, 2), (2, 1), (2, 4)];

/// `ductile run`'s transport arguments, from `DUCTILE_BENCH_TRANSPORT`.
fn transport_args() -> Vec<String> {
    let spec = std::env::var("DUCTILE_BENCH_TRANSPORT").unwrap_or_else(|_| "tcp".into());
    let (name, provider) = match spec.split_once(':') {
        Some((name, provider)) => (name, Some(provider)),
        None => (spec.as_str(), None),
    };
    if !["tcp", "quic", "fabric"].contains(&name) || (provider.is_some() && name != "fabric") {
        eprintln!("DUCTILE_BENCH_TRANSPORT={spec:?}: expected tcp, quic or fabric:PROVIDER");
        std::process::exit(2);
    }
    let mut args = vec!["--transport".to_string(), name.to_string()];
    if let Some(p) = provider {
        args.extend(["--fabric-provider".to_string(), p.to_string()]);
    }
    args
}

/// What one job measured.
struct Run {
    /// Iterations that ran during the move (background) or 0.
    overlapped: f64,
    /// Slowdown of those iterations.
    omega: f64,
    /// Background move, ms (background) or the blocking redistribution, ms.
    move_ms: f64,
}

fn job(method: &str, (from, to): (u32, u32), background: bool) -> Run {
    let report = std::env::temp_dir().join(format!("ductile-bench-overlap-{}.json", std::process::id()));
    let (n, max, policy) = (from.to_string(), from.max(to).to_string(), format!("steps:{to}"));
    let mut cmd = Command::new(ductile_bin());
    cmd.args(["run", "-n", &n, "--slots", "1", "--max-nodes", &max, "--policy", &policy, "--period", "60"])
        .args(["--timeout", "300"])
        .args(transport_args())
        .args(["--redistribution", method, "--report", report.to_str().expect("utf-8 temp dir")]);
    if background {
        cmd.arg("--background");
    }
    let out = cmd
        .arg("--")
        .arg(example("jacobi"))
        .args(["--background", "--points", "1048576", "--iters", "2500", "--every", "1", "--table-mib", "256"])
        .output()
        .expect("start ductile run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "jacobi job failed: {}\n{text}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("report")).expect("report is JSON");
    let _ = std::fs::remove_file(&report);
    let phases = &v["reconfigurations"][0]["phases_ms"];
    if !background {
        let move_ms = phases["redistribute"].as_f64().expect("redistribute phase");
        return Run { overlapped: 0.0, omega: f64::NAN, move_ms };
    }
    // "jacobi: change 1: constant data moved in X ms while K iterations ran, omega W"
    let line =
        text.lines().find(|l| l.contains("constant data moved in")).unwrap_or_else(|| panic!("no overlap: {text}"));
    let field = |after: &str| -> f64 {
        line.split(after).nth(1).and_then(|r| r.split_whitespace().next()).and_then(|v| v.parse().ok()).expect(after)
    };
    Run { overlapped: field("while "), omega: field("omega "), move_ms: field("moved in ") }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    ductile_suite::paths::build_release();
    let reps = reps();
    let transport = transport_args().join(" ");
    println!("background redistribution of a 256 MiB constant item under jacobi, median of {reps} jobs, {transport}");
    println!(
        "{:>6} {:>10} | {:>10} {:>8} {:>12} | {:>14}",
        "pair", "method", "overlapped", "omega", "move ms", "blocking ms"
    );
    for pair in PAIRS {
        for method in METHODS {
            let bg: Vec<Run> = (0..reps).map(|_| job(method, pair, true)).collect();
            let blocking: Vec<f64> = (0..reps).map(|_| job(method, pair, false).move_ms).collect();
            println!(
                "{:>6} {:>10} | {:>10.0} {:>8.2} {:>12.1} | {:>14.1}",
                format!("{}->{}", pair.0, pair.1),
                method,
                median(bg.iter().map(|r| r.overlapped).collect()),
                median(bg.iter().map(|r| r.omega).collect()),
                median(bg.iter().map(|r| r.move_ms).collect()),
                median(blocking),
            );
        }
    }
}
