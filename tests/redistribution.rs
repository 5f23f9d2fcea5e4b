//! Registered data through resizes, bit for bit, with every redistribution executor:
//! real processes started by `ductile run`, the `redist` example checking every element
//! of every item after every change.

mod common;

use common::{assert_no_survivors, ductile, ex, read_report, run, tmp};
use std::time::{Duration, Instant};

/// Node counts (one process each) visiting every ordered pair (NS, NT) of distinct
/// sizes in {1, 2, 3, 4, 8} exactly once: an Eulerian circuit of the complete directed
/// graph on them, starting from the initial single node.
const CIRCUIT: [u32; 20] = [2, 1, 3, 1, 4, 1, 8, 2, 3, 2, 4, 2, 8, 3, 4, 3, 8, 4, 8, 1];

/// Runs the circuit under `ductile run JOB_EXTRA ... -- redist EXTRA`; returns the
/// report and the job's output.
fn redist_job_with(method: &str, job_extra: &[&str], extra: &[&str], name: &str) -> (serde_json::Value, String) {
    redist_job_in(&[], method, job_extra, extra, name)
}

/// [`redist_job_with`] with the variables `env` set for the job.
fn redist_job_in(
    env: &[(&str, &str)],
    method: &str,
    job_extra: &[&str],
    extra: &[&str],
    name: &str,
) -> (serde_json::Value, String) {
    let report = tmp(name);
    let steps = format!("steps:{}", CIRCUIT.map(|n| n.to_string()).join(","));
    let changes = CIRCUIT.len().to_string();
    let prog = ex("redist");
    let mut args = vec!["run", "--timeout", "240", "--report", report.to_str().unwrap(), "--nodes", "1"];
    args.extend(["--slots", "1", "--max-nodes", "8", "--policy", &steps, "--redistribution", method]);
    args.extend(job_extra);
    args.push("--");
    args.extend([prog.as_str(), "--changes", &changes]);
    args.extend(extra);
    let (out, text) = run_noting_launcher_fds(&args, env);
    assert!(out.status.success(), "{method}: {}\n{text}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains(&format!("redist: 20 changes by {method}, every element intact")), "{text}");
    assert_no_survivors(&report);
    let v = read_report(&report);
    (v, text)
}

/// Runs `ductile ARGS` and returns its output, with its standard output as text in
/// which every line where rank 0 says what it holds (`--report-open`) is followed by
/// what the launcher held then: "launcher holds N fds".
fn run_noting_launcher_fds(args: &[&str], env: &[(&str, &str)]) -> (std::process::Output, String) {
    use std::io::BufRead;
    let child = ductile(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start ductile");
    // Ended if this test panics before the job does.
    let mut job = common::Running(child);
    let child = &mut job.0;
    let fd_dir = format!("/proc/{}/fd", child.id());
    let mut stderr = child.stderr.take().expect("stderr");
    let errors = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stderr, &mut v);
        v
    });
    // Read on a thread of its own, so that a count can stop at the next line.
    let (lines_tx, lines) = std::sync::mpsc::channel();
    let stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let reader = std::thread::spawn(move || {
        for line in stdout.lines() {
            if lines_tx.send(line.expect("ductile's output")).is_err() {
                break;
            }
        }
    });
    let mut text = String::new();
    let mut agent = None;
    let mut pending = std::collections::VecDeque::new();
    while let Some(line) = pending.pop_front().or_else(|| lines.recv().ok()) {
        text.push_str(&line);
        text.push('\n');
        // After the last change and a checkpoint, the job ends: nothing to count then.
        if line.contains(" rank 0 holds ") && !line.contains("after the last change") {
            // Node 0's agent, there through the circuit: the launcher's first child
            // agent, looked up once, early (released agents become the launcher's too).
            let agent = *agent.get_or_insert_with(|| {
                first_agent(child.id()).unwrap_or_else(|| panic!("no agent under the launcher: {text}"))
            });
            let count = |dir: &str| std::fs::read_dir(dir).map_or(0, Iterator::count);
            let (agent_fds, agent_tasks) = (format!("/proc/{agent}/fd"), format!("/proc/{agent}/task"));
            let sample = || [count(&fd_dir), count(&agent_fds), count(&agent_tasks)];
            // The least over 500 ms while both live: an agent that left may still be
            // ending (its end closes the launcher's), while a leak stays; the job's next
            // growth only adds. After the last change, the job ends: its end would
            // close what a leak kept, so counting stops at rank 0's line after it (which
            // rank 0 holds back for a second). An ended process holds nothing (0): such
            // samples are not counted either.
            let mut least = sample();
            let until = Instant::now() + Duration::from_millis(500);
            while Instant::now() < until {
                match lines.recv_timeout(Duration::from_millis(20)) {
                    Ok(line) => {
                        let ending = line.contains("after the last change");
                        pending.push_back(line);
                        if ending {
                            break;
                        }
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                }
                let now = sample();
                if now.contains(&0) {
                    break;
                }
                least = std::array::from_fn(|i| least[i].min(now[i]));
            }
            text.push_str(&format!("launcher holds {} fds\n", least[0]));
            text.push_str(&format!("agent holds {} fds and {} threads\n", least[1], least[2]));
        }
    }
    reader.join().expect("stdout reader");
    let status = child.wait().expect("wait for ductile");
    let stderr = errors.join().expect("stderr reader");
    (std::process::Output { status, stdout: text.clone().into_bytes(), stderr }, text)
}

/// The oldest `ductile agent` among the children of `launcher` (the first node's).
fn first_agent(launcher: u32) -> Option<u32> {
    let children = std::fs::read_to_string(format!("/proc/{launcher}/task/{launcher}/children")).ok()?;
    children
        .split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == b"agent"))
        })
        .min()
}

/// The (processes before, processes after) of every change in a report.
fn pairs(report: &serde_json::Value) -> Vec<(u64, u64)> {
    report["reconfigurations"]
        .as_array()
        .expect("reconfigurations in the report")
        .iter()
        .map(|r| (r["procs_before"].as_u64().unwrap(), r["procs_after"].as_u64().unwrap()))
        .collect()
}

fn check_every_pair(method: &str, extra: &[&str]) {
    let mut prog = vec!["--report-open"];
    prog.extend(extra);
    // Named by the flags too: tests of the same method run at once.
    let name = format!("redist-{method}{}.json", extra.concat());
    let (report, text) = redist_job_with(method, &[], &prog, &name);
    let mut want = vec![(1u64, u64::from(CIRCUIT[0]))];
    want.extend(CIRCUIT.windows(2).map(|w| (u64::from(w[0]), u64::from(w[1]))));
    assert_eq!(pairs(&report), want);
    check_nothing_left_open(&text);
}

/// Rank 0, which stays through the whole circuit, holds as many file descriptors and
/// threads alone at its end as alone after its second change, and so do the launcher
/// and node 0's agent: nine grow-and-shrink cycles in between left nothing open (once,
/// rank 0 kept a connection to every process that left, in CLOSE-WAIT, and the launcher
/// one to every node world's agent that left).
fn check_nothing_left_open(text: &str) {
    let numbers =
        |l: &str| -> Vec<usize> { l.split(|c: char| !c.is_ascii_digit()).filter_map(|w| w.parse().ok()).collect() };
    let held = |change: usize| -> [usize; 5] {
        let prefix = format!("redist: change {change}: rank 0 holds ");
        let mut lines = text.lines().skip_while(|l| !l.starts_with(&prefix));
        let rank0 = numbers(&lines.next().unwrap_or_else(|| panic!("{prefix}: {text}"))[prefix.len()..]);
        let launcher = lines.next().filter(|l| l.starts_with("launcher holds ")).map(numbers);
        let agent = lines.next().filter(|l| l.starts_with("agent holds ")).map(numbers);
        match (launcher, agent) {
            (Some(l), Some(a)) => [rank0[0], rank0[1], l[0], a[0], a[1]],
            _ => panic!("no launcher and agent counts after change {change}: {text}"),
        }
    };
    assert_eq!(CIRCUIT[1], 1);
    let (first, last) = (held(2), held(CIRCUIT.len()));
    // A process that left may not have closed its end yet: a little slack on fds.
    let slack = [2, 0, 2, 2, 0];
    assert!(
        (0..5).all(|i| last[i] <= first[i] + slack[i]),
        "[rank 0's fds, its threads, the launcher's fds, node 0's agent's fds, its threads] alone after change 2: \
         {first:?}, at the end: {last:?}"
    );
}

#[test]
fn collective_moves_every_element_for_every_size_pair() {
    check_every_pair("collective", &[]);
}

#[test]
fn p2p_moves_every_element_for_every_size_pair() {
    check_every_pair("p2p", &[]);
}

#[test]
fn rma_moves_every_element_for_every_size_pair() {
    check_every_pair("rma", &[]);
}

/// The circuit with `--background`: the constant items move while the processes keep
/// checkpointing, the variable ones at the switch; every element is checked after every
/// change and while the constant items move.
fn check_every_pair_in_background(method: &str, extra: &[&str]) {
    let mut prog = vec!["--background"];
    prog.extend(extra);
    let name = format!("redist-bg-{method}{}.json", extra.concat());
    let (report, text) = redist_job_with(method, &["--background"], &prog, &name);
    let mut want = vec![(1u64, u64::from(CIRCUIT[0]))];
    want.extend(CIRCUIT.windows(2).map(|w| (u64::from(w[0]), u64::from(w[1]))));
    assert_eq!(pairs(&report), want);
    // Every change returned at least one pending checkpoint while its move ran.
    let overlapped: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("redist: ")?.strip_suffix(" checkpoints passed while constant items moved"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no overlap count: {text}"));
    assert!(overlapped >= CIRCUIT.len() as u64, "{overlapped} overlapped checkpoints: {text}");
}

#[test]
fn collective_in_the_background_moves_every_element_for_every_size_pair() {
    check_every_pair_in_background("collective", &[]);
}

#[test]
fn p2p_in_the_background_moves_every_element_for_every_size_pair() {
    check_every_pair_in_background("p2p", &[]);
}

#[test]
fn rma_in_the_background_moves_every_element_for_every_size_pair() {
    check_every_pair_in_background("rma", &[]);
}

#[test]
fn waiting_on_a_background_moves_handle_then_checkpointing_completes_each_change() {
    // Every process waits on its part's handle, then calls a blocking checkpoint.
    check_every_pair_in_background("collective", &["--wait-move"]);
}

#[test]
fn items_moved_by_their_own_methods_in_the_background() {
    check_every_pair_in_background("p2p", &["--per-item"]);
}

#[test]
fn items_moved_by_their_own_methods_in_one_job() {
    // Items registered with collective, p2p and rma side by side, whatever the job's.
    check_every_pair("rma", &["--per-item"]);
}

#[test]
fn mismatched_registrations_fail_every_rank_with_the_reason() {
    // One more element on rank 2, or another element type of the same size.
    for (flag, differs) in [("--mismatch", "odd: 1000004 x f64"), ("--mismatch-type", "odd: 1000003 x u64")] {
        let report = tmp("redist-mismatch.json");
        let prog = ex("redist");
        let args = ["run", "--timeout", "60", "--report", report.to_str().unwrap(), "-n", "3", "--max-nodes", "8"];
        let mut all = args.to_vec();
        all.extend(["--policy", "steps:2", "--", prog.as_str(), flag, "2"]);
        let started = std::time::Instant::now();
        let out = run(&all);
        assert!(!out.status.success());
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
        let err = String::from_utf8_lossy(&out.stderr);
        // The rank that differs says how; the others name it instead of timing out.
        assert!(err.contains("registered items differ from rank 0's: here ["), "{flag}: {err}");
        assert!(err.contains(differs), "{flag}: {err}");
        assert!(err.contains("the registered items of rank 2 differ from rank 0's"), "{flag}: {err}");
        assert_no_survivors(&report);
    }
}

#[test]
fn a_failed_checkpoint_ends_the_job_even_when_the_application_goes_on() {
    // A shrink whose registrations differ, and processes that catch the error and stay
    // alive (`--keep-going`) instead of exiting: the launcher ends the job a few seconds
    // after the first rank reports its failed checkpoint, not at `--timeout`.
    let report = tmp("redist-keep-going.json");
    let prog = ex("redist");
    let args = [
        "run",
        "--timeout",
        "90",
        "--report",
        report.to_str().unwrap(),
        "-n",
        "4",
        "--slots",
        "1",
        "--max-nodes",
        "8",
        "--policy",
        "steps:2",
        "--",
        prog.as_str(),
        "--mismatch",
        "2",
        "--keep-going",
        "100",
    ];
    let started = std::time::Instant::now();
    let out = run(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "{:?}: {err}", started.elapsed());
    assert!(err.contains("failed at checkpoint 1: reconfiguration failed:"), "{err}");
    assert!(err.contains("differ from rank 0's"), "{err}");
    // What the processes were told when they went on.
    assert!(err.contains("the next checkpoint: reconfiguration failed: an earlier checkpoint failed"), "{err}");
    assert!(err.contains("reading a block: reconfiguration failed: an earlier checkpoint failed"), "{err}");
    assert!(!err.contains("was not ended within"), "{err}");
    assert_no_survivors(&report);
}

/// 256 MiB moved 2 -> 4 -> 1 -> 8 -> 2: every process checks that its peak memory grew
/// by at most its incoming blocks plus 64 MiB at every change.
fn check_memory(method: &str) {
    check_memory_with(method, &[], &[]);
}

/// As [`check_memory`], with `job_extra` options and `env` set for the job.
fn check_memory_with(method: &str, job_extra: &[&str], env: &[(&str, &str)]) {
    let prog = ex("redist");
    let mut args = vec![
        "run",
        "--timeout",
        "240",
        "-n",
        "2",
        "--slots",
        "1",
        "--max-nodes",
        "8",
        "--policy",
        "steps:4,1,8,2",
        "--redistribution",
        method,
    ];
    args.extend(job_extra);
    args.extend(["--", &prog, "--changes", "4", "--check-memory", "--large", "33554432"]);
    let out = ductile(&args).envs(env.iter().copied()).output().expect("start ductile");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{method}: {}\n{text}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("peak memory beyond the incoming blocks"), "{text}");
    assert!(text.contains("redist: 4 changes by"), "{text}");
}

#[test]
fn huge_pages_keep_blocks_intact_and_peak_memory_within_the_bound() {
    // Blocks of 32 MiB and more get transparent huge pages when the kernel has them free
    // (and plain pages otherwise): the same bytes, the same memory bound.
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    let free = free_huge_pages();
    let before = thp_faults();
    check_memory_with("p2p", &[], &[("DUCTILE_HUGE_PAGES", "1")]);
    if !thp.contains("[madvise]") {
        // `never`: no huge pages at all; `always`: every large allocation gets them, asked
        // or not, so their count says nothing about the advice.
        eprintln!("NOTE: transparent huge pages are {thp:?} here: the advice itself is not checked");
    } else if free < 1024 {
        eprintln!("NOTE: only {free} free 2 MiB blocks here: the runtime may rightly not ask for huge pages");
    } else {
        // Under `madvise`, only memory that asks gets huge pages: some must have come.
        assert!(thp_faults() > before, "no huge page was faulted in ({free} free 2 MiB blocks)");
    }
}

/// Free 2 MiB blocks of memory (`/proc/buddyinfo`, orders 9 and up).
fn free_huge_pages() -> u64 {
    let info = std::fs::read_to_string("/proc/buddyinfo").unwrap_or_default();
    info.lines()
        .filter_map(|l| l.split_once("zone").map(|(_, rest)| rest))
        .flat_map(|rest| {
            let counts: Vec<u64> = rest.split_whitespace().skip(1).filter_map(|n| n.parse().ok()).collect();
            counts.into_iter().enumerate().skip(9).map(|(order, n)| n << (order - 9))
        })
        .sum()
}

/// Huge pages faulted in on this machine so far (`/proc/vmstat`).
fn thp_faults() -> u64 {
    let vmstat = std::fs::read_to_string("/proc/vmstat").unwrap_or_default();
    vmstat.lines().find_map(|l| l.strip_prefix("thp_fault_alloc ")?.trim().parse().ok()).unwrap_or(0)
}

#[test]
fn collective_keeps_peak_memory_within_incoming_plus_64_mib() {
    check_memory("collective");
}

#[test]
fn p2p_keeps_peak_memory_within_incoming_plus_64_mib() {
    check_memory("p2p");
}

#[test]
fn rma_keeps_peak_memory_within_incoming_plus_64_mib() {
    check_memory("rma");
}

/// Over fabric shm, one-sided moves hand whole pages over between the processes instead
/// of copying them (the runtime's `pages`): through every size pair, every element
/// stays intact while rank 0's block of "large" comes to lie in several processes'
/// files; a solver writing into pages it was handed computes what a rigid run computes;
/// peak memory stays within the bound.
#[test]
fn rma_over_shared_memory_hands_pages_over_and_keeps_every_element() {
    if !ductile_transport::transport::backends().contains(&"fabric") {
        eprintln!("NOTE: this build has no fabric transport: page handover is not tested");
        return;
    }
    let shm = ["--transport", "fabric", "--fabric-provider", "shm"];
    let (report, text) =
        redist_job_with("rma", &shm, &["--large", "4000000", "--report-files"], "redist-handover.json");
    assert_eq!(pairs(&report).len(), CIRCUIT.len());
    let files: Vec<usize> =
        text.lines().filter_map(|l| l.split(" lies in ").nth(1)?.split_whitespace().next()?.parse().ok()).collect();
    assert_eq!(files.len(), CIRCUIT.len(), "{text}");
    assert!(files.iter().all(|&f| f >= 1), "blocks not in files: {files:?}");
    // Pages from at least two other files than the block's own: handed over, not copied.
    assert!(files.iter().any(|&f| f >= 3), "no block took pages over: {files:?}");

    let jacobi = ["--points", "1000000", "--iters", "60", "--every", "10"];
    let solve = |job_extra: &[&str], name: &str| {
        let report = tmp(name);
        let mut args = vec!["run", "--timeout", "120", "--report", report.to_str().unwrap()];
        args.extend(job_extra);
        let prog = ex("jacobi");
        args.extend(["--", prog.as_str()]);
        args.extend(jacobi);
        let out = run(&args);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{args:?}: {}\n{text}", String::from_utf8_lossy(&out.stderr));
        assert_no_survivors(&report);
        text.split("checksum ").nth(1).and_then(|s| s.split_whitespace().next()).unwrap_or_default().to_owned()
    };
    let rigid = solve(&["-n", "2"], "handover-rigid.json");
    let mut resized = shm.to_vec();
    resized.extend(["--nodes", "1", "--slots", "2", "--max-nodes", "4", "--policy", "steps:2,4,1,3"]);
    resized.extend(["--redistribution", "rma"]);
    assert!(!rigid.is_empty());
    assert_eq!(solve(&resized, "handover-jacobi.json"), rigid);
    check_memory_with("rma", &shm, &[]);
}

/// Over tcp, moves recycle the pages of a member's old block into its new one (the
/// runtime's `anon`) instead of faulting in fresh ones: every executor those of the own
/// overlap, rma and p2p the others too. So in a 4 -> 2 shrink and a growth, the old ranks that
/// stay take far fewer page faults than with `DUCTILE_PAGE_RECYCLE=0`, and every
/// element stays intact either way; through every size pair with every executor, with
/// blocks that start anywhere in a page, too. (The memory bounds of the `*_keeps_peak_memory_*`
/// tests are checked with recycling too.)
#[test]
fn moves_over_tcp_recycle_old_pages_instead_of_faulting_fresh_ones() {
    // Every executor recycles for both old ranks that stay in 4→2: rank 1 has no own
    // overlap there, so its old pages go under overlaps from members that leave. In 2→4
    // rank 1 has none either, and its pages go under rank 0's overlap in rma and p2p;
    // the collective holds segments back only for members that receive more than they
    // send.
    let cases = [
        ("rma", "4", "2", 2),
        ("rma", "2", "4", 2),
        ("collective", "4", "2", 2),
        ("collective", "2", "4", 1),
        ("collective", "1", "4", 1),
        ("p2p", "4", "2", 2),
        ("p2p", "2", "4", 2),
        ("p2p", "1", "4", 1),
    ];
    check_recycling(&["--transport", "tcp"], &["rma", "collective", "p2p"], &cases);
}

/// Over fabric shm, the collective and point-to-point moves recycle old pages as they
/// do over tcp (one-sided moves hand pages over between the processes instead, see
/// `rma_over_shared_memory_hands_pages_over_and_keeps_every_element`): the sources'
/// blocks are read in place by their targets, and a member moves its old block's pages
/// once its readers are done. With the provider's own reads (`fi_read`) instead of
/// direct copies, nothing is recycled, and every element stays intact.
#[test]
fn moves_over_shared_memory_recycle_old_pages_instead_of_faulting_fresh_ones() {
    if !ductile_transport::transport::backends().contains(&"fabric") {
        eprintln!("NOTE: this build has no fabric transport: recycling over shm is not tested");
        return;
    }
    let cases = [("collective", "4", "2", 2), ("collective", "2", "4", 1), ("p2p", "4", "2", 2), ("p2p", "1", "4", 1)];
    check_recycling(&["--transport", "fabric", "--fabric-provider", "shm"], &["collective", "p2p"], &cases);
    // Reads by the provider instead of direct copies: no recycling (the provider may
    // copy out of an owner's memory in the owner's progress), every element intact.
    let direct = [("DUCTILE_FABRIC_DIRECT", "never")];
    let shm = ["--transport", "fabric", "--fabric-provider", "shm"];
    let (report, _) = redist_job_in(&direct, "p2p", &shm, &["--large", "33554433"], "redist-recycle-shm-fi-read.json");
    assert_eq!(pairs(&report).len(), CIRCUIT.len());
}

/// Runs the circuit over `transport` with blocks of 32 MiB and more at odd offsets
/// (every element checked) for each of `methods`, then for each of `cases` (method,
/// NS, NT, old ranks that stay) a single change with and without recycling: with it,
/// each old rank that stays takes at most three quarters of the page faults it takes
/// without, and without it, faults in at least nine tenths of its new block's pages.
fn check_recycling(transport: &[&str], methods: &[&str], cases: &[(&str, &str, &str, u64)]) {
    // 256 MiB and 8 bytes of "large": blocks of 32 MiB and more, which live in mappings
    // of their own (smaller ones stay on the heap), at odd offsets.
    for method in methods {
        let name = format!("redist-recycle-{method}-{}.json", transport.join("-"));
        let (report, _) = redist_job_with(method, transport, &["--large", "33554433"], &name);
        assert_eq!(pairs(&report).len(), CIRCUIT.len());
    }
    let prog = ex("redist");
    // Page faults and pages held after the change, of the ranks below `ranks`.
    let faults = |method: &str, n: &str, to: &str, ranks: u64, recycle: &str| -> Vec<(u64, u64)> {
        let policy = format!("steps:{to}");
        let mut args = vec!["run", "--timeout", "120", "-n", n, "--slots", "1", "--max-nodes", "4"];
        args.extend(["--policy", &policy, "--redistribution", method]);
        args.extend(transport);
        // 128 MiB of "large": blocks of 32 MiB and more.
        args.extend(["--", prog.as_str(), "--changes", "1", "--large", "16777217", "--report-faults"]);
        let out = ductile(&args).env("DUCTILE_PAGE_RECYCLE", recycle).output().expect("start ductile");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{}\n{text}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains(&format!("redist: 1 changes by {method}, every element intact")), "{text}");
        // "redist: change 1: rank R took F faults for P pages".
        let mut by_rank: Vec<(u64, u64, u64)> = text
            .lines()
            .filter_map(|l| {
                let rest = l.strip_prefix("redist: change 1: rank ")?;
                let n: Vec<u64> = rest.split_whitespace().filter_map(|w| w.parse().ok()).collect();
                Some((*n.first()?, *n.get(1)?, *n.get(2)?))
            })
            .filter(|(rank, ..)| *rank < ranks)
            .collect();
        by_rank.sort_unstable();
        assert_eq!(by_rank.len() as u64, ranks, "{text}");
        by_rank.into_iter().map(|(_, f, p)| (f, p)).collect()
    };
    for &(method, n, to, ranks) in cases {
        let (recycled, fresh) = (faults(method, n, to, ranks, "1"), faults(method, n, to, ranks, "0"));
        for (rank, ((r, pages), (f, _))) in recycled.iter().zip(&fresh).enumerate() {
            // Without recycling every page of the new blocks is faulted in; with it, at
            // least half of each block is the old block's pages.
            let case = format!("{method} {n}->{to} rank {rank} over {transport:?}");
            assert!(*f >= pages * 9 / 10, "{case}: {f} faults for {pages} pages without recycling");
            assert!(r * 4 <= f * 3, "{case}: {r} faults recycling against {f} without ({pages} pages)");
        }
    }
}

#[test]
fn a_source_dying_during_a_background_move_fails_the_job_naming_it() {
    // Over fabric too: the PSM libraries that Debian's libfabric loads would otherwise
    // catch the abort, print a backtrace and exit with code 1 (see the launcher's spawn).
    let mut transports = vec![vec!["--transport", "tcp"]];
    if ductile_transport::transport::backends().contains(&"fabric") {
        transports.push(vec!["--transport", "fabric", "--fabric-provider", "shm"]);
    }
    for transport in transports {
        let report = tmp("redist-dies.json");
        let prog = ex("redist");
        let mut args = vec!["run", "--timeout", "120", "--report", report.to_str().unwrap(), "-n", "2", "--slots", "1"];
        args.extend(["--max-nodes", "4", "--policy", "steps:4", "--background"]);
        args.extend(&transport);
        args.extend(["--", &prog, "--background", "--die-while-moving", "1", "--large", "8000000"]);
        let started = std::time::Instant::now();
        let out = run(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        // SIGABRT: 128 + 6, reported with the rank that died.
        assert_eq!(out.status.code(), Some(134), "{transport:?}: {stderr}");
        assert!(stderr.contains("rank 1 on node 1 was killed by signal 6"), "{transport:?}: {stderr}");
        assert!(!stdout.contains("data intact"), "{transport:?}: a change was reported complete: {stdout}");
        assert!(started.elapsed() < std::time::Duration::from_secs(60), "{transport:?}: took {:?}", started.elapsed());
        assert_no_survivors(&report);
    }
}

#[test]
fn a_source_dying_in_the_middle_of_any_move_fails_the_job_naming_it() {
    // Old rank 3 of 4 leaves in a shrink to 2 and aborts 2 ms into its move of "large"
    // (64 MiB), or at its end if sooner, blocking or in the background, whichever
    // executor moves it.
    for method in ["collective", "p2p", "rma"] {
        for background in [false, true] {
            let case = format!("{method}{}", if background { " in the background" } else { "" });
            let report = tmp(&format!("redist-dies-{method}-{background}.json"));
            let prog = ex("redist");
            let mut args = vec!["run", "--timeout", "120", "--report", report.to_str().unwrap(), "-n", "4"];
            args.extend(["--slots", "1", "--max-nodes", "4", "--policy", "steps:2", "--redistribution", method]);
            args.extend(["--transport", "tcp"]);
            let mut prog_args = vec![prog.as_str(), "--large", "8000000"];
            if background {
                args.push("--background");
                prog_args.push("--background");
            }
            args.push("--");
            args.extend(prog_args);
            let started = std::time::Instant::now();
            let out = ductile(&args).env("DUCTILE_TEST_DIE_IN_MOVE", "3").output().expect("start ductile");
            let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(stderr.contains("member 3 aborts in the middle of a move"), "{case}: {stderr}");
            // SIGABRT: 128 + 6, reported with the rank that died.
            assert_eq!(out.status.code(), Some(134), "{case}: {stderr}");
            // "rank 3 on node 3 ...", or "process 3 (released), while leaving in a shrink,
            // on node 3 ..." once the change has released it.
            assert!(
                stderr.contains(" 3 on node 3 was killed by signal 6")
                    || stderr
                        .contains("process 3 (released), while leaving in a shrink, on node 3 was killed by signal 6"),
                "{case}: {stderr}"
            );
            assert!(!stdout.contains("data intact"), "{case}: a change was reported complete: {stdout}");
            assert!(started.elapsed() < std::time::Duration::from_secs(60), "{case}: took {:?}", started.elapsed());
            assert_no_survivors(&report);
        }
    }
}

#[test]
fn waits_that_never_spin_still_move_large_blocks() {
    // DUCTILE_SPIN_US=0: every blocking wait parks at once, so the rest of a large send
    // that its own thread could not write must be handed to the progress tasks (it
    // used to wait there until the job's timeout).
    let prog = ex("redist");
    let args = ["run", "--timeout", "60", "-n", "2", "--slots", "1", "--max-nodes", "4", "--policy", "steps:1"];
    let mut all = args.to_vec();
    all.extend(["--redistribution", "collective", "--", prog.as_str(), "--changes", "1", "--large", "4194304"]);
    let started = std::time::Instant::now();
    let out = ductile(&all).env("DUCTILE_SPIN_US", "0").output().expect("start ductile");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{text}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("redist: 1 changes by collective, every element intact"), "{text}");
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "took {:?}", started.elapsed());
}
