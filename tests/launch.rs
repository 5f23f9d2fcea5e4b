//! Child jobs (`Group::launch`) through `ductile run`, with the ensemble example: one
//! agreed status per launch, retries, crashes and hangs that end only the child job,
//! refused launches, and nothing left behind when the parent job is ended mid-launch.

mod common;

use common::{assert_no_survivors, await_marked, ductile, ex, marked, tmp, wait_with_timeout, MARK};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

/// Runs the ensemble example in a job of `procs` processes on 2 nodes; checks that no
/// process of the job or of its child jobs is left.
fn ensemble(name: &str, procs: u32, args: &[&str], env: &[(&str, &str)]) -> Output {
    let report = tmp(&format!("{name}.json"));
    let prog = ex("ensemble");
    let n = procs.to_string();
    let mut all = vec!["run", "--timeout", "120", "--report", report.to_str().unwrap(), "-n", &n, "--nodes", "2"];
    all.extend(["--", prog.as_str()]);
    all.extend(args);
    let mark = format!("{}-{name}", std::process::id());
    let out = ductile(&all).env(MARK, &mark).envs(env.iter().copied()).output().expect("start ductile");
    assert_no_survivors(&report);
    assert_eq!(marked(&mark), Vec::<u64>::new(), "{name}: processes of child jobs left running");
    out
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn every_member_gets_the_child_jobs_status_and_failed_tasks_are_retried() {
    let out = ensemble("retry", 4, &["--tasks", "2", "--fail-attempts", "1"], &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    for task in 0..2 {
        // The child job's last rank (3, on its node 3) exits with 3 in the first attempt.
        let failed = format!("ensemble: job: task {task} attempt 0: status 3 (rank 3 on node 3 exited with code 3)\n");
        assert!(stdout.contains(&failed), "{stdout}");
        assert!(stdout.contains(&format!("child job of task {task}, attempt 1: 4 processes, ranks sum to 6")));
        assert!(stdout.contains(&format!("ensemble: job: task {task} attempt 1: status 0\n")), "{stdout}");
    }
    assert!(stdout.contains("ensemble: job: 2 of 2 tasks succeeded"), "{stdout}");
    // Child jobs run quietly: only the parent job's id and socket are printed.
    assert_eq!(stderr.matches("control socket").count(), 1, "{stderr}");
    // Their report files were memfds: nothing named after a launch is left on disk.
    let left: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("ductile-launch-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn async_launches_agree_and_retry_as_blocking_ones_do() {
    // AsyncGroup::launch run on the session's runtime: the same statuses.
    let out = ensemble("async", 3, &["--tasks", "1", "--fail-attempts", "1", "--async"], &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    let failed = "ensemble: job: task 0 attempt 0: status 3 (rank 2 on node 2 exited with code 3)\n";
    assert!(stdout.contains(failed), "{stdout}");
    assert!(stdout.contains("child job of task 0, attempt 1: 3 processes, ranks sum to 3"), "{stdout}");
    assert!(stdout.contains("ensemble: job: 1 of 1 tasks succeeded"), "{stdout}");
}

#[test]
fn a_task_that_fails_every_try_is_reported_and_the_parent_goes_on() {
    let out = ensemble("exhausted", 2, &["--tasks", "1", "--tries", "2", "--fail-attempts", "5"], &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(3), "{stdout}{stderr}");
    assert!(stdout.contains("task 0 attempt 1: status 3 (rank 1 on node 1 exited with code 3)"), "{stdout}");
    assert!(stdout.contains("ensemble: job: 0 of 1 tasks succeeded"), "{stdout}");
}

#[test]
fn a_crashing_or_hanging_child_ends_only_its_child_job() {
    let out = ensemble("crash", 2, &["--tasks", "1", "--fail-attempts", "1", "--fail-how", "crash"], &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("task 0 attempt 0: status 134 (rank 1 on node 1 was killed by signal 6)"), "{stdout}");
    assert!(stdout.contains("task 0 attempt 1: status 0"), "{stdout}");

    let started = Instant::now();
    let args = ["--tasks", "1", "--fail-attempts", "1", "--fail-how", "hang", "--timeout", "2"];
    let out = ensemble("hang", 2, &args, &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("task 0 attempt 0: status 124 (the job ran past --timeout 2s)"), "{stdout}");
    assert!(stdout.contains("task 0 attempt 1: status 0"), "{stdout}");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
}

#[test]
fn groups_launch_their_own_child_jobs_side_by_side() {
    let out = ensemble("per-node", 4, &["--tasks", "2", "--per-node", "--fail-attempts", "1"], &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    for node in 0..2 {
        assert!(stdout.contains(&format!("ensemble: node {node}: task 1 attempt 0: status 3 (rank 1 on node 1")));
        assert!(stdout.contains(&format!("ensemble: node {node}: 2 of 2 tasks succeeded")), "{stdout}");
    }
    assert_eq!(stdout.matches("child job of task 1, attempt 1: 2 processes, ranks sum to 1").count(), 2);
}

#[test]
fn launches_that_cannot_be_made_are_refused_on_every_member() {
    let out = ensemble("mismatch", 4, &["--tasks", "1", "--mismatch"], &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(4), "{stdout}{stderr}");
    for rank in 0..4 {
        let refused = format!("ensemble: rank {rank}: launch refused: launch failed: member 1 of the group asked for");
        assert!(stdout.contains(&refused), "{stdout}");
    }
    assert!(!stdout.contains("child job of"), "{stdout}");

    let out = ensemble("no-launcher", 2, &["--tasks", "1"], &[("DUCTILE_LAUNCHER", "/nonexistent/ductile")]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(4), "{stdout}{stderr}");
    for rank in 0..2 {
        let refused = format!(
            "ensemble: rank {rank}: launch refused: launch failed: cannot start the launcher /nonexistent/ductile"
        );
        assert!(stdout.contains(&refused), "{stdout}");
    }
}

#[test]
fn ending_the_parent_job_mid_launch_ends_its_child_jobs() {
    let report = tmp("ended.json");
    let prog = ex("ensemble");
    let args = ["run", "--report", report.to_str().unwrap(), "-n", "2", "--nodes", "2", "--", prog.as_str()];
    let mark = format!("{}-ended", std::process::id());
    let mut child = ductile(&args)
        .args(["--tasks", "1", "--fail-attempts", "1", "--fail-how", "hang", "--timeout", "100"])
        .env(MARK, &mark)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start ductile");
    // The parent's 2 ranks and agents, the child launcher, its 2 agents and 2 ranks.
    await_marked(&mark, 10);
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = wait_with_timeout(&mut child, Duration::from_secs(30));
    assert_eq!(status.code(), Some(143));
    assert_no_survivors(&report);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !marked(&mark).is_empty() {
        assert!(Instant::now() < deadline, "processes of the child job left running: {:?}", marked(&mark));
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_parent_started_alone_that_is_killed_mid_launch_takes_its_child_job_with_it() {
    // Started without `ductile run`: nothing but the child launcher's parent-death
    // signal can end the child job when the parent dies.
    let mark = format!("{}-alone-killed", std::process::id());
    let mut parent = std::process::Command::new(ex("ensemble"))
        .args(["--tasks", "1", "--fail-attempts", "1", "--fail-how", "hang", "--timeout", "100"])
        .env("DUCTILE_LAUNCHER", ductile_suite::paths::ductile_bin())
        .env(MARK, &mark)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start ensemble");
    // The parent, the child launcher, its agent and its rank.
    await_marked(&mark, 4);
    parent.kill().unwrap();
    let _ = wait_with_timeout(&mut parent, Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(15);
    while !marked(&mark).is_empty() {
        assert!(Instant::now() < deadline, "processes of the child job left running: {:?}", marked(&mark));
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn child_jobs_of_a_job_that_tags_its_output_tag_theirs_too() {
    let report = tmp("tagged.json");
    let prog = ex("ensemble");
    let args = ["run", "--tag-output", "--report", report.to_str().unwrap(), "-n", "2", "--nodes", "2", "--"];
    let out = ductile(&args).args([prog.as_str(), "--tasks", "1"]).output().expect("start ductile");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    // The first member's rank, then the child's.
    assert!(stdout.contains("[0] [0] child job of task 0, attempt 0: 2 processes"), "{stdout}");
    assert!(stdout.contains("[0] ensemble: job: task 0 attempt 0: status 0"), "{stdout}");
    assert_no_survivors(&report);
}
