//! `ductile run` end to end: real processes on simulated local nodes.

mod common;

use common::{assert_no_survivors, ductile, ex, own_cpus, reported_bindings, run, tmp, wait_with_timeout};
use nix::sys::signal::Signal;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `ductile run` of the fault example on 4 ranks over 2 nodes.
fn fault_job(timeout: Option<u32>, report: &std::path::Path, args: &[&str]) -> Command {
    let mut c = ductile(&["run", "-n", "4", "--nodes", "2", "--report", report.to_str().unwrap()]);
    if let Some(t) = timeout {
        c.args(["--timeout", &t.to_string()]);
    }
    c.arg("--").arg(ex("fault")).args(args);
    c
}

#[test]
fn hello_ring_and_allreduce_over_1_to_4_nodes() {
    for (n, nodes) in [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4)] {
        let (ns, nodes_s) = (n.to_string(), nodes.to_string());
        let out = run(&["run", "-n", &ns, "--nodes", &nodes_s, "--tag-output", "--", &ex("hello")]);
        assert!(out.status.success(), "hello -n {n}: {out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        for r in 0..n {
            let node = r * nodes / n;
            let want = format!("[{r}] hello from rank {r} of {n} on node {node} of {nodes}");
            assert!(text.contains(&want), "missing {want:?} in {text}");
        }
        let out = run(&["run", "-n", &ns, "--nodes", &nodes_s, "--", &ex("ring"), "5"]);
        assert!(out.status.success(), "ring -n {n}: {out:?}");
        let want = format!("token went around 5 times and reads {}", 5 * n);
        assert!(String::from_utf8_lossy(&out.stdout).contains(&want));
        let out = run(&["run", "-n", &ns, "--nodes", &nodes_s, "--", &ex("allreduce"), "100000"]);
        assert!(out.status.success(), "allreduce -n {n}: {out:?}");
        let p = n as u64;
        let total: u64 = (0..100_000u64).map(|i| p * i + p * (p - 1) / 2).sum();
        let want = format!("allreduce over {n} ranks of 100000 elements: correct; total {total}");
        assert!(String::from_utf8_lossy(&out.stdout).contains(&want), "{out:?}");
    }
}

#[test]
fn bound_ranks_run_on_a_cpu_each_across_simulated_nodes_and_within_the_launchers_own() {
    let (list, cpus) = own_cpus();
    let hello = ex("hello");
    let text = |o: &std::process::Output| {
        assert!(o.status.success(), "{o:?}");
        (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    // Three simulated nodes share this host's CPUs: one count of slots across them.
    let args = ["run", "-n", "3", "--nodes", "3", "--bind-to", "hwthread", "--report-bindings", "--", &hello, "--cpus"];
    let (out, err) = text(&run(&args));
    let mut said = reported_bindings(&err);
    said.sort_unstable();
    let want: Vec<_> = (0..3).map(|r| (r, r, Some(cpus[r as usize % cpus.len()].to_string()))).collect();
    assert_eq!(said, want, "{err}");
    for (r, _, cpu) in &want {
        let cpu = cpu.as_deref().unwrap_or_default();
        assert!(out.contains(&format!("rank {r} may run on CPUs {cpu}\n")), "rank {r} not on CPU {cpu}: {out}");
    }
    assert_eq!(err.contains("some share one"), cpus.len() < 3, "{err}");
    // Not bound: every CPU of the launcher's, said so.
    let (out, err) = text(&run(&["run", "-n", "2", "--report-bindings", "--", &hello, "--cpus"]));
    assert_eq!(reported_bindings(&err), vec![(0, 0, None), (1, 0, None)], "{err}");
    for r in 0..2 {
        assert!(out.contains(&format!("rank {r} may run on CPUs {list}\n")), "{out}");
    }
    // Within the CPUs the launcher was given (as a batch system's cgroup or taskset
    // gives them): one CPU, so both ranks on it, sharing it, said so.
    let last = cpus.last().expect("a CPU").to_string();
    let mut c = Command::new("taskset");
    c.args(["-c", &last]).arg(ductile_suite::paths::ductile_bin());
    let o = c.args(["run", "-n", "2", "--bind-to", "core", "--", &hello, "--cpus"]).output().expect("start taskset");
    let (out, err) = text(&o);
    for r in 0..2 {
        assert!(out.contains(&format!("rank {r} may run on CPUs {last}\n")), "{out}");
    }
    assert!(err.contains("node 0: more ranks on this host than cores to bind them to (1): some share one"), "{err}");
}

#[test]
fn a_failing_rank_ends_the_job_with_its_code_and_leaves_nothing() {
    let report = tmp("fail.json");
    let start = Instant::now();
    let out = fault_job(Some(30), &report, &["exit", "2", "3"]).output().unwrap();
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(start.elapsed() < Duration::from_secs(20));
    assert!(String::from_utf8_lossy(&out.stderr).contains("rank 2 on node 1 exited with code 3"));
    assert_no_survivors(&report);
}

#[test]
fn timeout_and_ctrl_c_end_the_whole_job() {
    let report = tmp("timeout.json");
    let out = fault_job(Some(2), &report, &["hang"]).output().unwrap();
    assert_eq!(out.status.code(), Some(124), "{out:?}");
    assert_no_survivors(&report);

    let report = tmp("sigint.json");
    let mut child = fault_job(None, &report, &["hang"]).stdout(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for _ in 0..4 {
        assert!(lines.next().unwrap().unwrap().contains("waiting"));
    }
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGINT).unwrap();
    let status = wait_with_timeout(&mut child, Duration::from_secs(20));
    assert_eq!(status.code(), Some(130));
    assert_no_survivors(&report);

    // SIGHUP (the terminal closed) too; and a signal that comes while the agents are
    // still starting ends the job as well, once they have.
    for (signal, wait, code) in [(Signal::SIGHUP, 1500, 129), (Signal::SIGINT, 0, 130)] {
        let report = tmp("signal.json");
        let mut child = ductile(&["run", "-n", "16", "--nodes", "8", "--report", report.to_str().unwrap()])
            .arg("--")
            .arg(ex("fault"))
            .arg("hang")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The launcher names its control socket once it catches signals, before it
        // starts the agents.
        let mut err = BufReader::new(child.stderr.take().unwrap()).lines();
        assert!(err.next().unwrap().unwrap().contains("control socket"));
        std::thread::spawn(move || err.for_each(drop));
        std::thread::sleep(Duration::from_millis(wait));
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal).unwrap();
        let status = wait_with_timeout(&mut child, Duration::from_secs(20));
        assert_eq!(status.code(), Some(code), "{signal}");
        assert_no_survivors(&report);
    }
}

#[test]
fn bad_command_lines_get_one_clear_line() {
    let cases: &[(&[&str], &str)] = &[
        (&["run", "-n", "0", "--", "true"], "-n must be at least 1"),
        (&["run", "-n", "2"], "no program given"),
        (&["run", "-n", "2", "--", "no-such-program-here"], "program not found"),
        (&["run", "--nodes", "0", "--", "true"], "--nodes must be at least 1"),
        (&["run", "-n", "2", "--nodes", "3", "--", "true"], "3 nodes need at least 3 ranks"),
        (&["run", "-n", "x", "--", "true"], "invalid value 'x'"),
        (&["run", "--timeout", "0", "--", "true"], "invalid value '0' for '--timeout <SECS>': 0 is not in 1..="),
        (&["run", "--timeout", "18446744073709551615", "--", "true"], "is not in 1..=31622400"),
        (&["run", "--spawn", "foo", "--", "true"], "[possible values: parallel, single] (see ductile run --help)"),
        (
            &["run", "--redistribution", "all", "--", "true"],
            "unknown redistribution method \"all\" (known: collective, p2p, rma)",
        ),
        (&["resize", "--nodes", "2"], "required arguments were not provided: <JOB>"),
        (&["run", "--min-nodes", "3", "--max-nodes", "2", "--", "true"], "--min-nodes 3 is above --max-nodes 2"),
        (&["run", "--nodes", "2", "--min-nodes", "2", "--policy", "steps:1", "--", "true"], "below --min-nodes 2"),
        (&["run", "--fabric-provider", "shm", "--", "true"], "--fabric-provider needs --transport fabric"),
        (&["run", "-n", "2", "--hostlist", "hosts", "true"], "unknown option --hostlist"),
        (&["run", "--hostfile", "/nonexistent-hosts", "--", "true"], "cannot read the hostfile /nonexistent-hosts"),
        (&["run", "--hosts", "a,b;c", "--", "true"], "--hosts: host list entry 2: `b;c` is not a usable host name"),
        (&["run", "--hosts", "a:0", "--", "true"], "`a:0` is not a slot count (1 to 4096)"),
        (&["run", "--hosts", "a,b", "-n", "3", "--", "true"], "the job needs 3 nodes, but there are 2 hosts"),
        (&["run", "--hosts", "a,b", "--max-nodes", "3", "--", "true"], "--max-nodes 3 is more than the 2 hosts"),
        (&["run", "--hosts", "a", "--hostfile", "f", "--", "true"], "cannot be used with"),
        (&["run", "--rsh", "ssh", "--", "true"], "--rsh needs --hosts, --hostfile or --slurm"),
        (&["run", "--slurm", "--hosts", "a", "--", "true"], "cannot be used with"),
        (
            &["run", "--hosts", "a,b", "--transport", "fabric", "--fabric-provider", "shm", "--", "true"],
            "libfabric's shm provider cannot reach other hosts",
        ),
        (&["run", "--hosts", "a", "--rsh", " ", "--", "true"], "--rsh is empty"),
        (&["run", "--report", "/nonexistent-dir/r.json", "--", "true"], "/nonexistent-dir is not a directory"),
        (&["run", "--report", "/tmp", "--", "true"], "cannot write the report to /tmp: it is a directory"),
        (&["run", "-n", "2", "--adopt", "/tmp/s", "--adopt-pid", "1", "--", "true"], "--adopt needs a job of one"),
        (&["run", "-n", "1", "--adopt", "/tmp/s", "--", "true"], "--adopt-pid <PID>"),
        // Huge counts are refused before anything is built or walked per node.
        (&["run", "-n", "4294967295", "--slots", "1,1", "--", "true"], "4294967295 ranks or nodes: more than"),
        (&["run", "-n", "1", "--max-nodes", "4294967295", "--", "true"], "--max-nodes asks for 4294967295 nodes"),
        (&["run", "-n", "1", "--policy", "steps:1,4000000000", "--", "true"], "--policy asks for 4000000000 nodes"),
        (&["run", "-n", "4", "--slots", "5000", "--", "true"], "a pool of 1 nodes has 5000 slots"),
    ];
    for (args, want) in cases {
        let out = run(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // Sizes the job asks for itself: --max-nodes would not help, and is not suggested.
    let out = run(&["run", "-n", "1", "--slots", "3000", "--policy", "steps:1,2", "--", "true"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("a pool of 2 nodes has 6000 slots, more than the limit of 4096 ranks\n"), "{err}");
    let slurm = [("SLURM_JOB_NODELIST", "n[1-"), ("SLURM_TASKS_PER_NODE", "2")];
    let overflow = [("SLURM_JOB_NODELIST", "n[1-2]"), ("SLURM_TASKS_PER_NODE", "1,1(x18446744073709551615)")];
    // Allocations the job could grow past the limit on: bounded by --max-nodes, or refused.
    let huge = [("SLURM_JOB_NODELIST", "n[1-5000]"), ("SLURM_TASKS_PER_NODE", "1(x5000)")];
    let wide = [("SLURM_JOB_NODELIST", "n[1-2000]"), ("SLURM_TASKS_PER_NODE", "4(x2000)")];
    for (vars, want) in [
        (&slurm[..0], "--slurm needs a Slurm allocation"),
        (&slurm[..], "a `[` without its `]`"),
        (&overflow[..], "more than 65536 counts"),
        (&huge[..], "the job may grow to all 5000 nodes of its hosts, more than the limit of 4096: bound it with"),
        (&wide[..], "a pool of 2000 nodes has 8000 slots, more than the limit of 4096 ranks: bound the job with"),
    ] {
        let mut c = ductile(&["run", "--slurm", "-n", "2", "--", "true"]);
        c.env_remove("SLURM_JOB_NODELIST").env_remove("SLURM_TASKS_PER_NODE").envs(vars.iter().copied());
        let out = c.output().expect("start ductile");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.lines().count() == 1 && err.contains(want), "{vars:?}: {err}");
    }
    let env_cases = [
        ("DUCTILE_SPIN_US", "x"),
        ("DUCTILE_SPIN_US", "18446744073709551615"),
        ("DUCTILE_BACKGROUND_SHARE", "2"),
        ("DUCTILE_HUGE_PAGES", "yes"),
        ("DUCTILE_THREADS", "100000000"),
        ("DUCTILE_TIMEOUT", "0"),
    ];
    for (var, value) in env_cases {
        let out = ductile(&["run", "-n", "2", "--", "true"]).env(var, value).output().expect("start ductile");
        assert!(!out.status.success(), "{var}={value} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{var}={value}: {err}");
        assert!(err.contains(var) && err.contains("the ranks would inherit it"), "{var}={value}: {err}");
    }
    let out = run(&["run", "-n", "6", "--dry-run", "--", "true"]);
    assert!(out.status.success());
    let map = String::from_utf8_lossy(&out.stdout);
    assert!(map.contains("6 ranks on 2 simulated nodes") && map.contains("node 1: 3 slots, ranks 3..=5"), "{map}");
    let out = run(&["run", "--nodes", "1", "--max-nodes", "8", "--policy", "steps:8,2", "--dry-run", "--", "true"]);
    assert!(out.status.success());
    let plan = String::from_utf8_lossy(&out.stdout);
    // The hypercube from one process: 1, 2, then 4 new node worlds per step.
    assert!(plan.contains("checkpoint 1: 1 -> 8 nodes: grow, 3 steps"), "{plan}");
    assert!(plan.contains("step 3: spawner 3 starts node 7 (1 processes)"), "{plan}");
    assert!(plan.contains("checkpoint 2: 8 -> 2 nodes: shrink, release nodes [7, 6, 5, 4, 3, 2]"), "{plan}");
    // A preferred count raises steps below it, and makes `fixed` grow a smaller job.
    let preferred = ["run", "--nodes", "1", "--max-nodes", "4", "--preferred-nodes", "2", "--dry-run"];
    let out = run(&[&preferred[..], &["--policy", "steps:1,4,4,1", "--", "true"]].concat());
    let plan = String::from_utf8_lossy(&out.stdout);
    assert!(plan.contains("checkpoint 1: 1 -> 2 nodes: grow, 1 steps"), "{plan}");
    assert!(plan.contains("checkpoint 3: 4 nodes: no change"), "{plan}");
    assert!(plan.contains("checkpoint 4: 4 -> 2 nodes: shrink"), "{plan}");
    let out = run(&[&preferred[..], &["--period", "5", "--", "true"]].concat());
    let plan = String::from_utf8_lossy(&out.stdout);
    assert!(plan.contains("checkpoint 5: 1 -> 2 nodes: grow"), "{plan}");
}

#[test]
fn processes_that_leave_their_node_worlds_group_end_with_the_job() {
    // A rank starts a child in a session of its own (out of its node world's process
    // group) and says its pid; the job must not leave it running.
    let report = tmp("setsid.json");
    let pid_file = tmp("setsid.pid");
    let _ = std::fs::remove_file(&pid_file);
    let script = format!(
        "setsid sleep 300 >/dev/null 2>&1 </dev/null & echo $! > {}; sleep 0.3; exec {}",
        pid_file.display(),
        ex("hello")
    );
    let out =
        run(&["run", "-n", "1", "--timeout", "60", "--report", report.to_str().unwrap(), "--", "sh", "-c", &script]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let pid: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    let alive = comm.trim() == "sleep";
    if alive {
        // Ours (the test started the job that started it): end it before failing.
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
    }
    assert!(!alive, "process {pid}, started by a rank with setsid, survived the job");
    assert_no_survivors(&report);
}

#[test]
fn a_program_that_is_not_a_ductile_program_fails_cleanly() {
    // Past --join-timeout: the late ranks are named.
    let report = tmp("notductile.json");
    let r = report.to_str().unwrap();
    let started = Instant::now();
    // The agent's limit, 8 of the 10 s, leaves it time to start on a loaded machine
    // and say which ranks are late before the controller gives up on it.
    let out = run(&["run", "-n", "2", "--join-timeout", "10", "--timeout", "60", "--report", r, "--", "sleep", "30"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("did not join the job within"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(25), "took {:?}", started.elapsed());
    assert_no_survivors(&report);
    // A rank that exits (or dies) before it joins: the job ends with its code.
    for (prog, code, says) in [("exit 7", 7, "exited with code 7"), ("kill -SEGV $$", 139, "was killed by signal 11")] {
        let out = run(&["run", "-n", "2", "--timeout", "60", "--report", r, "--", "sh", "-c", prog]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{prog}: {err}");
        assert!(err.contains(says), "{prog}: {err}");
        assert_no_survivors(&report);
    }
    // A --timeout shorter than the join limit ends the job as a timeout, at once.
    let started = Instant::now();
    let out = run(&["run", "-n", "2", "--timeout", "2", "--report", r, "--", "sleep", "30"]);
    assert_eq!(out.status.code(), Some(124), "{}", String::from_utf8_lossy(&out.stderr));
    // Well before the program's 30 s and the join limit's 60 s.
    assert!(started.elapsed() < Duration::from_secs(20), "took {:?}", started.elapsed());
    assert_no_survivors(&report);
}

#[test]
fn intruders_are_rejected_and_the_job_completes() {
    use ductile_transport::auth::{dial, Identity};
    use ductile_transport::{JobId, JobKey, Rank};
    let go = tmp("go");
    let _ = std::fs::remove_file(&go);
    let mut child =
        ductile(&["run", "-n", "4", "--nodes", "2", "--timeout", "60", "--", &ex("guarded"), go.to_str().unwrap()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let errors = common::lines_of(child.stderr.take().unwrap());
    let first = lines.next().unwrap().unwrap();
    let mut words = first.split_whitespace();
    assert_eq!(words.next(), Some("ADDR"));
    let addr: std::net::SocketAddr = words.next().unwrap().parse().unwrap();
    assert_eq!(words.next(), Some("JOB"));
    let job = JobId(u64::from_str_radix(words.next().unwrap(), 16).unwrap());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        use tokio::io::AsyncWriteExt;
        let t = Duration::from_secs(5);
        // The right job id but a wrong key: the rank's proof fails on our side and ours on its side.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let wrong = Identity { job, key: JobKey::from_bytes([7; 32]), rank: Rank(1) };
        assert!(dial(&mut s, &wrong, Rank(0), t).await.is_err());
        drop(s);
        // Garbage bytes.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(&[0xa5; 300]).await.unwrap();
        drop(s);
        // A truncated hello.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"DUH1\x00\x01").await.unwrap();
        drop(s);
        // A frame header announcing 2^64-1 bytes, padded to a hello's length.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut h = ductile_transport::frame::FrameHeader::data(
            Rank(1),
            ductile_transport::Context(0),
            ductile_transport::Tag(0),
            u64::MAX,
        )
        .encode()
        .to_vec();
        h.resize(ductile_transport::auth::HELLO_LEN, 0xff);
        s.write_all(&h).await.unwrap();
        s.flush().await.unwrap();
        drop(s);
    });
    // Rank 0 says so for each, from a task of its own: the job goes on once all have,
    // before its end could cut a late one short.
    let mut err = String::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while err.lines().filter(|l| l.contains("rejected connection")).count() < 4 {
        let left = deadline.saturating_duration_since(Instant::now());
        match errors.recv_timeout(left) {
            Ok(line) => err.push_str(&(line + "\n")),
            Err(_) => break,
        }
    }
    std::fs::File::create(&go).unwrap().write_all(b"go").unwrap();
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    let status = wait_with_timeout(&mut child, Duration::from_secs(60));
    err.extend(errors.iter().map(|l| l + "\n"));
    assert!(status.success(), "{err}");
    assert!(rest.iter().any(|l| l.contains("guarded: result correct")), "{rest:?}");
    let rejected = err.lines().filter(|l| l.contains("rejected connection")).count();
    assert_eq!(rejected, 4, "{err}");
}

#[test]
fn a_launcher_whose_output_is_closed_still_ends_the_job_cleanly() {
    // `ductile run ... 2>&1 | head -1`: the reader of the launcher's stdout and stderr
    // is gone. Printing its own messages used to panic the controller (exit 101), which
    // left its control socket behind and lost the job's exit code and report.
    let report = tmp("closed-output.json");
    let mut child = fault_job(Some(60), &report, &["exit", "1", "3"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    drop(child.stderr.take());
    let status = wait_with_timeout(&mut child, Duration::from_secs(60));
    assert_eq!(status.code(), Some(3), "{status:?}");
    let v = common::read_report(&report);
    let socket = v["control_socket"].as_str().expect("the control socket in the report");
    assert!(!std::path::Path::new(socket).exists(), "{socket} left behind");
    assert_no_survivors(&report);
}

#[test]
fn sockets_of_jobs_that_are_gone_are_removed_and_live_ones_kept() {
    // A controller killed with SIGKILL cannot remove its socket; the next job does.
    use std::os::unix::fs::MetadataExt;
    let uid = std::fs::metadata("/proc/self").unwrap().uid();
    let dir = std::env::temp_dir().join(format!("ductile-{uid}"));
    std::fs::create_dir_all(&dir).unwrap();
    let stale = dir.join(format!("job-stale-{}.sock", std::process::id()));
    let live = dir.join(format!("job-live-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&stale);
    let _ = std::fs::remove_file(&live);
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let listener = std::os::unix::net::UnixListener::bind(&live).unwrap();
    // (No check that `stale` exists now: a job of a test running beside this one may
    // already have swept it.)
    let out = run(&["run", "-n", "1", "--", &ex("hello")]);
    assert!(out.status.success(), "{out:?}");
    assert!(!stale.exists(), "{} was left", stale.display());
    assert!(live.exists(), "{} was removed", live.display());
    drop(listener);
    std::fs::remove_file(&live).unwrap();
}

#[test]
fn rank_0_reads_what_ductile_run_is_given_on_stdin_and_the_others_nothing() {
    // As `mpirun` does. 300 000 bytes: more than a pipe holds, so rank 0 must read
    // while the test still writes.
    let input: String = (0..30_000).map(|i| format!("{:09}\n", i)).collect();
    let mut child = ductile(&["run", "-n", "3", "--nodes", "2", "--timeout", "60", "--", &ex("hello"), "--stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let text = input.clone();
    let writer = std::thread::spawn(move || stdin.write_all(text.as_bytes()));
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    writer.join().unwrap().expect("rank 0 read all of stdin");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("rank 0 read {} bytes: \"000000000\\n", input.len())), "{text}");
    assert!(text.contains("rank 1 read 0 bytes") && text.contains("rank 2 read 0 bytes"), "{text}");
}

#[test]
fn sigusr1_and_sigusr2_reach_every_rank_and_the_job_goes_on() {
    // As mpirun and srun do, so that a batch system's warning before the time limit
    // reaches the application instead of ending the launcher. Every rank waits for
    // SIGUSR1, then SIGUSR2, then ends well.
    let report = tmp("usr1.json");
    let child = ductile(&["run", "-n", "3", "--nodes", "2", "--report", report.to_str().unwrap()])
        .args(["--", &ex("fault"), "signals"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let launcher = nix::unistd::Pid::from_raw(child.id() as i32);
    let mut job = common::Running(child);
    let out = common::lines_of(job.0.stdout.take().unwrap());
    let err = common::lines_of(job.0.stderr.take().unwrap());
    let next = |what: &str| {
        let line = out.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| panic!("no line: {what}"));
        assert!(line.contains(what), "{line}: expected {what}");
    };
    (0..3).for_each(|_| next("ready"));
    nix::sys::signal::kill(launcher, Signal::SIGUSR1).unwrap();
    (0..3).for_each(|_| next("got SIGUSR1"));
    // A batch system may signal every process of the job: the agents outlive it.
    let agents: Vec<u64> = common::descendants(u64::from(launcher.as_raw() as u32))
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == b"agent"))
        })
        .collect();
    assert_eq!(agents.len(), 2, "{agents:?}");
    for a in &agents {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(*a as i32), Signal::SIGUSR1).unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(agents.iter().all(|&a| common::is_alive(a)), "an agent died of SIGUSR1");
    nix::sys::signal::kill(launcher, Signal::SIGUSR2).unwrap();
    (0..3).for_each(|_| next("got SIGUSR2"));
    let status = wait_with_timeout(&mut job.0, Duration::from_secs(30));
    assert!(status.success(), "{:?}", err.try_iter().collect::<Vec<_>>());
    assert_no_survivors(&report);
}

#[test]
fn the_job_key_is_in_no_command_line_environment_log_or_report() {
    // A key the test knows (the launcher takes it from DUCTILE_TEST_JOB_KEY, which
    // nothing it starts inherits), looked for as hex, base64 and a byte list while a job
    // grows 1 -> 3 nodes and shrinks back, with every log line on.
    let (hex, leaks) = common::test_key();
    let report = tmp("key.json");
    let mark = format!("key-{}", std::process::id());
    let jacobi = ex("jacobi");
    let args = ["run", "--report", report.to_str().unwrap(), "--nodes", "1", "--slots", "2", "--max-nodes", "3"];
    let program = ["--policy", "steps:3,1", "--", &jacobi, "--points", "200000", "--iters", "1000", "--every", "250"];
    let child = ductile(&[&args[..], &program[..]].concat())
        .env("DUCTILE_TEST_JOB_KEY", &hex)
        .env("DUCTILE_LOG", "debug")
        .env(common::MARK, &mark)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let launcher = u64::from(child.id());
    let launcher_cmdline = std::fs::read(format!("/proc/{launcher}/cmdline")).unwrap();
    let mut job = common::Running(child);
    let (out, err) = (common::lines_of(job.0.stdout.take().unwrap()), common::lines_of(job.0.stderr.take().unwrap()));
    let mut seen = std::collections::BTreeSet::new();
    let start = Instant::now();
    while job.0.try_wait().unwrap().is_none() {
        assert!(start.elapsed() < Duration::from_secs(60), "the job did not end");
        // The launcher, and a child it forked that has not yet become an agent (until
        // its exec it is a copy of the launcher, environment and all), are skipped.
        for pid in common::marked(&mark).into_iter().filter(|&p| p != launcher) {
            common::assert_key_not_in(pid, &leaks, &|c| c == launcher_cmdline.as_slice());
            seen.insert(pid);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(job.0.wait().unwrap().success());
    // Three agents and six ranks at the widest; a scan may miss some that come and go.
    assert!(seen.len() >= 4, "only {} processes of the job were seen: {seen:?}", seen.len());
    let text: Vec<String> = out.try_iter().chain(err.try_iter()).collect();
    let text = text.join("\n");
    assert!(text.contains("checksum") && text.contains("for tests only"), "{text}");
    leaks("the job's output and logs", &text);
    leaks("the report", &std::fs::read_to_string(&report).unwrap());
    assert_no_survivors(&report);
}
