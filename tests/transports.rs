//! Every example over every transport this build has: `ductile run --transport tcp|quic|
//! fabric` (fabric with the `tcp;ofi_rxm` and `shm` providers), including resizes of
//! the malleable jacobi and registered data moved by every redistribution executor.

mod common;

use common::{assert_no_survivors, ex, run, tmp};

/// Whether this build has the fabric transport; says so loudly if not.
fn fabric_built() -> bool {
    let built = ductile_transport::transport::backends().contains(&"fabric");
    if !built {
        eprintln!("NOTE: this build has no fabric transport: this fabric test does not run");
    }
    built
}

/// The `ductile run` options selecting each transport built in.
fn transports() -> Vec<Vec<&'static str>> {
    let built = ductile_transport::transport::backends();
    let all: [&[&str]; 4] = [
        &["--transport", "tcp"],
        &["--transport", "quic"],
        &["--transport", "fabric", "--fabric-provider", "tcp;ofi_rxm"],
        &["--transport", "fabric", "--fabric-provider", "shm"],
    ];
    let chosen: Vec<Vec<&str>> = all.iter().filter(|a| built.contains(&a[1])).map(|a| a.to_vec()).collect();
    eprintln!("transports under test: {chosen:?} (built: {built:?})");
    chosen
}

/// What rank 0 of a `redist --report-open` job holds after `change`: (fds, threads, shm
/// mappings).
fn held(out: &str, change: u32) -> (usize, usize, usize) {
    let prefix = format!("redist: change {change}: rank 0 holds ");
    let line = out.lines().find_map(|l| l.strip_prefix(&prefix)).unwrap_or_else(|| panic!("{prefix}: {out}"));
    let n: Vec<usize> = line.split(|c: char| !c.is_ascii_digit()).filter_map(|w| w.parse().ok()).collect();
    (n[0], n[1], n[2])
}

#[test]
fn repeated_resizes_leave_nothing_held_over_every_transport() {
    // 1 -> 8 -> 1 twice: after the second round rank 0 holds what it held after the
    // first (a connection kept to every process that left, over tcp; a closed QUIC
    // connection's state; over fabric shm, a mapping of every departed peer's region).
    for t in transports() {
        let opts = ["--nodes", "1", "--slots", "1", "--max-nodes", "8", "--policy", "steps:2,1,8,1,8,1"];
        let args = ["--changes", "6", "--large", "1000", "--report-open"];
        let out = job(&t, &opts, "redist", &args, "t-held.json");
        let (first, second) = (held(&out, 4), held(&out, 6));
        assert!(
            second.0 <= first.0 + 2 && second.1 <= first.1 && second.2 <= first.2,
            "{t:?}: (fds, threads, shm mappings) after the first 1 -> 8 -> 1: {first:?}, after the second: {second:?}"
        );
        // At the next checkpoint without a change, rank 0 (alone again) lets go of the
        // regions of the 7 processes that left: over fabric shm it maps its own only.
        let line =
            out.lines().find_map(|l| l.strip_prefix("redist: after the last change and a checkpoint: rank 0 holds "));
        let n: Vec<usize> = line
            .unwrap_or_else(|| panic!("{t:?}: {out}"))
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|w| w.parse().ok())
            .collect();
        assert!(n[2] <= 1 && n[0] <= second.0, "{t:?}: after a checkpoint: {n:?}, after the change: {second:?}");
    }
}

fn job(transport: &[&str], opts: &[&str], prog: &str, args: &[&str], name: &str) -> String {
    let report = tmp(name);
    let mut all = vec!["run", "--timeout", "120", "--report", report.to_str().unwrap()];
    all.extend(transport);
    all.extend(opts);
    all.push("--");
    let prog = ex(prog);
    all.push(&prog);
    all.extend(args);
    let out = run(&all);
    assert!(out.status.success(), "{all:?}: {}", String::from_utf8_lossy(&out.stderr));
    assert_no_survivors(&report);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn hello_ring_and_allreduce_over_every_transport() {
    for t in transports() {
        let out = job(&t, &["-n", "4", "--nodes", "2", "--tag-output"], "hello", &[], "t-hello.json");
        for r in 0..4 {
            let want = format!("[{r}] hello from rank {r} of 4 on node {} of 2", r / 2);
            assert!(out.contains(&want), "{t:?}: missing {want:?} in {out}");
        }
        let out = job(&t, &["-n", "4", "--nodes", "2"], "ring", &["5"], "t-ring.json");
        assert!(out.contains("token went around 5 times and reads 20"), "{t:?}: {out}");
        // A token of 2 MiB, received in place and checked word by word (quic delivers
        // it in pieces, which the receiver copies into its memory; tcp reads it, and
        // fabric over shm copies it from the sender's memory, straight into the
        // memory of the receive that waits for it).
        let out = job(&t, &["-n", "3", "--nodes", "3"], "ring", &["20", "262144"], "t-ring.json");
        assert!(out.contains("token went around 20 times and reads 60"), "{t:?}: {out}");
        let out = job(&t, &["-n", "4", "--nodes", "4"], "allreduce", &["100000"], "t-allreduce.json");
        assert!(out.contains("allreduce over 4 ranks of 100000 elements: correct"), "{t:?}: {out}");
    }
}

fn checksum(out: &str) -> String {
    let line = out.lines().find(|l| l.contains("checksum")).unwrap_or_else(|| panic!("no checksum in {out}"));
    line.split("checksum ").nth(1).and_then(|s| s.split_whitespace().next()).unwrap_or_default().to_string()
}

#[test]
fn jacobi_resizes_and_rma_redistribution_over_every_transport() {
    let jacobi = ["--points", "50000", "--iters", "60", "--every", "10"];
    let rigid = checksum(&job(&["--transport", "tcp"], &["-n", "2"], "jacobi", &jacobi, "t-rigid.json"));
    let resizes = ["--nodes", "1", "--slots", "2", "--max-nodes", "4", "--policy", "steps:2,4,1"];
    for t in transports() {
        let out = job(&t, &resizes, "jacobi", &jacobi, "t-jacobi.json");
        assert_eq!(checksum(&out), rigid, "{t:?}: {out}");
        // Every executor: over fabric shm, p2p's and the collective's large messages go
        // as bulk payloads, rma's gets as reads.
        for method in ["rma", "p2p", "collective"] {
            let opts = ["--nodes", "1", "--max-nodes", "8", "--policy", "steps:3,8,2,1", "--redistribution", method];
            let out = job(&t, &opts, "redist", &["--changes", "4", "--large", "300000"], "t-redist.json");
            let want = format!("redist: 4 changes by {method}, every element intact");
            assert!(out.contains(&want), "{t:?}: {out}");
        }
    }
}

#[test]
fn background_moves_and_jacobi_over_every_transport() {
    let jacobi = ["--points", "50000", "--iters", "60", "--every", "10", "--table-mib", "8", "--background"];
    let rigid = checksum(&job(&["--transport", "tcp"], &["-n", "2"], "jacobi", &jacobi, "t-rigid-bg.json"));
    for t in transports() {
        // Constant items move while the processes keep checkpointing, by every executor.
        for method in ["rma", "p2p", "collective"] {
            let mut opts = vec!["--nodes", "1", "--max-nodes", "8", "--policy", "steps:3,8,2", "--background"];
            opts.extend(["--redistribution", method]);
            let args = ["--background", "--changes", "3", "--large", "300000"];
            let out = job(&t, &opts, "redist", &args, "t-redist-bg.json");
            assert!(out.contains(&format!("redist: 3 changes by {method}, every element intact")), "{t:?}: {out}");
        }
        // The malleable jacobi with its matrix moving in the background.
        let opts = ["--nodes", "1", "--slots", "2", "--max-nodes", "4", "--policy", "steps:4,2", "--background"];
        let out = job(&t, &opts, "jacobi", &jacobi, "t-jacobi-bg.json");
        assert_eq!(checksum(&out), rigid, "{t:?}: {out}");
    }
}

#[test]
fn a_rank_that_fails_ends_the_job_over_every_transport() {
    // Rank 2 exits with code 3 while the others wait for a message from it; a shrink's
    // released processes crash instead of leaving.
    let prog = ex("fault");
    for t in transports() {
        for (opts, args, code) in [
            (vec!["-n", "4", "--nodes", "2"], vec!["exit", "2", "3"], 3),
            (vec!["-n", "4", "--slots", "1", "--max-nodes", "4", "--policy", "steps:2"], vec!["leave-crash", "5"], 5),
        ] {
            let report = tmp("t-fault.json");
            let mut all = vec!["run", "--timeout", "60", "--report", report.to_str().unwrap()];
            all.extend(&t);
            all.extend(&opts);
            all.push("--");
            all.push(&prog);
            all.extend(&args);
            let started = std::time::Instant::now();
            let out = run(&all);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(code), "{t:?} {args:?}: {err}");
            assert!(started.elapsed() < std::time::Duration::from_secs(30), "{t:?} {args:?}: {:?}", started.elapsed());
            assert_no_survivors(&report);
        }
    }
}

#[test]
fn an_unknown_fabric_provider_fails_at_start_naming_it() {
    if !fabric_built() {
        return;
    }
    let report = tmp("t-bogus.json");
    let hello = ex("hello");
    let args = ["run", "--timeout", "60", "--report", report.to_str().unwrap(), "-n", "2", "--nodes", "2"];
    let mut all = args.to_vec();
    all.extend(["--transport", "fabric", "--fabric-provider", "bogus", "--", hello.as_str()]);
    let started = std::time::Instant::now();
    let out = run(&all);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("fabric") && err.contains("\"bogus\""), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "took {:?}", started.elapsed());
    assert_no_survivors(&report);
}

/// The children of process `parent`, from `/proc`.
fn children_of(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).ok().is_some_and(|stat| {
                stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok())
                    == Some(parent)
            })
        })
        .collect()
}

#[test]
fn a_killed_agent_leaves_no_ranks_and_no_shm_regions() {
    // SIGKILL of a node's agent: its ranks, killed with its process group, die as the
    // controller's children; their libfabric shm regions must still go.
    if !fabric_built() {
        return;
    }
    use std::io::BufRead;
    let report = tmp("t-agent-killed.json");
    let prog = ex("fault");
    let mut args = vec!["run", "-n", "4", "--nodes", "2", "--timeout", "60", "--report", report.to_str().unwrap()];
    args.extend(["--transport", "fabric", "--fabric-provider", "shm", "--", &prog, "hang"]);
    let mut child = common::ductile(&args).stdout(std::process::Stdio::piped()).spawn().expect("start ductile");
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    for _ in 0..4 {
        assert!(lines.next().unwrap().unwrap().contains("waiting"));
    }
    let agents = children_of(child.id());
    assert_eq!(agents.len(), 2, "agents {agents:?}");
    let last = *agents.iter().max().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(last as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    let status = common::wait_with_timeout(&mut child, std::time::Duration::from_secs(30));
    assert_eq!(status.code(), Some(1));
    assert_no_survivors(&report);
}

#[test]
fn ranks_that_exit_without_closing_leave_no_shm_regions() {
    // libfabric's shm provider unlinks an endpoint's /dev/shm region only when the
    // endpoint closes or a fatal signal reaches it: a rank that exits with its
    // endpoint open (here rank 1, code 3) left it behind until the agent removed it.
    if !fabric_built() {
        return;
    }
    let report = tmp("t-shm-exit.json");
    let prog = ex("fault");
    let mut args = vec!["run", "-n", "3", "--nodes", "3", "--timeout", "60", "--report", report.to_str().unwrap()];
    args.extend(["--transport", "fabric", "--fabric-provider", "shm", "--", &prog, "exit", "1", "3"]);
    let out = run(&args);
    assert_eq!(out.status.code(), Some(3), "{}", String::from_utf8_lossy(&out.stderr));
    // No process left, and no region of any of them (see common::assert_no_survivors).
    assert_no_survivors(&report);
}
