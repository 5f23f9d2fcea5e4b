//! Jobs that span hosts (`ductile run --hosts/--hostfile`), on test hosts in network
//! namespaces that each test creates (see `common::netns`): the launcher runs in a head
//! namespace and starts its agents in the host namespaces through `--rsh "env -i -C /
//! ip netns exec"`, so every connection between hosts crosses a real (virtual) network, and
//! nothing reaches another address. Without root or iproute2 the tests say SKIPPED
//! and pass; CI runs as root and installs iproute2 (scripts/test.sh).

mod common;

use common::netns::TestHosts;
use common::{ex, lines_of, tmp, wait_with_timeout};
use ductile_suite::paths::ductile_bin;
use std::os::unix::fs::MetadataExt;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The remote shell of every test: enter the host's namespace, with an empty
/// environment and in `/`, as a login over ssh would not have `ductile run`'s.
fn rsh() -> String {
    let ip = ["/usr/sbin/ip", "/sbin/ip"].into_iter().find(|p| std::path::Path::new(p).exists()).unwrap_or("ip");
    format!("env -i -C / {ip} netns exec")
}
/// Limit of every job (`--timeout`), so that no test can hang.
const JOB_LIMIT: &str = "60";

fn hosts(n: usize) -> Option<TestHosts> {
    TestHosts::create(n).unwrap_or_else(|e| panic!("cannot create test hosts: {e}"))
}

/// `ductile run --rsh (rsh) --timeout JOB_LIMIT ARGS` in the head namespace.
fn run_cmd(t: &TestHosts, args: &[&str]) -> Command {
    let mut c = t.in_head(&ductile_bin());
    c.args(["run", "--rsh", &rsh(), "--timeout", JOB_LIMIT]).args(args).env_remove("DUCTILE_LOG");
    c
}

fn run(t: &TestHosts, args: &[&str]) -> Output {
    output_within(&mut run_cmd(t, args))
}

/// Runs `c` to its end, its output captured, failing the test (and ending it) if it
/// takes more than `JOB_LIMIT` + 30 s: the launcher's own limit failed.
fn output_within(c: &mut Command) -> Output {
    let mut child = common::Running(c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start the job"));
    let (mut out, mut err) = (child.0.stdout.take().unwrap(), child.0.stderr.take().unwrap());
    let read_out = std::thread::spawn(move || {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut out, &mut b).map(|_| b)
    });
    let read_err = std::thread::spawn(move || {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut err, &mut b).map(|_| b)
    });
    let limit = Duration::from_secs(JOB_LIMIT.parse::<u64>().unwrap() + 30);
    let status = wait_with_timeout(&mut child.0, limit);
    Output { status, stdout: read_out.join().unwrap().unwrap(), stderr: read_err.join().unwrap().unwrap() }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The inode of host `name`'s network namespace, as `/proc/PID/ns/net` shows it.
fn netns_inode(name: &str) -> u64 {
    std::fs::metadata(format!("/run/netns/{name}")).expect("the namespace's file").ino()
}

/// Waits (a few seconds at most) until no process is left in the test's namespaces.
fn assert_namespaces_empty(t: &TestHosts) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !t.pids().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(t.pids().is_empty(), "processes left in the test hosts: {:?}", t.pids());
}

#[test]
fn hello_runs_on_each_host_with_the_launchers_environment_over_tcp_and_quic() {
    let Some(t) = hosts(2) else { return };
    let hosts = t.hosts();
    let list = format!("{}:2,{}:2", hosts[0], hosts[1]);
    let dir = tmp("hosts-cwd");
    std::fs::create_dir_all(&dir).unwrap();
    for transport in ["tcp", "quic"] {
        let value = format!("set-for-{transport}");
        let mut c = run_cmd(&t, &["--hosts", &list, "--transport", transport, &ex("hello"), "--env", "HOSTS_TEST_VAR"]);
        let out = output_within(c.env("HOSTS_TEST_VAR", &value).current_dir(&*dir));
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(out.status.code(), Some(0), "{transport}: {stdout}\n{stderr}");
        for r in 0..4 {
            assert!(stdout.contains(&format!("hello from rank {r} of 4 on node {} of 2", r / 2)), "{stdout}");
            // Ranks on other hosts get the launcher's environment and directory; their
            // stderr stays stderr.
            let host = &hosts[r / 2];
            let want =
                format!("rank {r}: HOSTS_TEST_VAR={value} in {}, network net:[{}]", dir.display(), netns_inode(host));
            assert!(stderr.contains(&want), "{transport}: no `{want}` in\n{stderr}");
        }
        assert!(!stdout.contains("HOSTS_TEST_VAR"), "stderr lines reached stdout:\n{stdout}");
    }
    assert_namespaces_empty(&t);
}

/// The checksum of a fixed-size run of the same problem on this host.
fn rigid_checksum(jacobi: &[&str]) -> String {
    let out = common::run(&[&["run", "-n", "2", "--timeout", JOB_LIMIT, "--"], jacobi].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    checksum(&text(&out.stdout))
}

fn checksum(stdout: &str) -> String {
    let line = stdout.lines().find(|l| l.contains("checksum")).unwrap_or_else(|| panic!("no checksum in {stdout}"));
    line.split("checksum ").nth(1).and_then(|r| r.split_whitespace().next()).unwrap().to_string()
}

#[test]
fn jacobi_grows_and_shrinks_across_hosts_from_a_hostfile() {
    let Some(t) = hosts(3) else { return };
    let h = t.hosts();
    let file = tmp("hostfile");
    // A PBS-style repeat (two lines, two slots), `slots=`, and `name:N`.
    std::fs::write(&*file, format!("# test hosts\n{0}\n{0}\n{1} slots=2  # the second\n{2}:2\n", h[0], h[1], h[2]))
        .unwrap();
    let jacobi = ex("jacobi");
    let problem = [jacobi.as_str(), "--points", "300000", "--iters", "120", "--every", "20"];
    let report = tmp("hosts-report.json");
    let f = file.display().to_string();
    let r = report.display().to_string();
    let args =
        [&["--hostfile", &f, "--nodes", "1", "--policy", "steps:3,1,2", "--report", &r, "--"][..], &problem].concat();
    let out = run(&t, &args);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert_eq!(checksum(&stdout), rigid_checksum(&problem), "{stdout}");
    let rep = common::read_report(&report);
    assert_eq!(rep["reconfigurations"].as_array().unwrap().len(), 3, "{stderr}");
    for n in rep["nodes"].as_array().unwrap() {
        let node = n["node"].as_u64().unwrap() as usize;
        assert_eq!(n["host"].as_str(), Some(h[node].as_str()), "{n}");
    }
    // 1 -> 3 -> 1 -> 2 nodes: the growths started node worlds on two other hosts.
    let joined: Vec<&str> = stderr.lines().filter_map(|l| l.split_whitespace().last()).collect();
    assert!(["+1-2", "-1-2", "+1"].iter().all(|c| joined.contains(c)), "{stderr}");
    assert_namespaces_empty(&t);
}

#[test]
fn a_job_on_this_host_and_others_grows_and_shrinks_across_them() {
    let Some(t) = hosts(2) else { return };
    let h = t.hosts();
    // Node 0 is the launcher's own host: its agent starts here, and its ranks bind to
    // the address the other hosts reach it at.
    let list = format!("localhost:2,{}:2,{}:2", h[0], h[1]);
    let jacobi = ex("jacobi");
    let problem = [jacobi.as_str(), "--points", "300000", "--iters", "120", "--every", "20"];
    let args = [&["--hosts", &list, "--nodes", "1", "--policy", "steps:3,1,2", "--"][..], &problem].concat();
    let out = run(&t, &args);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert_eq!(checksum(&stdout), rigid_checksum(&problem), "{stdout}");
    assert!(!stderr.contains("WARN"), "{stderr}");
    assert_namespaces_empty(&t);
}

#[test]
fn a_remote_shell_that_hangs_ends_within_the_limits_even_with_a_large_environment() {
    let Some(t) = hosts(1) else { return };
    // Remote shells that say their pid, then: start nothing (silent), or begin an
    // agent's channel and never read what follows (a handoff larger than a pipe holds).
    let silent = ("silent", "");
    let deaf = ("deaf", r"printf '\000ductile-agent8\n'");
    for ((name, begin), want) in [(silent, "the remote shell"), (deaf, "did not start through the remote shell")] {
        let script = tmp(&format!("{name}-rsh.sh"));
        let pids = tmp(&format!("{name}-rsh.pids"));
        let body = format!("#!/bin/sh\necho $$ >> {}\n{begin}\nexec sleep 1000\n", pids.display());
        common::write_executable(&script, body.as_bytes());
        let started = Instant::now();
        let list = format!("{},{}", t.hosts()[0], "other-host");
        let mut c = t.in_head(&ductile_bin());
        c.args(["run", "--hosts", &list, "--rsh", &script.display().to_string(), "--join-timeout", "3"]);
        c.arg(ex("hello"));
        for i in 0..4 {
            // Each under the kernel's 128 KiB limit for one variable.
            c.env(format!("LARGE_TEST_VAR_{i}"), "x".repeat(50_000));
        }
        let out = output_within(&mut c);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert!(stderr.contains(want), "{name}: {stderr}");
        assert!(started.elapsed() < Duration::from_secs(20), "{name} took {:?}: {stderr}", started.elapsed());
        let shells: Vec<u32> = std::fs::read_to_string(&*pids).unwrap().lines().map(|l| l.parse().unwrap()).collect();
        assert_eq!(shells.len(), 2, "{name}: {shells:?}");
        for pid in shells {
            assert!(!common::is_alive(u64::from(pid)), "{name}: remote shell {pid} survived the job");
        }
    }
}

#[test]
fn a_job_runs_on_the_hosts_of_a_slurm_allocation() {
    let Some(t) = hosts(2) else { return };
    // As Slurm writes them: a hostlist expression and run-length task counts.
    let h = t.hosts();
    let list = format!("{}[0-1]", h[0].strip_suffix('0').unwrap());
    let mut c = run_cmd(&t, &["--slurm", "--tag-output", &ex("hello")]);
    let out = output_within(c.env("SLURM_JOB_NODELIST", &list).env("SLURM_TASKS_PER_NODE", "3(x2)"));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    for r in 0..6 {
        assert!(stdout.contains(&format!("hello from rank {r} of 6 on node {} of 2", r / 3)), "{stdout}");
    }
    assert_namespaces_empty(&t);
}

#[test]
fn an_unreachable_host_is_a_clear_error_and_leaves_nothing() {
    let Some(t) = hosts(1) else { return };
    let list = format!("{},no-such-host", t.hosts()[0]);
    let started = Instant::now();
    let out = run(&t, &["--hosts", &list, &ex("hello")]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
    let why = "node 1 (no-such-host) failed: the remote shell ended before the agent started";
    assert!(stderr.contains(why), "{stderr}");
    assert!(!stderr.contains("did not exit in time"), "{stderr}");
    assert_namespaces_empty(&t);
}

/// Runs a jacobi that resizes between 1 and 2 of `list`'s hosts every 3 iterations
/// through remote shell `rsh`, presses Ctrl-C once it has resized a few times, and
/// checks that the launcher ends with 130.
fn interrupt_resizes(t: &TestHosts, rsh: &str, list: &str) {
    let steps = format!("steps:{}", ["1"; 40].join(",2,"));
    let jacobi = ex("jacobi");
    let mut c = t.in_head(&ductile_bin());
    c.args(["run", "--rsh", rsh, "--timeout", JOB_LIMIT, "--hosts", list, "--nodes", "1", "--policy", &steps, "--"]);
    c.args([&jacobi, "--points", "100000", "--iters", "100000000", "--every", "3"]);
    let mut child = common::Running(c.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap());
    let lines = lines_of(child.0.stdout.take().unwrap());
    // A few changes have been made: growths across hosts are under way or done.
    for _ in 0..4 {
        let l = lines.recv_timeout(Duration::from_secs(30)).expect("the job resizes");
        assert!(l.contains("processes on"), "{l}");
    }
    // `ip netns exec` execs the launcher: the child is `ductile run` itself.
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.0.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let status = wait_with_timeout(&mut child.0, Duration::from_secs(30));
    assert_eq!(status.code(), Some(130));
}

#[test]
fn ctrl_c_in_the_middle_of_resizes_across_hosts_leaves_nothing() {
    let Some(t) = hosts(2) else { return };
    interrupt_resizes(&t, &rsh(), &format!("{}:2,{}:2", t.hosts()[0], t.hosts()[1]));
    assert_namespaces_empty(&t);
}

/// sshd daemons, one in each test host, that accept one key for this user; killed on
/// drop (the test hosts' own drop would too).
struct Sshd {
    dir: common::Scratch,
    daemons: Vec<std::process::Child>,
}

impl Drop for Sshd {
    fn drop(&mut self) {
        for d in &mut self.daemons {
            let _ = d.kill();
            let _ = d.wait();
        }
    }
}

impl Sshd {
    /// Starts sshd on every host of `t`, or says SKIPPED when sshd is not installed.
    fn start(t: &TestHosts) -> Option<Sshd> {
        let sshd = std::path::Path::new("/usr/sbin/sshd");
        if !sshd.exists() {
            if let Err(e) = common::netns::skip::<()>("/usr/sbin/sshd (Debian's openssh-server) is not installed") {
                panic!("{e}");
            }
            return None;
        }
        // A directory of its own: tests run side by side in one process.
        static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = tmp(&format!("sshd-{}", STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
        std::fs::create_dir_all(&*dir).unwrap();
        for key in ["host_key", "id"] {
            let path = dir.join(key);
            let ok = Command::new("ssh-keygen").args(["-q", "-t", "ed25519", "-N", "", "-f"]).arg(&path).status();
            assert!(ok.unwrap().success(), "ssh-keygen");
        }
        std::fs::copy(dir.join("id.pub"), dir.join("authorized_keys")).unwrap();
        // sshd's privilege separation needs its directory (the package's service makes it).
        std::fs::create_dir_all("/run/sshd").unwrap();
        let mut out = Sshd { daemons: Vec::new(), dir };
        for i in 0..t.hosts().len() {
            let config = out.dir.join(format!("sshd_config_{i}"));
            let d = out.dir.display();
            std::fs::write(
                &config,
                format!(
                    "ListenAddress {}\nHostKey {d}/host_key\nAuthorizedKeysFile {d}/authorized_keys\nStrictModes no\n\
                     PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nPermitRootLogin \
                     prohibit-password\nPidFile none\n",
                    t.host_addr(i)
                ),
            )
            .unwrap();
            let daemon = t.in_host(i, sshd).args(["-D", "-e", "-f"]).arg(&config).stderr(Stdio::null()).spawn();
            out.daemons.push(daemon.expect("start sshd"));
        }
        Some(out)
    }

    /// The remote shell: ssh with this key, never asking anything.
    fn rsh(&self) -> String {
        format!(
            "ssh -F /dev/null -i {} -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null \
             -o LogLevel=ERROR -o ConnectTimeout=5",
            self.dir.join("id").display()
        )
    }

    /// Waits (10 s at most) until every host's sshd lets the head in.
    fn await_ready(&self, t: &TestHosts) {
        let rsh = self.rsh();
        for i in 0..t.hosts().len() {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let words: Vec<&str> = rsh.split_whitespace().collect();
                let mut c = t.in_head(std::path::Path::new(words[0]));
                let ok = output_within(c.args(&words[1..]).arg(t.host_addr(i).to_string()).arg("true"));
                if ok.status.success() {
                    break;
                }
                assert!(Instant::now() < deadline, "sshd on host {i} did not let us in: {}", text(&ok.stderr));
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Job processes (not sshd's) left in the test hosts, after a few seconds at most.
fn job_processes_left(t: &TestHosts) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left: Vec<String> = t
            .pids()
            .into_iter()
            .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/cmdline")).ok())
            .map(|c| c.replace('\0', " "))
            .filter(|c| !c.is_empty() && !c.starts_with("sshd") && !c.starts_with("/usr/sbin/sshd"))
            .collect();
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn jobs_start_and_grow_over_ssh() {
    let Some(t) = hosts(2) else { return };
    let Some(sshd) = Sshd::start(&t) else { return };
    sshd.await_ready(&t);
    let list = format!("{}:2,{}:2", t.host_addr(0), t.host_addr(1));
    let rsh = sshd.rsh();
    let dir = tmp("ssh-cwd");
    std::fs::create_dir_all(&*dir).unwrap();
    let mut c = t.in_head(&ductile_bin());
    c.args(["run", "--rsh", &rsh, "--timeout", JOB_LIMIT, "--hosts", &list, &ex("hello"), "--env", "OVER_SSH_VAR"]);
    let out = output_within(c.env("OVER_SSH_VAR", "over-ssh").current_dir(&*dir));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    for r in 0..4 {
        let host = &t.hosts()[r / 2];
        let want = format!("rank {r}: OVER_SSH_VAR=over-ssh in {}, network net:[{}]", dir.display(), netns_inode(host));
        assert!(stderr.contains(&want), "no `{want}` in\n{stderr}");
    }
    // A growth: the agent on the first host starts the second one's over ssh.
    let jacobi = ex("jacobi");
    let problem = [jacobi.as_str(), "--points", "200000", "--iters", "80", "--every", "20"];
    let mut c = t.in_head(&ductile_bin());
    c.args(["run", "--rsh", &rsh, "--timeout", JOB_LIMIT, "--hosts", &list, "--nodes", "1", "--policy", "steps:2,1,2"]);
    let out = output_within(c.arg("--").args(problem));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert_eq!(checksum(&stdout), rigid_checksum(&problem), "{stdout}");
    assert!(stderr.lines().filter(|l| l.ends_with(" +1")).count() == 2, "{stderr}");
    assert_eq!(job_processes_left(&t), Vec::<String>::new());
    // Ctrl-C: the agents on the hosts, children of their sshd, see their channels end.
    interrupt_resizes(&t, &rsh, &list);
    assert_eq!(job_processes_left(&t), Vec::<String>::new());
    // A rank that leaves a process in a session of its own: no controller is on its
    // host to end it; its agent must.
    let script = format!("setsid sleep 300 >/dev/null 2>&1 </dev/null & sleep 0.3; exec {}", ex("hello"));
    let mut c = t.in_head(&ductile_bin());
    c.args(["run", "--rsh", &rsh, "--timeout", JOB_LIMIT, "--hosts", &list, "--", "sh", "-c", &script]);
    let out = output_within(&mut c);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(job_processes_left(&t), Vec::<String>::new());
}

#[test]
fn node_worlds_on_other_hosts_end_when_the_launcher_falls_silent() {
    let Some(t) = hosts(2) else { return };
    let list = format!("{}:2,{}:2", t.hosts()[0], t.hosts()[1]);
    let fault = ex("fault");
    // Every rank prints without end.
    let mut c = run_cmd(&t, &["--hosts", &list, "--", &fault, "chatter"]);
    // Agents hear from the launcher every second and give up after 3 s of silence.
    c.env("DUCTILE_TEST_HEARTBEAT_LOSS_MS", "3000");
    let stderr = tmp("silent.stderr");
    let log = std::fs::File::create(&*stderr).unwrap();
    let mut child = common::Running(c.stdout(Stdio::piped()).stderr(log).spawn().unwrap());
    let mut out = std::io::BufReader::new(child.0.stdout.take().unwrap());
    let mut waiting = 0;
    while waiting < 4 {
        let mut line = String::new();
        assert!(std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0, "the job ended early");
        waiting += usize::from(line.contains("waiting"));
    }
    // From here on its stdout is not read (a paused pager): the launcher must still
    // keep its agents going, and they their ranks.
    // Heartbeats keep them going while the launcher runs.
    std::thread::sleep(Duration::from_secs(5));
    let ranks_running = || {
        t.pids()
            .into_iter()
            .filter(|p| std::fs::read_to_string(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.starts_with(&fault)))
            .filter(|&p| common::is_alive(u64::from(p)))
            .count()
    };
    let log = || std::fs::read_to_string(&*stderr).unwrap_or_default();
    assert_eq!(ranks_running(), 4, "{}", log());
    // `ductile status` names each node's host.
    let first = log().lines().next().unwrap_or_default().to_string();
    let job = first.strip_prefix("ductile: job ").and_then(|r| r.split(',').next()).expect("the job's id");
    let status = output_within(&mut common::ductile(&["status", job]));
    let status = text(&status.stdout);
    for (node, host) in t.hosts().iter().enumerate() {
        assert!(status.contains(&format!("node {node} on {host} ")), "{status}");
    }
    // The launcher stops (as if its host had vanished): its agents end their ranks.
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.0.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while ranks_running() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let left = ranks_running();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    // The pager resumes: the launcher can read its agents' channels again, and learns
    // that they ended.
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    assert_eq!(left, 0, "ranks still running 15 s after the launcher stopped: {}", log());
    let status = wait_with_timeout(&mut child.0, Duration::from_secs(30));
    assert_ne!(status.code(), Some(0));
    assert!(log().contains("no word from the controller for 3s"), "{}", log());
    assert_namespaces_empty(&t);
}

#[test]
fn the_job_key_is_in_no_process_log_or_report_on_any_host() {
    let Some(t) = hosts(2) else { return };
    let Some(sshd) = Sshd::start(&t) else { return };
    sshd.await_ready(&t);
    let (hex, leaks) = common::test_key();
    let list = format!("{}:2,{}:2", t.host_addr(0), t.host_addr(1));
    let report = tmp("hosts-key.json");
    let jacobi = ex("jacobi");
    let mut c = t.in_head(&ductile_bin());
    c.args(["run", "--rsh", &sshd.rsh(), "--timeout", JOB_LIMIT, "--hosts", &list, "--nodes", "1"]);
    c.args(["--policy", "steps:2,1", "--report", &report.display().to_string(), "--"]);
    c.args([&jacobi, "--points", "200000", "--iters", "1000", "--every", "300"]);
    c.env("DUCTILE_TEST_JOB_KEY", &hex).env("DUCTILE_LOG", "debug");
    let mut job = common::Running(c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap());
    let launcher = job.0.id();
    let (out, err) = (lines_of(job.0.stdout.take().unwrap()), lines_of(job.0.stderr.take().unwrap()));
    let mut seen = std::collections::BTreeMap::new();
    let start = Instant::now();
    while job.0.try_wait().unwrap().is_none() {
        assert!(start.elapsed() < Duration::from_secs(60), "the job did not end");
        // Every process on the hosts (agents under sshd, their ranks, sshd's sessions),
        // and on the head but the launcher itself (which read the variable).
        for pid in t.pids().into_iter().filter(|&p| p != launcher) {
            // `ductile run ...`: a copy of the launcher, forked and not exec'd yet.
            let copy = |c: &[u8]| {
                let mut args = c.split(|&b| b == 0);
                args.next() == Some(ductile_bin().as_os_str().as_encoded_bytes())
                    && args.next() == Some(b"run".as_slice())
            };
            common::assert_key_not_in(u64::from(pid), &leaks, &copy);
            // The last command line seen: a remote shell's `sh -c` execs the agent.
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let seen_as = seen.entry(pid).or_default();
            if !cmdline.is_empty() {
                *seen_as = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(job.0.wait().unwrap().success());
    assert!(seen.len() >= 4, "only {} processes were seen: {seen:?}", seen.len());
    let text: Vec<String> = out.try_iter().chain(err.try_iter()).collect();
    let text = text.join("\n");
    assert!(text.contains("checksum") && text.contains("for tests only"), "{text}");
    // The agents on the hosts log at debug too (the spawner says when node 1 started).
    assert!(text.contains("DEBUG") && text.contains("node 1 has started"), "{text}");
    leaks("the job's output and logs", &text);
    leaks("the report", &std::fs::read_to_string(&*report).unwrap());
    // The report names each node's agent by its pid on its host, not the ssh client's.
    for n in common::read_report(&report)["nodes"].as_array().unwrap() {
        let pid = u32::try_from(n["agent_pid"].as_u64().unwrap()).unwrap();
        let seen_as = seen.get(&pid).map_or("", String::as_str);
        let agent = format!("{} agent --stdio", ductile_bin().display());
        assert!(seen_as.starts_with(&agent), "node {}: agent pid {pid} was {seen_as:?}", n["node"]);
    }
}

#[test]
fn a_pool_larger_than_the_fan_out_starts_and_ends_promptly() {
    let Some(t) = hosts(1) else { return };
    // 70 "hosts" (more than the 64 remote shells that connect at once) whose remote
    // shell starts the agent where it runs (in the head namespace); their names
    // resolve nowhere, and a resolver that hangs on them must not hold up the job's end.
    let script = tmp("here-rsh.sh");
    common::write_executable(&script, b"#!/bin/sh\nshift\nexec \"$@\"\n");
    let list: Vec<String> = (0..70).map(|i| format!("pool-host-{i}")).collect();
    let started = Instant::now();
    let mut c = t.in_head(&ductile_bin());
    c.args(["run", "--rsh", &script.display().to_string(), "--timeout", JOB_LIMIT, "--hosts", &list.join(",")]);
    let out = output_within(c.arg(ex("ring")));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("ring of 70"), "{stdout}");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
    assert_namespaces_empty(&t);
}

#[test]
fn a_host_lost_to_the_network_is_a_shrink_with_on_failure_shrink() {
    let Some(t) = hosts(3) else { return };
    let Some(sshd) = Sshd::start(&t) else { return };
    sshd.await_ready(&t);
    let list = format!("{}:2,{}:2,{}:2", t.host_addr(0), t.host_addr(1), t.host_addr(2));
    // ssh gives up on a silent host after 2-3 s, and an agent on its launcher after 3 s.
    let rsh = format!("{} -o ServerAliveInterval=1 -o ServerAliveCountMax=2", sshd.rsh());
    let fault = ex("fault");
    let mut c = t.in_head(&ductile_bin());
    c.args(["run", "--rsh", &rsh, "--timeout", JOB_LIMIT, "--hosts", &list, "--on-failure", "shrink", "--"]);
    c.args([fault.as_str(), "recover", "none", "0", "200", "40"]).env("DUCTILE_TEST_HEARTBEAT_LOSS_MS", "3000");
    let mut job = common::Running(c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start the job"));
    let (out, err) = (lines_of(job.0.stdout.take().unwrap()), lines_of(job.0.stderr.take().unwrap()));
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    while !seen.last().is_some_and(|l: &String| l.starts_with("step 5:")) {
        let left = deadline.saturating_duration_since(Instant::now());
        seen.push(
            out.recv_timeout(left)
                .unwrap_or_else(|_| panic!("no step 5: {seen:?} {:?}", err.try_iter().collect::<Vec<_>>())),
        );
    }
    t.cut(2).unwrap();
    let status = wait_with_timeout(&mut job.0, Duration::from_secs(60));
    let rest: Vec<String> = out.try_iter().collect();
    let errs: Vec<String> = err.try_iter().collect();
    assert!(status.success(), "{status:?}\n{rest:?}\n{errs:?}");
    let recovered = rest.iter().find(|l| l.starts_with("recovered at step")).unwrap_or_else(|| panic!("{rest:?}"));
    assert!(recovered.contains("ranks [4, 5] of 6 failed (node 2 was lost"), "{recovered}");
    assert!(rest.iter().any(|l| l == "recover: done with 4 processes, the data whole"), "{rest:?}\n{errs:?}");
    // The lost host's agent ended its ranks when it heard nothing more.
    assert_eq!(job_processes_left(&t), Vec::<String>::new());
}
