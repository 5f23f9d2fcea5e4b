//! Transport benchmark: 8-byte one-way latency, 4 MiB streaming bandwidth and 4 MiB
//! one-sided gets between two ranks started by `ductile run` on two simulated nodes, for
//! every transport this build has (tcp; quic and fabric with the `tcp;ofi_rxm` and `shm`
//! providers when their cargo features are on), beside `fi_pingpong` for each libfabric
//! provider and Open MPI's TCP BTL and shared memory (vader) running the C peer in
//! `benches/peers/`, all in the same run.
//!
//! `cargo bench --all-features --bench transport` (build the peer first:
//! `benches/peers/build.sh`; `fi_pingpong` is in Debian's `libfabric-bin`). After the
//! criterion groups, the transport issue's comparisons are measured once more as
//! alternating pairs of single jobs ([`paired`]).
//!
//! The same executable is the rank program: started by the launcher (with
//! `DUCTILE_CONTROL_FD` set) it runs the ping-pong instead of criterion. Each criterion
//! sample is one job whose rank 0 times `iters` iterations itself, so process start-up
//! is not measured.

#![allow(missing_docs)] // criterion_group! generates an undocumented function

use bytes::Bytes;
use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use ductile_suite::paths::{ductile_bin, mpi_peer};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const LAT_SIZE: usize = 8;
const BW_SIZE: usize = 4 << 20;
const TAG: u32 = 1;
const ACK: u32 = 2;

/// A ductile transport as the bench runs it.
struct Backend {
    label: &'static str,
    name: &'static str,
    provider: Option<&'static str>,
}

const BACKENDS: [Backend; 4] = [
    Backend { label: "ductile_tcp", name: "tcp", provider: None },
    Backend { label: "ductile_quic", name: "quic", provider: None },
    Backend { label: "ductile_fabric_tcp", name: "fabric", provider: Some("tcp;ofi_rxm") },
    Backend { label: "ductile_fabric_shm", name: "fabric", provider: Some("shm") },
];

/// The libfabric providers `fi_pingpong` is run with, and the domain each uses.
const FI_PROVIDERS: [(&str, &str, &str); 2] =
    [("fi_pingpong_tcp", "tcp;ofi_rxm", "lo"), ("fi_pingpong_shm", "shm", "")];

fn built_backends() -> impl Iterator<Item = &'static Backend> {
    BACKENDS.iter().filter(|b| ductile_transport::transport::backends().contains(&b.name))
}

/// The rank side: `MODE ITERS SIZE`, printing `elapsed_ns=N` on rank 0 (same contract as
/// the C peer).
///
/// Mode `crowded` (any number of ranks, not part of the criterion run): every rank first
/// exchanges a message with every other, so that each holds a connection to all; then
/// ranks 0 and 1 time the latency ping-pong while the others wait, idle, in the final
/// barrier. It shows what a polling rank pays per idle peer.
fn rank_main(mode: &str, iters: u64, size: usize) -> anyhow::Result<()> {
    let session = ductile::init()?;
    let w = session.world();
    let crowded = mode == "crowded";
    anyhow::ensure!(w.size() == 2 || (crowded && w.size() >= 2), "pingpong needs exactly 2 ranks");
    let me = w.rank();
    let other = if me < 2 { 1 - me } else { 0 };
    if crowded {
        for peer in (0..w.size()).filter(|&p| p != me) {
            w.send_bytes(peer, ACK, Bytes::from_static(b"h"))?;
        }
        for peer in (0..w.size()).filter(|&p| p != me) {
            w.recv_bytes(Some(peer), Some(ACK))?;
        }
        w.barrier()?;
        if me >= 2 {
            // Waits, idle, in the final barrier.
            session.finalize()?;
            return Ok(());
        }
    }
    let buf = Bytes::from(vec![1u8; size]);
    // The ping-pong sends from and receives into memory of its own (`send`,
    // `recv_into`), as `MPI_Send`/`MPI_Recv` and `fi_pingpong` do;
    // DUCTILE_BENCH_MSG=bytes times `send_bytes`/`recv_bytes` instead.
    let slices = std::env::var("DUCTILE_BENCH_MSG").map_or(true, |v| v != "bytes");
    let mut got = vec![0u8; size];
    let mut round_trip = |n: u64| -> anyhow::Result<()> {
        for _ in 0..n {
            if me == 0 {
                ping(w, other, &buf, slices)?;
                pong(w, other, slices.then_some(&mut got[..]))?;
            } else {
                pong(w, other, slices.then_some(&mut got[..]))?;
                ping(w, other, &buf, slices)?;
            }
        }
        Ok(())
    };
    // The stream's receiver takes each message as bytes of its own (`recv_bytes`); mode
    // `bandwidth-into` takes every one into one buffer of its own (`recv_into`), as the
    // Open MPI peer's `MPI_Irecv` does.
    let mut sink = (mode == "bandwidth-into").then(|| vec![0u8; size]);
    let mut stream = |n: u64| -> anyhow::Result<()> {
        if me == 0 {
            for _ in 0..n {
                w.send_bytes(other, TAG, buf.clone())?;
            }
            w.recv_bytes(Some(other), Some(ACK))?;
        } else {
            for _ in 0..n {
                pong(w, other, sink.as_deref_mut())?;
            }
            w.send_bytes(other, ACK, Bytes::from_static(b"k"))?;
        }
        Ok(())
    };
    // Rank 1 exposes a window; rank 0 reads all of it `n` times, one get at a time.
    let window = if mode == "get" && me == 1 { Some(w.expose(buf.clone())?) } else { None };
    let mut id = window;
    if mode == "get" {
        w.broadcast_value(1, &mut id)?;
    }
    let gets = |n: u64| -> anyhow::Result<()> {
        if me == 0 {
            let id = id.ok_or_else(|| anyhow::anyhow!("rank 1 exposed no window"))?;
            for _ in 0..n {
                anyhow::ensure!(w.get(other, id, 0, size as u64)?.len() == size, "short get");
            }
        }
        Ok(())
    };
    let mut run = |n: u64| match mode {
        "latency" | "crowded" => round_trip(n),
        "get" => gets(n),
        _ => stream(n),
    };
    run(iters.min(100))?;
    // The warm-up's ping-pong already pairs ranks 0 and 1 when the others are idle.
    if !crowded {
        w.barrier()?;
    }
    let start = std::time::Instant::now();
    run(iters)?;
    let elapsed = start.elapsed();
    if me == 0 {
        println!("elapsed_ns={}", elapsed.as_nanos());
    }
    if crowded {
        session.finalize()?;
        return Ok(());
    }
    w.barrier()?;
    if let Some(id) = window {
        w.withdraw(id)?;
    }
    session.finalize()?;
    Ok(())
}

/// Sends one message of the ping-pong to `other`: from the slice, or as shared bytes.
fn ping(w: &ductile::Group, other: usize, buf: &Bytes, slice: bool) -> anyhow::Result<()> {
    if slice {
        w.send(other, TAG, &buf[..])?;
    } else {
        w.send_bytes(other, TAG, buf.clone())?;
    }
    Ok(())
}

/// Receives one message of the ping-pong from `other`: into `got` if given, else as
/// bytes.
fn pong(w: &ductile::Group, other: usize, got: Option<&mut [u8]>) -> anyhow::Result<()> {
    match got {
        Some(got) => drop(w.recv_into(Some(other), Some(TAG), got)?),
        None => drop(w.recv_bytes(Some(other), Some(TAG))?),
    }
    Ok(())
}

/// Fewest iterations one job runs, for small and large messages. Each criterion sample
/// is a whole job (start-up outside the timed loop) and criterion asks for only a few
/// iterations per sample (1-10 here, as it counts the job's start-up in its warm-up),
/// which would time the transient after the job's barrier instead of the steady state;
/// so every job runs at least this many and its time is scaled to what criterion
/// asked for. `fi_pingpong` also needs it: it times a fixed start-up of about 10 ms
/// inside its loop.
const MIN_SMALL: u64 = 20_000;
const MIN_LARGE: u64 = 200;

/// The iterations a job runs when criterion asks for `iters` of `size` bytes.
fn runs(iters: u64, size: usize) -> u64 {
    iters.max(if size <= 4096 { MIN_SMALL } else { MIN_LARGE })
}

/// The time of `runs` iterations scaled to `iters`.
fn scaled(d: Duration, runs: u64, iters: u64) -> Duration {
    d.mul_f64(iters as f64 / runs as f64)
}

fn parse_elapsed(out: &std::process::Output, what: &str) -> Duration {
    let text = String::from_utf8_lossy(&out.stdout);
    let ns = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("elapsed_ns="))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("{what} printed no elapsed_ns: {out:?}"));
    Duration::from_nanos(ns)
}

fn ductile_job(b: &Backend, mode: &str, iters: u64, size: usize) -> Duration {
    ductile_job_bound(b, mode, iters, size, false)
}

/// A job of two ranks, each bound to a CPU of its own if `bound`: the first two this
/// process may run on (those of [`two_cpus`]).
fn ductile_job_bound(b: &Backend, mode: &str, iters: u64, size: usize, bound: bool) -> Duration {
    let n = runs(iters, size);
    let me = std::env::current_exe().expect("bench executable path");
    let mut cmd = Command::new(ductile_bin());
    cmd.args(["run", "-n", "2", "--nodes", "2", "--timeout", "600", "--transport", b.name]);
    if bound {
        cmd.args(["--bind-to", "hwthread"]);
    }
    if let Some(p) = b.provider {
        cmd.args(["--fabric-provider", p]);
    }
    let out = cmd
        .arg("--")
        .arg(me)
        .args(["--rank", mode, &n.to_string(), &size.to_string()])
        .output()
        .expect("start ductile run");
    assert!(out.status.success(), "ductile job failed: {out:?}");
    scaled(parse_elapsed(&out, "ductile job"), n, iters)
}

fn mpi_job(peer: &PathBuf, btl: &str, mode: &str, iters: u64, size: usize) -> Duration {
    let mut cmd = Command::new("mpirun");
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-n", "2", "--mca", "pml", "ob1", "--mca", "btl", btl]);
    if btl.contains("tcp") {
        cmd.args(["--mca", "btl_tcp_if_include", "lo"]);
    }
    let n = runs(iters, size);
    let out = cmd.arg(peer).args([mode, &n.to_string(), &size.to_string()]).output().expect("start mpirun");
    assert!(out.status.success(), "mpirun failed: {out:?}");
    scaled(parse_elapsed(&out, "Open MPI peer"), n, iters)
}

/// The first two CPUs this process may run on (the second is the first again on a
/// machine of one), where `ductile run --bind-to hwthread` puts ranks 0 and 1.
fn two_cpus() -> [String; 2] {
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).expect("sched_getaffinity");
    let cpus: Vec<usize> = (0..nix::sched::CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect();
    [cpus[0].to_string(), cpus[1 % cpus.len()].to_string()]
}

/// `program`, bound to `cpu` if set (by `taskset`).
fn pinned(program: &str, cpu: Option<&str>) -> Command {
    match cpu {
        Some(c) => {
            let mut cmd = Command::new("taskset");
            cmd.args(["-c", c, program]);
            cmd
        }
        None => Command::new(program),
    }
}

/// `fi_pingpong` over `provider`: server and client on loopback; the time of `iters`
/// one-way transfers of `size` bytes as the client reports it (`usec/xfer`).
fn fi_job(provider: &str, domain: &str, iters: u64, size: usize) -> Duration {
    fi_job_bound(provider, domain, iters, size, None)
}

/// [`fi_job`] with the server bound to `cpus[0]` and the client to `cpus[1]`, if set.
fn fi_job_bound(provider: &str, domain: &str, iters: u64, size: usize, cpus: Option<&[String; 2]>) -> Duration {
    let mut args = vec!["-p", provider, "-e", "rdm"];
    if !domain.is_empty() {
        args.extend(["-d", domain]);
    }
    // fi_pingpong's own figure carries a fixed start-up cost inside its timed loop
    // (about 10 ms: 1 ms per transfer at -I 10, 5.6 µs at -I 10000 over tcp), so it is
    // run long enough for that to vanish (see `runs`) and its per-transfer time is
    // scaled to `iters`.
    let (iters_s, size_s) = (runs(iters, size).to_string(), size.to_string());
    args.extend(["-I", &iters_s, "-S", &size_s]);
    let mut server = pinned("fi_pingpong", cpus.map(|c| c[0].as_str()))
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start fi_pingpong server");
    // The server needs a moment to listen on its control port; retry the client. A
    // client that found no server exits without removing its shm region: remove it.
    let mut out = None;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(50));
        let client = pinned("fi_pingpong", cpus.map(|c| c[1].as_str()))
            .args(&args)
            .arg("127.0.0.1")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start fi_pingpong");
        let client_pid = client.id();
        let o = client.wait_with_output().expect("wait for fi_pingpong");
        ductile_transport::shm_regions::remove_ended(&[client_pid]);
        if o.status.success() {
            out = Some(o);
            break;
        }
    }
    let server_pid = server.id();
    let _ = server.kill();
    let _ = server.wait();
    ductile_transport::shm_regions::remove_ended(&[server_pid]);
    let out = out.unwrap_or_else(|| panic!("fi_pingpong -p {provider} never connected"));
    let text = String::from_utf8_lossy(&out.stdout);
    // Last line: bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec
    let usec = text
        .lines()
        .last()
        .and_then(|l| l.split_whitespace().nth(6))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("fi_pingpong printed no usec/xfer: {text}"));
    Duration::from_secs_f64(usec * 1e-6 * iters as f64)
}

fn have_fi_pingpong() -> bool {
    Command::new("fi_pingpong").arg("-h").output().is_ok()
}

fn benches(c: &mut Criterion) {
    let peer = mpi_peer("pingpong");
    let fi = have_fi_pingpong();
    if !fi {
        eprintln!("fi_pingpong not found (Debian libfabric-bin): its figures are skipped");
    }
    let peers: Vec<(&str, &str)> =
        if peer.is_some() { vec![("ompi_tcp", "self,tcp"), ("ompi_vader", "self,vader")] } else { vec![] };

    let mut g = c.benchmark_group("transport/latency_8B_one_way");
    g.sample_size(10).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    // One iteration is a round trip; half of it is the one-way latency.
    for be in built_backends() {
        g.bench_function(BenchmarkId::from_parameter(be.label), |b| {
            b.iter_custom(|iters| ductile_job(be, "latency", iters, LAT_SIZE) / 2)
        });
    }
    for (label, provider, domain) in FI_PROVIDERS.iter().filter(|_| fi) {
        g.bench_function(BenchmarkId::from_parameter(label), |b| {
            b.iter_custom(|iters| fi_job(provider, domain, iters, LAT_SIZE))
        });
    }
    for (name, btl) in &peers {
        let p = peer.clone().expect("peer checked above");
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter_custom(|iters| mpi_job(&p, btl, "latency", iters, LAT_SIZE) / 2)
        });
    }
    g.finish();

    let mut g = c.benchmark_group("transport/bandwidth_4MiB_stream");
    g.sample_size(10).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    g.throughput(Throughput::Bytes(BW_SIZE as u64));
    for be in built_backends() {
        g.bench_function(BenchmarkId::from_parameter(be.label), |b| {
            b.iter_custom(|iters| ductile_job(be, "bandwidth", iters, BW_SIZE))
        });
    }
    // fi_pingpong has no streaming mode: its figure is a ping-pong of 4 MiB messages.
    for (label, provider, domain) in FI_PROVIDERS.iter().filter(|_| fi) {
        g.bench_function(BenchmarkId::from_parameter(label), |b| {
            b.iter_custom(|iters| fi_job(provider, domain, iters, BW_SIZE))
        });
    }
    for (name, btl) in &peers {
        let p = peer.clone().expect("peer checked above");
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter_custom(|iters| mpi_job(&p, btl, "bandwidth", iters, BW_SIZE))
        });
    }
    g.finish();

    let mut g = c.benchmark_group("transport/get_4MiB");
    g.sample_size(10).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    g.throughput(Throughput::Bytes(BW_SIZE as u64));
    for be in built_backends() {
        g.bench_function(BenchmarkId::from_parameter(be.label), |b| {
            b.iter_custom(|iters| ductile_job(be, "get", iters, BW_SIZE))
        });
    }
    g.finish();
}

/// The comparisons again, as alternating single jobs: each pair runs one job of
/// either side back to back, `DUCTILE_BENCH_REPS` times (10 by default), and the
/// medians and their ratio are printed. Criterion measures each case in one stretch,
/// and a machine whose speed changes between stretches (this project's VM has two
/// states, `fi_pingpong` over shm at 0.25 and 0.8 µs) then compares one case's state
/// with another's; alternating pairs them. Latencies in ns one way, throughputs in GiB/s.
fn paired() {
    let reps: usize =
        std::env::var("DUCTILE_BENCH_REPS").ok().and_then(|v| v.parse().ok()).filter(|&r| r > 0).unwrap_or(10);
    let backend = |label: &str| built_backends().find(|b| b.label == label);
    let lat = |d: Duration, iters: u64| d.as_secs_f64() * 1e9 / iters as f64;
    let gib = |d: Duration, iters: u64| (BW_SIZE as f64 * iters as f64) / d.as_secs_f64() / f64::from(1u32 << 30);
    println!("\npaired measurements, alternating single jobs ({reps} pairs, medians):");
    println!("| measure | a | b | median a | median b | a / b | pairs (a/b) |");
    println!("|---|---|---|---|---|---|---|");
    let row = |what: &str, a: &str, b: &str, run: &dyn Fn() -> (f64, f64)| {
        let pairs: Vec<(f64, f64)> = (0..reps).map(|_| run()).collect();
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (ma, mb) = (median(pairs.iter().map(|p| p.0).collect()), median(pairs.iter().map(|p| p.1).collect()));
        let each: Vec<String> = pairs.iter().map(|(x, y)| format!("{x:.2}/{y:.2}")).collect();
        println!("| {what} | {a} | {b} | {ma:.3} | {mb:.3} | {:.2} | {} |", ma / mb, each.join(" "));
    };
    if have_fi_pingpong() {
        for (label, provider, domain) in
            [("ductile_fabric_shm", "shm", ""), ("ductile_fabric_tcp", "tcp;ofi_rxm", "lo")]
        {
            let Some(be) = backend(label) else { continue };
            let iters: u64 = if provider == "shm" { 200_000 } else { 50_000 };
            row("8 B latency (ns)", label, &format!("fi_pingpong {provider}"), &|| {
                let d = lat(ductile_job(be, "latency", iters, LAT_SIZE), iters) / 2.0;
                (d, lat(fi_job(provider, domain, iters, LAT_SIZE), iters))
            });
            // Both sides bound to the same two CPUs, one process each (`ductile run
            // --bind-to`, `taskset` for `fi_pingpong`), as `mpirun --bind-to core`
            // and `srun --cpu-bind` run jobs.
            let cpus = two_cpus();
            let what = format!("8 B latency, bound to CPUs {} and {} (ns)", cpus[0], cpus[1]);
            row(&what, label, &format!("fi_pingpong {provider}"), &|| {
                let d = lat(ductile_job_bound(be, "latency", iters, LAT_SIZE, true), iters) / 2.0;
                (d, lat(fi_job_bound(provider, domain, iters, LAT_SIZE, Some(&cpus)), iters))
            });
        }
    }
    let tcp = backend("ductile_tcp").expect("tcp is always built");
    if let Some(quic) = backend("ductile_quic") {
        for (what, mode) in
            [("4 MiB stream (GiB/s)", "bandwidth"), ("4 MiB stream into a buffer (GiB/s)", "bandwidth-into")]
        {
            row(what, "ductile_quic", "ductile_tcp", &|| {
                let q = gib(ductile_job(quic, mode, MIN_LARGE, BW_SIZE), MIN_LARGE);
                (q, gib(ductile_job(tcp, mode, MIN_LARGE, BW_SIZE), MIN_LARGE))
            });
        }
    }
    for label in ["ductile_fabric_tcp", "ductile_fabric_shm"] {
        let Some(be) = backend(label) else { continue };
        row("4 MiB get (GiB/s)", label, "ductile_tcp", &|| {
            let f = gib(ductile_job(be, "get", MIN_LARGE, BW_SIZE), MIN_LARGE);
            (f, gib(ductile_job(tcp, "get", MIN_LARGE, BW_SIZE), MIN_LARGE))
        });
    }
}

criterion_group!(
    name = transport;
    config = Criterion::default();
    targets = benches
);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--rank") {
        let parsed = (args.get(2), args.get(3).and_then(|v| v.parse().ok()), args.get(4).and_then(|v| v.parse().ok()));
        let (Some(mode), Some(iters), Some(size)) = parsed else {
            eprintln!("usage: transport --rank latency|bandwidth|bandwidth-into|get|crowded ITERS SIZE");
            std::process::exit(2);
        };
        if let Err(e) = rank_main(mode, iters, size) {
            eprintln!("pingpong rank: {e:#}");
            std::process::exit(1);
        }
        return;
    }
    ductile_suite::paths::build_release();
    transport();
    Criterion::default().configure_from_args().final_summary();
    paired();
}
