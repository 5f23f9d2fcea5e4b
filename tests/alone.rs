//! A program started alone (without `ductile run`) is a job of one rank that can still
//! grow: asked for processes, it starts the launcher, which adopts it as rank 0.

mod common;

use common::{ex, lines_of, marked, tmp, wait_with_timeout, MARK};
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
    // Output to files, not pipes: a pipe's reader would wait for every process that
    // inherited it, where the program's own exit must come after its job has ended.
    let (out_file, err_file) = (tmp("grows.out"), tmp("grows.err"));
    let status = jacobi_alone(&mark, &["--ask", "4"])
        .stdout(std::fs::File::create(&out_file).unwrap())
        .stderr(std::fs::File::create(&err_file).unwrap())
        .status()
        .expect("start jacobi");
    let left = marked(&mark);
    let (stdout, stderr) = (std::fs::read_to_string(&out_file).unwrap(), std::fs::read_to_string(&err_file).unwrap());
    assert_eq!(status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("jacobi: iteration 10: 1 -> 4 processes on 4 nodes"), "{stdout}");
    assert!(stdout.contains(" processes 4 "), "{stdout}");
    let grown = Output { status, stdout: stdout.clone().into_bytes(), stderr: Vec::new() };
    assert_eq!(checksum(&grown), checksum(&rigid), "{stdout}");
    // The launcher it started ran the growth and said so before the program ended:
    // `finalize` waits for the job to end, so nothing of it is left now.
    assert!(stderr.contains("grow    application   1->4"), "{stderr}");
    assert_eq!(left, Vec::<u64>::new(), "processes of the job outlived the program");
}

#[test]
fn a_program_started_alone_that_cannot_start_the_launcher_goes_on_alone_saying_why() {
    let mark = format!("{}-no-launcher", std::process::id());
    let rigid = jacobi_alone(&mark, &[]).output().expect("start jacobi");
    let out = jacobi_alone(&mark, &["--ask", "2"]).env("DUCTILE_LAUNCHER", "/nonexistent/ductile").output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // Refused, as a resource manager may refuse: the program goes on on its own.
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(
        stderr.contains(
            "a process started alone cannot grow: cannot start the launcher /nonexistent/ductile: No such file"
        ) && stderr.contains("DUCTILE_LAUNCHER")
            && stderr.contains("the process goes on alone"),
        "{stderr}"
    );
    assert!(stdout.contains(" processes 1 "), "{stdout}");
    assert_eq!(checksum(&out), checksum(&rigid));
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
    // Killed once the growth is complete: the program, its launcher, 3 agents and 2
    // new ranks are running.
    let out = lines_of(child.stdout.take().unwrap());
    let grown = std::iter::from_fn(|| out.recv_timeout(Duration::from_secs(30)).ok()).any(|l| l.contains("1 -> 3"));
    if !grown {
        let _ = child.kill();
        panic!("the job did not grow");
    }
    assert_eq!(marked(&mark).len(), 7, "{:?}", marked(&mark));
    child.kill().unwrap();
    let status = wait_with_timeout(&mut child, Duration::from_secs(10));
    assert_eq!(status.code(), None, "killed by a signal");
    assert_all_gone(&mark);
}

#[test]
fn ductile_resize_drives_a_program_started_alone_once_it_has_grown() {
    let mark = format!("{}-resized", std::process::id());
    // Asks for 2 processes at iteration 10, then iterates until 3 changes have
    // happened: the 2 more come from outside.
    let mut child = jacobi_alone(&mark, &["--ask", "2", "--until-changes", "3"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start jacobi");
    let (out, err) = (lines_of(child.stdout.take().unwrap()), lines_of(child.stderr.take().unwrap()));
    let mut stdout = Vec::new();
    let mut await_line = |want: &str| loop {
        match out.recv_timeout(Duration::from_secs(30)) {
            Ok(l) => {
                let found = l.contains(want);
                stdout.push(l);
                if found {
                    return true;
                }
            }
            Err(_) => return false,
        }
    };
    // The launcher it started says its job's id first; the program has grown once it
    // says so.
    let first = err.recv_timeout(Duration::from_secs(30)).unwrap_or_default();
    let job = first.strip_prefix("ductile: job ").and_then(|r| r.split(',').next()).map(str::to_string);
    let (Some(job), true) = (job, await_line("1 -> 2 processes")) else {
        let _ = child.kill();
        panic!("the program did not grow: {first} {stdout:?}");
    };
    let resize = |n: &str| {
        let out = Command::new(ductile_bin()).args(["resize", &job, "--procs", n, "--wait", "60"]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    let (grew, text) = resize("4");
    let (shrank, text2) = resize("1");
    let ended = await_line("checksum");
    let status = wait_with_timeout(&mut child, Duration::from_secs(30));
    // Everything that wrote it has ended: read it to its end.
    let stderr: Vec<String> = std::iter::from_fn(|| err.recv_timeout(Duration::from_secs(10)).ok()).collect();
    assert!(grew && text.contains("2 -> 4 processes"), "{text}");
    assert!(shrank && text2.contains("4 -> 1 processes"), "{text2}");
    assert!(ended && stdout.last().is_some_and(|l| l.contains(" processes 1 ")), "{stdout:?}");
    assert_eq!(status.code(), Some(0), "{stdout:?} {stderr:?}");
    let triggers: Vec<&str> = ["grow    application", "grow    resize", "shrink  resize"]
        .into_iter()
        .filter(|t| stderr.iter().any(|l| l.contains(t)))
        .collect();
    assert_eq!(triggers.len(), 3, "{stderr:?}");
    assert_all_gone(&mark);
}
