//! A program started alone (without `ductile run`) is a job of one rank that can still
//! grow: asked for processes, it starts the launcher, which adopts it as rank 0.

mod common;

use common::{ex, marked, wait_with_timeout, MARK};
use ductile_suite::paths::ductile_bin;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The jacobi example started alone, with the launcher it grows with.
fn jacobi_alone(mark: &str, args: &[&str]) -> Command {
    let mut c = Command::new(ex("jacobi"));
    c.args(["--points", "65536", "--iters", "100", "--every", "10"]).args(args);
    c.env("DUCTILE_LAUNCHER", ductile_bin()).env(MARK, mark).env_remove("DUCTILE_LOG");
    c
}

fn checksum(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().find(|l| l.contains(" checksum ")).unwrap_or_else(|| panic!("no checksum: {stdout}"));
    line.split(" checksum ").nth(1).and_then(|r| r.split_whitespace().next()).unwrap().to_string()
}

/// Waits until no process of the test's job tree is left.
fn assert_all_gone(mark: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !marked(mark).is_empty() {
        assert!(Instant::now() < deadline, "processes left running: {:?}", marked(mark));
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_program_started_alone_grows_when_it_asks_and_keeps_its_data() {
    let mark = format!("{}-grows", std::process::id());
    let rigid = jacobi_alone(&mark, &[]).output().expect("start jacobi");
    assert!(rigid.status.success(), "{}", String::from_utf8_lossy(&rigid.stderr));
    let out = jacobi_alone(&mark, &["--ask", "4"]).output().expect("start jacobi");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("jacobi: iteration 10: 1 -> 4 processes on 4 nodes"), "{stdout}");
    assert!(stdout.contains(" processes 4 "), "{stdout}");
    assert_eq!(checksum(&out), checksum(&rigid), "{stdout}");
    // The launcher it started ran the growth and says so.
    assert!(stderr.contains("grow    application   1->4"), "{stderr}");
    assert_all_gone(&mark);
}

#[test]
fn a_program_started_alone_that_cannot_start_the_launcher_fails_its_checkpoint_saying_why() {
    let mark = format!("{}-no-launcher", std::process::id());
    let out = jacobi_alone(&mark, &["--ask", "2"]).env("DUCTILE_LAUNCHER", "/nonexistent/ductile").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("a process started alone cannot grow: the launcher /nonexistent/ductile: No such file"),
        "{stderr}"
    );
    assert_all_gone(&mark);
}

#[test]
fn killing_a_grown_program_started_alone_ends_the_processes_it_grew() {
    let mark = format!("{}-killed", std::process::id());
    // Iterates until 5 changes have happened, which never comes: it runs until killed.
    let mut child = jacobi_alone(&mark, &["--ask", "3", "--until-changes", "5"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start jacobi");
    // The program, its launcher, 3 agents and 2 new ranks.
    let deadline = Instant::now() + Duration::from_secs(30);
    while marked(&mark).len() < 7 {
        assert!(Instant::now() < deadline, "the job did not grow: {:?}", marked(&mark));
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().unwrap();
    let status = wait_with_timeout(&mut child, Duration::from_secs(10));
    assert_eq!(status.code(), None, "killed by a signal");
    assert_all_gone(&mark);
}
