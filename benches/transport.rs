//! Transport benchmark: 8-byte one-way latency and 4 MiB streaming bandwidth between two
//! ranks started by `ductile run` on two simulated nodes, beside Open MPI's TCP BTL and
//! shared memory (vader) running the C peer in `benches/peers/` in the same run.
//!
//! `cargo bench --bench transport` (build the peer first: `benches/peers/build.sh`).
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

/// The rank side: `MODE ITERS SIZE`, printing `elapsed_ns=N` on rank 0 (same contract as
/// the C peer).
fn rank_main(mode: &str, iters: u64, size: usize) -> anyhow::Result<()> {
    let session = ductile::init()?;
    let w = session.world();
    anyhow::ensure!(w.size() == 2, "pingpong needs exactly 2 ranks");
    let me = w.rank();
    let other = 1 - me;
    let buf = Bytes::from(vec![1u8; size]);
    let round_trip = |n: u64| -> anyhow::Result<()> {
        for _ in 0..n {
            if me == 0 {
                w.send_bytes(other, TAG, buf.clone())?;
                w.recv_bytes(Some(other), Some(TAG))?;
            } else {
                w.recv_bytes(Some(other), Some(TAG))?;
                w.send_bytes(other, TAG, buf.clone())?;
            }
        }
        Ok(())
    };
    let stream = |n: u64| -> anyhow::Result<()> {
        if me == 0 {
            for _ in 0..n {
                w.send_bytes(other, TAG, buf.clone())?;
            }
            w.recv_bytes(Some(other), Some(ACK))?;
        } else {
            for _ in 0..n {
                w.recv_bytes(Some(other), Some(TAG))?;
            }
            w.send_bytes(other, ACK, Bytes::from_static(b"k"))?;
        }
        Ok(())
    };
    let run = |n: u64| if mode == "latency" { round_trip(n) } else { stream(n) };
    run(iters.min(100))?;
    w.barrier()?;
    let start = std::time::Instant::now();
    run(iters)?;
    let elapsed = start.elapsed();
    if me == 0 {
        println!("elapsed_ns={}", elapsed.as_nanos());
    }
    session.finalize()?;
    Ok(())
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

fn ductile_job(mode: &str, iters: u64, size: usize) -> Duration {
    let me = std::env::current_exe().expect("bench executable path");
    let out = Command::new(ductile_bin())
        .args(["run", "-n", "2", "--nodes", "2", "--timeout", "600", "--"])
        .arg(me)
        .args(["--rank", mode, &iters.to_string(), &size.to_string()])
        .output()
        .expect("start ductile run");
    assert!(out.status.success(), "ductile job failed: {out:?}");
    parse_elapsed(&out, "ductile job")
}

fn mpi_job(peer: &PathBuf, btl: &str, mode: &str, iters: u64, size: usize) -> Duration {
    let mut cmd = Command::new("mpirun");
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-n", "2", "--mca", "pml", "ob1", "--mca", "btl", btl]);
    if btl.contains("tcp") {
        cmd.args(["--mca", "btl_tcp_if_include", "lo"]);
    }
    let out = cmd.arg(peer).args([mode, &iters.to_string(), &size.to_string()]).output().expect("start mpirun");
    assert!(out.status.success(), "mpirun failed: {out:?}");
    parse_elapsed(&out, "Open MPI peer")
}

fn benches(c: &mut Criterion) {
    let peer = mpi_peer("pingpong");
    let peers: Vec<(&str, &str)> =
        if peer.is_some() { vec![("ompi_tcp", "self,tcp"), ("ompi_vader", "self,vader")] } else { vec![] };

    let mut g = c.benchmark_group("transport/latency_8B_one_way");
    g.sample_size(10).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    // One iteration is a round trip; half of it is the one-way latency.
    g.bench_function(BenchmarkId::from_parameter("ductile_tcp"), |b| {
        b.iter_custom(|iters| ductile_job("latency", iters, LAT_SIZE) / 2)
    });
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
    g.bench_function(BenchmarkId::from_parameter("ductile_tcp"), |b| {
        b.iter_custom(|iters| ductile_job("bandwidth", iters, BW_SIZE))
    });
    for (name, btl) in &peers {
        let p = peer.clone().expect("peer checked above");
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter_custom(|iters| mpi_job(&p, btl, "bandwidth", iters, BW_SIZE))
        });
    }
    g.finish();
}

criterion_group!(
    name = transport;
    config = Criterion::default();
    targets = benches
);

/// `cargo bench` does not build other packages' binaries; build the launcher in the
/// release profile so the jobs run the current code.
fn build_launcher() {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let ok = Command::new(cargo)
        .args(["build", "--release", "--quiet", "-p", "ductile-launcher", "--bin", "ductile"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok && ductile_bin().exists(), "cannot build {}", ductile_bin().display());
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--rank") {
        let parsed = (args.get(2), args.get(3).and_then(|v| v.parse().ok()), args.get(4).and_then(|v| v.parse().ok()));
        let (Some(mode), Some(iters), Some(size)) = parsed else {
            eprintln!("usage: transport --rank latency|bandwidth ITERS SIZE");
            std::process::exit(2);
        };
        if let Err(e) = rank_main(mode, iters, size) {
            eprintln!("pingpong rank: {e:#}");
            std::process::exit(1);
        }
        return;
    }
    build_launcher();
    transport();
    Criterion::default().configure_from_args().final_summary();
}
