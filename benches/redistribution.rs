//! Redistribution benchmark: one distributed array of f64 (256 MiB by default) moved from
//! NS to NT blocks for 2→4, 4→2, 1→4, 4→1, 2→8 and 8→2, by each of ductile's executors
//! (collective, p2p, rma) over tcp and over fabric with the shm provider, side by side
//! with Open MPI in the same run, and with the machine's own copy and loopback rates.
//!
//! ```text
//! benches/peers/build.sh                                  # Open MPI peer target/peers/redist
//! cargo bench --all-features --bench redistribution       # DUCTILE_BENCH_REPS=3 by default
//! ```
//!
//! With `CARGO_TARGET_DIR` set, build the peer into `$CARGO_TARGET_DIR/peers`
//! (`OUT_DIR=$CARGO_TARGET_DIR/peers benches/peers/build.sh`).
//!
//! A whole-job benchmark, so a plain harness: every figure is the median (and min-max)
//! of `DUCTILE_BENCH_REPS` jobs, effective GB/s = array bytes / time (1 GB = 10^9 B).
//! The runs are interleaved: each round runs every case of every pair once, so a slow
//! spell of the shared 2-core machine falls on all cases alike.
//! Knobs: `DUCTILE_BENCH_MIB` (array size, default 256), `DUCTILE_BENCH_PAIRS`
//! (e.g. `2:4,8:2`), `DUCTILE_BENCH_GROWTH` (`merge`, the default, or `baseline`: the
//! launcher's `--method`).
//!
//! What is timed:
//! - **ductile**: `ductile run -n NS --slots 1 --max-nodes 8 --policy steps:NT
//!   --redistribution M --transport T`, one rank per simulated node. This executable is
//!   the rank program (`--rank GLOBAL`): it registers the array with
//!   `Session::distribute`, reaches one checkpoint where the policy resizes it, checks
//!   every element of its new block and finalizes. The figure is the job report's
//!   `reconfigurations[0].phases_ms.redistribute`: the slowest member's time for
//!   moving the registered data, from after the new membership is installed and the
//!   manifest agreed (connect phase) to its block being complete; it includes
//!   allocating the new blocks. Growth starts the new processes (fresh) before this.
//!   Over shm, rma hands whole pages over between the processes (the runtime's
//!   `pages`); **ductile_fabric_shm_copy_rma** is the same job with
//!   `DUCTILE_PAGE_HANDOVER=0 DUCTILE_PAGE_RECYCLE=0`, copying every byte. Over tcp,
//!   every executor moves the pages of a member's own overlap from its old block into
//!   its new one, and rma recycles the old block's other pages too (the runtime's
//!   `anon`); over shm, the collective and p2p do as over tcp;
//!   **ductile_tcp_fresh_M** is the same job with `DUCTILE_PAGE_RECYCLE=0`, faulting in
//!   fresh pages for every new block.
//! - **ompi_spawn_a2av**: `benches/peers/redist.c spawn-alltoallv`: NS parents spawn NT
//!   children, merge, then `MPI_Alltoallv` over the merged communicator moves every
//!   block to the children (timed barrier to barrier, spawn and merge excluded), over
//!   `--mca btl self,vader,tcp` (parents and children reach each other over TCP).
//! - **ompi_spawn_rma**: the same spawn, then `MPI_Win_create` + `MPI_Win_lock_all` +
//!   `MPI_Get` + unlock + `MPI_Win_free`, window creation included, with `--mca osc
//!   sm,rdma,pt2pt` (Debian disables pt2pt).
//! - **ompi_injob_a2av**: one `mpirun -n max(NS,NT)` over `--mca btl self,vader`:
//!   `MPI_Alltoallv` from ranks 0..NS to ranks 0..NT over shared memory, the peer of
//!   ductile's fabric shm.
//! - **references**, in this process: `memcpy` of the array into fresh pages (the
//!   allocation and every page fault inside the time) and into warm pages, and a TCP
//!   stream of the array between two threads over 127.0.0.1 into fresh and warm pages.
//!
//! Fresh pages: every destination block is a new allocation never touched before the
//! transfer, in ductile (a zeroed allocation of ≥ 32 MiB is a fresh mapping) and in the
//! peer (children `malloc`). The `faults/page` column says how many minor page faults
//! the destination processes took per destination page: from the checkpoint to its end
//! for ductile's surviving processes, from `exec` to the end of `init` for its new
//! ones (so runtime start-up is in it), inside the timed interval for the peer.
//!
//! Results go to `target/bench-redistribution.json`.

use ductile::{Checkpoint, Session};
use ductile_suite::paths::{ductile_bin, mpi_peer, profile_dir};
use ductile_suite::plot::{self, Bars};
use serde_json::json;
use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const PAIRS: [(u32, u32); 6] = [(2, 4), (4, 2), (1, 4), (4, 1), (2, 8), (8, 2)];
const METHODS: [&str; 3] = ["collective", "p2p", "rma"];
const ITEM: &str = "u";
const PAGE: u64 = 4096;

/// A ductile transport as the bench runs it.
struct Backend {
    label: &'static str,
    short: &'static str,
    name: &'static str,
    provider: Option<&'static str>,
    /// The executors run over it.
    methods: &'static [&'static str],
    /// Environment of its jobs.
    env: &'static [(&'static str, &'static str)],
}

const BACKENDS: [Backend; 4] = [
    Backend { label: "tcp", short: "tcp", name: "tcp", provider: None, methods: &METHODS, env: &[] },
    // Every executor over tcp with fresh pages for every new block, as without page
    // recycling: the peer of the recycling in the same run.
    Backend {
        label: "tcp_fresh",
        short: "tcpf",
        name: "tcp",
        provider: None,
        methods: &METHODS,
        env: &[("DUCTILE_PAGE_RECYCLE", "0")],
    },
    Backend { label: "fabric_shm", short: "shm", name: "fabric", provider: Some("shm"), methods: &METHODS, env: &[] },
    // rma over shm copying every byte, as without page handover (nor recycling): the
    // peer of the handover in the same run.
    Backend {
        label: "fabric_shm_copy",
        short: "shmc",
        name: "fabric",
        provider: Some("shm"),
        methods: &["rma"],
        env: &[("DUCTILE_PAGE_HANDOVER", "0"), ("DUCTILE_PAGE_RECYCLE", "0")],
    },
];

/// The Open MPI cases: label, short label, peer mode, extra mpirun arguments.
const OMPI: [(&str, &str, &str, &[&str]); 3] = [
    (
        "ompi_spawn_a2av",
        "o:sp/a2av",
        "spawn-alltoallv",
        &["--mca", "btl", "self,vader,tcp", "--mca", "btl_tcp_if_include", "lo"],
    ),
    (
        "ompi_spawn_rma",
        "o:sp/rma",
        "spawn-rma",
        &["--mca", "btl", "self,vader,tcp", "--mca", "btl_tcp_if_include", "lo", "--mca", "osc", "sm,rdma,pt2pt"],
    ),
    ("ompi_injob_a2av", "o:job/a2av", "injob-alltoallv", &["--mca", "btl", "self,vader"]),
];

/// The value of global element `g`, the same function as the C peer's.
fn value(g: u64) -> f64 {
    g as f64 + 0.5
}

/// Minor page faults of this process so far (`/proc/self/stat`, field 10).
fn minflt() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The command name (field 2) is parenthesised and may hold spaces: count after it.
    stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(7)).and_then(|v| v.parse().ok()).unwrap_or(0)
}

// ---------------------------------------------------------------- rank program

/// Checks this rank's block, prints its fault count and finalizes.
fn finish(s: Session, role: &str, faults: u64) -> anyhow::Result<()> {
    let range = s.block_range(ITEM)?;
    let block = s.block::<f64>(ITEM)?;
    anyhow::ensure!(block.len() as u64 == range.end - range.start, "holds {} elements for {range:?}", block.len());
    if let Some(i) = (0..block.len()).find(|&i| block[i].to_bits() != value(range.start + i as u64).to_bits()) {
        anyhow::bail!("element {} is {}, expected {}", range.start + i as u64, block[i], value(range.start + i as u64));
    }
    let pages = (block.len() as u64 * 8).div_ceil(PAGE);
    println!("redist_bench rank={} role={role} pages={pages} minflt={faults}", s.world().rank());
    Ok(s.finalize()?)
}

/// The rank side: registers `global` elements, takes part in one change, checks.
fn rank_main(global: u64) -> anyhow::Result<()> {
    let at_exec = minflt();
    let mut s = ductile::init()?;
    if s.joined().is_some() {
        // Started by the growth: init() joined the change and received the block.
        let faults = minflt() - at_exec;
        return finish(s, "new", faults);
    }
    let (rank, size) = (s.world().rank() as u32, s.world().size() as u32);
    let block: Vec<f64> = ductile::block_range(global, size, rank).map(value).collect();
    s.distribute(ITEM, global, &block)?;
    drop(block);
    let before = minflt();
    loop {
        match s.checkpoint()? {
            Checkpoint::Resized(_) => {
                let faults = minflt() - before;
                return finish(s, "kept", faults);
            }
            Checkpoint::Released(_) => return Ok(s.finalize()?),
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

// ---------------------------------------------------------------- measurements

/// One measured run: seconds, and the destination side's faults and pages.
#[derive(Clone, Copy, Debug)]
struct Sample {
    secs: f64,
    faults: u64,
    pages: u64,
}

/// The runs of one case, or why it failed.
type Runs = Result<Vec<Sample>, String>;

fn setting(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// A numeric knob in `range`, or `default` when unset; anything else stops the bench.
fn number(name: &str, range: std::ops::RangeInclusive<u64>, default: u64) -> u64 {
    let Some(v) = setting(name) else { return default };
    match v.parse() {
        Ok(n) if range.contains(&n) => n,
        _ => {
            eprintln!("{name}={v:?}: expected an integer in {}..={}", range.start(), range.end());
            std::process::exit(2)
        }
    }
}

fn reps() -> usize {
    number("DUCTILE_BENCH_REPS", 1..=1000, 3) as usize
}

/// The array's size in MiB; the C peer counts elements in an `int` (< 2^31, 16 GiB).
fn array_mib() -> u64 {
    number("DUCTILE_BENCH_MIB", 1..=(16 << 10) - 1, 256)
}

fn pairs() -> Vec<(u32, u32)> {
    let Some(spec) = setting("DUCTILE_BENCH_PAIRS") else { return PAIRS.to_vec() };
    let parsed: Option<Vec<(u32, u32)>> = spec
        .split(',')
        .map(|p| {
            let (a, b) = p.split_once(':')?;
            let (a, b) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
            (1..=8).contains(&a).then_some(())?;
            (1..=8).contains(&b).then_some(())?;
            (a != b).then_some((a, b))
        })
        .collect();
    parsed.unwrap_or_else(|| {
        eprintln!("DUCTILE_BENCH_PAIRS={spec:?}: expected NS:NT,... with 1..=8 processes and NS != NT");
        std::process::exit(2)
    })
}

fn growth_method() -> String {
    let m = setting("DUCTILE_BENCH_GROWTH").unwrap_or_else(|| "merge".into());
    if m != "merge" && m != "baseline" {
        eprintln!("DUCTILE_BENCH_GROWTH={m:?}: expected merge or baseline");
        std::process::exit(2);
    }
    m
}

fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(6)..].join(" | ")
}

/// One ductile job resizing `ns` -> `nt`.
fn ductile_job(be: &Backend, method: &str, growth: &str, (ns, nt): (u32, u32), global: u64) -> Result<Sample, String> {
    let report = std::env::temp_dir().join(format!("ductile-bench-redist-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&report);
    let me = std::env::current_exe().map_err(|e| format!("bench executable path: {e}"))?;
    let mut cmd = Command::new(ductile_bin());
    cmd.args(["run", "-n", &ns.to_string(), "--slots", "1", "--max-nodes", "8", "--policy", &format!("steps:{nt}")]);
    cmd.args(["--redistribution", method, "--method", growth, "--transport", be.name, "--timeout", "300"]);
    if let Some(p) = be.provider {
        cmd.args(["--fabric-provider", p]);
    }
    let out = cmd
        .envs(be.env.iter().copied())
        .arg("--report")
        .arg(&report)
        .arg("--")
        .arg(me)
        .args(["--rank", &global.to_string()])
        .output()
        .map_err(|e| format!("cannot start {}: {e}", ductile_bin().display()))?;
    let doc = std::fs::read_to_string(&report);
    let _ = std::fs::remove_file(&report);
    if !out.status.success() {
        return Err(format!("ductile run exited with {}: {}", out.status, tail(&out.stderr)));
    }
    let doc: serde_json::Value = serde_json::from_str(&doc.map_err(|e| format!("no report: {e}"))?)
        .map_err(|e| format!("report is not JSON: {e}"))?;
    let ms = doc["reconfigurations"][0]["phases_ms"]["redistribute"]
        .as_f64()
        .ok_or_else(|| format!("report has no reconfigurations[0].phases_ms.redistribute: {doc}"))?;
    let (mut faults, mut pages, mut ranks) = (0, 0, 0);
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(rest) = line.split("redist_bench ").nth(1) else { continue };
        let field = |k: &str| rest.split_whitespace().find_map(|f| f.strip_prefix(k)?.parse::<u64>().ok());
        faults += field("minflt=").unwrap_or(0);
        pages += field("pages=").unwrap_or(0);
        ranks += 1;
    }
    if ranks != nt {
        return Err(format!("{ranks} of {nt} new ranks reported their block: {}", tail(&out.stdout)));
    }
    Ok(Sample { secs: ms / 1e3, faults, pages })
}

/// One Open MPI peer job.
fn ompi_job(peer: &Path, mode: &str, extra: &[&str], (ns, nt): (u32, u32), global: u64) -> Result<Sample, String> {
    let np = if mode.starts_with("injob") { ns.max(nt) } else { ns };
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-n", &np.to_string(), "--mca", "pml", "ob1"])
        .args(extra)
        .arg(peer)
        .args([mode, &ns.to_string(), &nt.to_string(), &global.to_string()])
        .output()
        .map_err(|e| format!("cannot start mpirun: {e}"))?;
    if !out.status.success() {
        return Err(format!("mpirun exited with {}: {}", out.status, tail(&out.stderr)));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.starts_with("elapsed_ns=")).ok_or_else(|| format!("no elapsed_ns: {text}"))?;
    let field = |k: &str| line.split_whitespace().find_map(|f| f.strip_prefix(k)?.parse::<u64>().ok());
    match (field("elapsed_ns="), field("dest_minflt="), field("dest_pages=")) {
        (Some(ns), Some(faults), Some(pages)) => Ok(Sample { secs: ns as f64 / 1e9, faults, pages }),
        _ => Err(format!("cannot read {line:?}")),
    }
}

/// Adds one run's outcome to a case; a case's first failure ends it.
fn record(runs: &mut Runs, outcome: Result<Sample, String>) {
    if let Ok(done) = runs {
        match outcome {
            Ok(sample) => done.push(sample),
            Err(e) => *runs = Err(e),
        }
    }
}

/// `memcpy` of `src` into a new allocation (fresh pages, the allocation and every
/// page fault in the time), then into the same, now touched, allocation (warm).
fn memcpy_once(src: &[u8]) -> (Sample, Sample) {
    let pages = (src.len() as u64).div_ceil(PAGE);
    let (f0, t0) = (minflt(), Instant::now());
    // A zeroed allocation this large is a fresh mapping: no page is touched yet.
    let mut dst = vec![0u8; src.len()];
    dst.copy_from_slice(src);
    std::hint::black_box(&mut dst);
    let fresh = Sample { secs: t0.elapsed().as_secs_f64(), faults: minflt() - f0, pages };
    let (f0, t0) = (minflt(), Instant::now());
    dst.copy_from_slice(src);
    std::hint::black_box(&mut dst);
    (fresh, Sample { secs: t0.elapsed().as_secs_f64(), faults: minflt() - f0, pages })
}

/// One TCP stream of `src` over 127.0.0.1 from one thread to another, read into `dst`
/// (or a new allocation if `None`), timed by the reader from a common start.
fn tcp_once(src: &[u8], dst: Option<&mut Vec<u8>>) -> Result<Sample, String> {
    let io = |e: std::io::Error| format!("loopback stream: {e}");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(io)?;
    let addr = listener.local_addr().map_err(io)?;
    let mut tx = std::net::TcpStream::connect(addr).map_err(io)?;
    let (rx, _) = listener.accept().map_err(io)?;
    let start = std::sync::Barrier::new(2);
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            start.wait();
            tx.write_all(src)
        });
        start.wait();
        // Owned here, so an early error closes it and the writer does not block.
        let mut rx = rx;
        let (f0, t0) = (minflt(), Instant::now());
        let mut fresh;
        let buf = match dst {
            Some(d) => d,
            None => {
                fresh = vec![0u8; src.len()];
                &mut fresh
            }
        };
        rx.read_exact(buf).map_err(io)?;
        let secs = t0.elapsed().as_secs_f64();
        let faults = minflt() - f0;
        writer.join().map_err(|_| "loopback writer panicked".to_string())?.map_err(io)?;
        Ok(Sample { secs, faults, pages: (src.len() as u64).div_ceil(PAGE) })
    })
}

// ---------------------------------------------------------------- reporting

/// The median run by time (the upper middle one for an even count).
fn median_of(runs: &[Sample]) -> Sample {
    let mut v = runs.to_vec();
    v.sort_by(|a, b| a.secs.total_cmp(&b.secs));
    v[v.len() / 2]
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// Median GB/s of a case, if it ran.
fn rate(runs: &Runs, bytes: u64) -> Option<f64> {
    runs.as_ref().ok().filter(|r| !r.is_empty()).map(|r| gbps(bytes, median_of(r).secs))
}

fn line(label: &str, runs: &Runs, bytes: u64) -> String {
    match runs {
        Ok(r) if !r.is_empty() => {
            let m = median_of(r);
            let lo = r.iter().map(|s| s.secs).fold(f64::INFINITY, f64::min);
            let hi = r.iter().map(|s| s.secs).fold(0.0, f64::max);
            format!(
                "  {label:<28} {:>9.2} ms  [{:>8.2} - {:>8.2}]  {:>6.2} GB/s  [{:>5.2} - {:>5.2}]  faults/page {:.2}",
                m.secs * 1e3,
                lo * 1e3,
                hi * 1e3,
                gbps(bytes, m.secs),
                gbps(bytes, hi),
                gbps(bytes, lo),
                m.faults as f64 / m.pages.max(1) as f64
            )
        }
        Ok(_) => format!("  {label:<28} no runs"),
        Err(e) => format!("  {label:<28} FAILED: {e}"),
    }
}

fn to_json(runs: &Runs, bytes: u64) -> serde_json::Value {
    match runs {
        Ok(r) if !r.is_empty() => {
            let m = median_of(r);
            json!({
                "median_ms": m.secs * 1e3, "median_gbps": gbps(bytes, m.secs),
                "runs_ms": r.iter().map(|s| s.secs * 1e3).collect::<Vec<_>>(),
                "dest_minflt": r.iter().map(|s| s.faults).collect::<Vec<_>>(),
                "dest_pages": m.pages,
            })
        }
        Ok(_) => json!({"error": "no runs"}),
        Err(e) => json!({"error": e}),
    }
}

/// What a case of a pair runs.
#[derive(Clone, Copy)]
enum Job {
    Ductile(&'static Backend, &'static str),
    Ompi(&'static str, &'static [&'static str]),
}

/// One case of a pair: its label, its column in the summary, its runs so far.
struct Case {
    label: String,
    short: String,
    job: Job,
    runs: Runs,
}

/// Every case of one pair, in table order.
fn cases_of(peer: bool) -> Vec<Case> {
    let mut cases = Vec::new();
    let built = ductile_transport::transport::backends();
    for be in BACKENDS.iter().filter(|b| built.contains(&b.name)) {
        for &m in be.methods {
            let (label, short) =
                (format!("ductile_{}_{m}", be.label), format!("{}/{}", be.short, &m[..4.min(m.len())]));
            cases.push(Case { label, short, job: Job::Ductile(be, m), runs: Ok(Vec::new()) });
        }
    }
    for (label, short, mode, extra) in OMPI.into_iter().filter(|_| peer) {
        cases.push(Case {
            label: label.into(),
            short: short.into(),
            job: Job::Ompi(mode, extra),
            runs: Ok(Vec::new()),
        });
    }
    cases
}

/// The summary line of one pair: every case's median GB/s and the targets' ratios.
fn summary(pair: (u32, u32), cases: &[Case], bytes: u64) -> String {
    let get = |l: &str| cases.iter().find(|c| c.label == l).and_then(|c| rate(&c.runs, bytes));
    let f = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |x| format!("{x:.2}"));
    let mut s = format!("{:>2}->{:<2}", pair.0, pair.1);
    for c in cases {
        s += &format!(" {:>10}", f(get(&c.label)));
    }
    let ratios = |be: &str, peer: &str| -> String {
        METHODS
            .iter()
            .map(|m| match (get(&format!("ductile_{be}_{m}")), get(peer)) {
                (Some(a), Some(b)) => format!("{:.2}", a / b),
                _ => "-".into(),
            })
            .collect::<Vec<_>>()
            .join("/")
    };
    let rma = |be: &str| match (get(&format!("ductile_{be}_rma")), get(&format!("ductile_{be}_collective"))) {
        (Some(a), Some(b)) => format!("{:.2}", a / b),
        _ => "-".into(),
    };
    s + &format!(
        " | {:>14} | {:>14} | {:>5} {:>5}",
        ratios("tcp", "ompi_spawn_a2av"),
        ratios("fabric_shm", "ompi_injob_a2av"),
        rma("tcp"),
        rma("fabric_shm")
    )
}

/// Writes `doc` to `target/bench-redistribution.json` and `bars` beside it.
fn write_results(doc: &serde_json::Value, bars: &Bars<'_>) {
    let out = profile_dir().parent().map(|t| t.join("bench-redistribution.json")).expect("target directory");
    match std::fs::write(&out, serde_json::to_string_pretty(doc).expect("json") + "\n") {
        Ok(()) => println!("results: {}", out.display()),
        Err(e) => eprintln!("cannot write {}: {e}", out.display()),
    }
    plot::write_beside(&out, bars);
}

/// Every case's median GB/s as bars, one group per pair.
fn bars_of<'a>(title: &'a str, all: &[((u32, u32), Vec<Case>)], bytes: u64) -> Bars<'a> {
    let cases = all.first().map(|(_, cases)| cases.as_slice()).unwrap_or_default();
    let rate_of = |cs: &[Case], label: &str| cs.iter().find(|c| c.label == label).and_then(|c| rate(&c.runs, bytes));
    Bars {
        title,
        y: "GB/s (10^9 B/s)",
        groups: all.iter().map(|((ns, nt), _)| format!("{ns}→{nt}")).collect(),
        series: cases
            .iter()
            .map(|c| (c.short.clone(), all.iter().map(|(_, cs)| rate_of(cs, &c.label)).collect()))
            .collect(),
        log: false,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--rank") {
        let Some(global) = args.get(2).and_then(|v| v.parse().ok()) else {
            eprintln!("usage: redistribution --rank GLOBAL_ELEMS");
            std::process::exit(2);
        };
        if let Err(e) = rank_main(global) {
            eprintln!("redist_bench rank: {e:#}");
            std::process::exit(1);
        }
        return;
    }
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let (reps, mib, pairs, growth) = (reps(), array_mib(), pairs(), growth_method());
    let bytes = mib << 20;
    let global = bytes / 8;
    ductile_suite::paths::build_release();
    let peer = mpi_peer("redist");
    if !ductile_transport::transport::backends().contains(&"fabric") {
        eprintln!("\n*** SKIPPED ductile fabric shm: this bench was built without the `fabric` feature ***\n");
    }
    println!("redistribution benchmark: {mib} MiB of f64 ({global} elements), {reps} runs per case, growth {growth}");
    println!("  case                         median ms   [min - max]            median GB/s [min - max]  (GB = 1e9 B)");

    // The references and every case of every pair run once per round, so a slow spell
    // of the (shared) machine touches all of them rather than a few cases' every run.
    let src: Vec<u8> = (0..bytes as usize).map(|i| i as u8).collect();
    let mut warm_dst = vec![1u8; src.len()];
    let mut refs: Vec<(&str, Runs)> = ["memcpy_fresh", "memcpy_warm", "tcp_loopback_fresh", "tcp_loopback_warm"]
        .into_iter()
        .map(|l| (l, Ok(Vec::new())))
        .collect();
    let mut all: Vec<((u32, u32), Vec<Case>)> = pairs.iter().map(|&p| (p, cases_of(peer.is_some()))).collect();
    for round in 1..=reps {
        eprintln!("redistribution bench: round {round} of {reps}");
        let (fresh, warm) = memcpy_once(&src);
        record(&mut refs[0].1, Ok(fresh));
        record(&mut refs[1].1, Ok(warm));
        record(&mut refs[2].1, tcp_once(&src, None));
        record(&mut refs[3].1, tcp_once(&src, Some(&mut warm_dst)));
        for (pair, cases) in &mut all {
            for c in cases.iter_mut().filter(|c| c.runs.is_ok()) {
                let outcome = match (c.job, &peer) {
                    (Job::Ductile(be, m), _) => ductile_job(be, m, &growth, *pair, global),
                    (Job::Ompi(mode, extra), Some(p)) => ompi_job(p, mode, extra, *pair, global),
                    (Job::Ompi(..), None) => Err("no Open MPI peer".into()),
                };
                record(&mut c.runs, outcome);
            }
        }
    }

    println!("references (one process):");
    for (label, runs) in &refs {
        println!("{}", line(label, runs, bytes));
    }
    let mut failed = 0;
    for (pair, cases) in &all {
        println!("{} -> {}:", pair.0, pair.1);
        for c in cases {
            println!("{}", line(&c.label, &c.runs, bytes));
            failed += usize::from(c.runs.is_err());
        }
    }

    println!(
        "\nmedian GB/s; ratios: ductile collective/p2p/rma GB/s over the peer's (targets: tcp >= 1, shm >= 0.8), \
         and rma over collective (target on shrinks: >= 1.2)"
    );
    if let Some((_, cases)) = all.first() {
        let mut head = "pair  ".to_string();
        for c in cases {
            head += &format!(" {:>10}", c.short);
        }
        println!("{head} | {:>14} | {:>14} | {:>5} {:>5}", "tcp/o:sp/a2av", "shm/o:job/a2av", "tcp:r/c", "shm:r/c");
    }
    for (pair, cases) in &all {
        println!("{}", summary(*pair, cases, bytes));
    }

    let doc = json!({
        "bytes": bytes, "elements": global, "reps": reps, "growth": growth,
        "references": refs.iter().map(|(l, r)| (l.to_string(), to_json(r, bytes))).collect::<serde_json::Map<_, _>>(),
        "pairs": all.iter().map(|(p, cases)| json!({
            "ns": p.0, "nt": p.1,
            "cases": cases.iter().map(|c| (c.label.clone(), to_json(&c.runs, bytes))).collect::<serde_json::Map<_, _>>(),
        })).collect::<Vec<_>>(),
    });
    let title = format!("redistribution of {mib} MiB of f64, NS → NT (median of {reps} jobs)");
    write_results(&doc, &bars_of(&title, &all, bytes));
    if failed > 0 {
        eprintln!("{failed} case(s) FAILED (see above); their figures are missing, not measured");
        std::process::exit(1);
    }
}
