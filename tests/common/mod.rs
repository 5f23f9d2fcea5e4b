//! Helpers shared by the multi-process tests.

#![allow(dead_code)]

use ductile_suite::paths::{ductile_bin, example};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub fn ductile(args: &[&str]) -> Command {
    let bin = ductile_bin();
    assert!(
        bin.exists(),
        "{} is missing: build the workspace first (cargo build --workspace --examples)",
        bin.display()
    );
    let mut c = Command::new(bin);
    c.args(args).env_remove("DUCTILE_LOG");
    c
}

pub fn run(args: &[&str]) -> Output {
    ductile(args).output().expect("start ductile")
}

/// Writes an executable file at `path`, by a child process: a file this process wrote
/// itself could be held open for writing, for a moment, by a process another test
/// thread is forking then, and running it would fail with "text file busy" (ETXTBSY).
pub fn write_executable(path: &std::path::Path, body: &[u8]) {
    use std::io::Write;
    let mut sh = Command::new("sh")
        .args(["-c", "cat > \"$1\" && chmod 755 \"$1\"", "sh"])
        .arg(path)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("start sh");
    sh.stdin.take().expect("stdin").write_all(body).expect("write the file");
    assert!(sh.wait().expect("wait for sh").success(), "cannot write {}", path.display());
}

/// Copies the executable `from` to `to` as [`write_executable`] writes one.
pub fn copy_executable(from: &std::path::Path, to: &std::path::Path) {
    let ok = Command::new("cp").arg(from).arg(to).status().expect("start cp").success();
    assert!(ok, "cannot copy {} to {}", from.display(), to.display());
}

pub fn ex(name: &str) -> String {
    let p = example(name);
    assert!(p.exists(), "{} is missing: build the examples first", p.display());
    p.display().to_string()
}

/// A scratch path of this test process under the temporary directory (a report, a
/// marker, a directory): removed, whatever it is then, when the guard is dropped, so a
/// test leaves none behind, even when it fails.
pub struct Scratch(std::path::PathBuf);

impl std::ops::Deref for Scratch {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for Scratch {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.0.is_dir() {
            let _ = std::fs::remove_dir_all(&self.0);
        } else {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

pub fn tmp(name: &str) -> Scratch {
    Scratch(std::env::temp_dir().join(format!("ductile-test-{}-{name}", std::process::id())))
}

/// Whether `pid` is a running process (a zombie waiting to be reaped counts as gone).
pub fn is_alive(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
        .unwrap_or(false)
}

/// The parent pid of `pid`, if it exists.
fn parent_of(pid: u64) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After "pid (comm) ": state, then ppid.
    stat.rsplit(')').next()?.split_whitespace().nth(1)?.parse().ok()
}

/// Every running descendant of `root`.
pub fn descendants(root: u64) -> Vec<u64> {
    let pids: Vec<u64> = std::fs::read_dir("/proc")
        .map(|d| d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default();
    let parents: Vec<(u64, u64)> = pids.iter().filter_map(|&p| Some((p, parent_of(p)?))).collect();
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for &(c, pp) in &parents {
            if pp == p && is_alive(c) {
                out.push(c);
                frontier.push(c);
            }
        }
    }
    out.sort_unstable();
    out
}

/// Every pid (agents and ranks) named in a report.
pub fn report_pids(report: &serde_json::Value) -> Vec<u64> {
    let mut pids = Vec::new();
    for n in report["nodes"].as_array().expect("nodes in the report") {
        pids.push(n["agent_pid"].as_u64().unwrap());
        pids.extend(n["pids"].as_array().unwrap().iter().map(|p| p.as_u64().unwrap()));
    }
    pids
}

/// Reads a JSON report.
pub fn read_report(report: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(report).expect("report written");
    serde_json::from_str(&text).expect("report is JSON")
}

/// Every pid in a report is gone, and none left a libfabric shm region in `/dev/shm`
/// (`<pid>:<n>:<n>`).
pub fn assert_no_survivors(report: &std::path::Path) {
    let pids = report_pids(&read_report(report));
    assert!(!pids.is_empty());
    let alive: Vec<u64> = pids.iter().copied().filter(|&p| is_alive(p)).collect();
    assert!(alive.is_empty(), "processes of the job still running: {alive:?}");
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| d.flatten().filter_map(|e| e.file_name().into_string().ok()).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter(|n| n.split_once(':').and_then(|(p, _)| p.parse::<u64>().ok()).is_some_and(|p| pids.contains(&p)))
        .collect();
    assert!(left.is_empty(), "shared-memory regions of the job left in /dev/shm: {left:?}");
}

/// A running `ductile run` that is killed (SIGKILL to its pid, then reaped) if the test
/// panics before it ended; the launcher's lifeline then ends its agents and ranks.
pub struct Running(pub std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

pub fn wait_with_timeout(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("ductile run did not end within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Variable every process of a test's job tree inherits, so that the test can find
/// them (child jobs' processes, and the launcher of a process started alone, are in no
/// report the test reads).
pub const MARK: &str = "DUCTILE_TEST_LAUNCH_MARK";

/// Pids of running processes whose environment holds `MARK=mark`.
pub fn marked(mark: &str) -> Vec<u64> {
    let needle = format!("{MARK}={mark}");
    let pids: Vec<u64> = std::fs::read_dir("/proc")
        .map(|d| d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default();
    pids.into_iter()
        .filter(|p| is_alive(*p))
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()))
        })
        .collect()
}

/// Waits (at most 30 s) until at least `n` processes carry `mark`; panics naming them
/// otherwise.
pub fn await_marked(mark: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while marked(mark).len() < n {
        assert!(Instant::now() < deadline, "{n} processes did not come up: {:?}", marked(mark));
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The lines of `r`, read by a thread of their own, as they come.
pub fn lines_of(r: impl std::io::Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(r).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// Standard base64 of `bytes`, with and without its padding.
pub fn base64(bytes: &[u8]) -> [String; 2] {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for c in bytes.chunks(3) {
        let n = c.iter().enumerate().fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for k in 0..=c.len() {
            s.push(ABC[(n >> (18 - 6 * k) & 63) as usize] as char);
        }
    }
    let bare = s.clone();
    while !s.len().is_multiple_of(4) {
        s.push('=');
    }
    [s, bare]
}

/// A job key the tests know (as `DUCTILE_TEST_JOB_KEY` takes it, in hex), and a check
/// that fails the test when a text holds it as hex, base64 or a byte list.
pub fn test_key() -> (String, impl Fn(&str, &str)) {
    let key: Vec<u8> = (0..32u8).map(|i| i.wrapping_mul(37).wrapping_add(11)).collect();
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let [padded, bare] = base64(&key);
    let forms = [hex.clone(), hex.to_uppercase(), padded, bare, format!("{key:?}")];
    let leaks = move |what: &str, text: &str| {
        let found: Vec<&String> = forms.iter().filter(|f| text.contains(f.as_str())).collect();
        assert!(found.is_empty(), "the job key is in {what}: {found:?}");
    };
    (hex, leaks)
}

/// Fails the test if process `pid`'s command line or environment holds the test key
/// (checked by `leaks`, from [`test_key`]) or its variable. A process whose command
/// line `copy` calls the launcher's is skipped: a child it forked and has not exec'd
/// yet is a copy of it, environment and all.
pub fn assert_key_not_in(pid: u64, leaks: &dyn Fn(&str, &str), copy: &dyn Fn(&[u8]) -> bool) {
    if std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| copy(&c)) {
        return;
    }
    for file in ["cmdline", "environ"] {
        let Ok(bytes) = std::fs::read(format!("/proc/{pid}/{file}")) else { continue };
        let text = String::from_utf8_lossy(&bytes).replace('\0', " ");
        leaks(&format!("the {file} of process {pid}"), &text);
        assert!(!text.contains("DUCTILE_TEST_JOB_KEY"), "process {pid} has the test key's variable");
    }
}

pub mod netns;

/// The CPUs this process may run on: as the kernel lists them (`0-1`) and one by one.
pub fn own_cpus() -> (String, Vec<u32>) {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).expect("Cpus_allowed_list");
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).expect("sched_getaffinity");
    let cpus = (0..nix::sched::CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false));
    (list.trim().to_string(), cpus.map(|c| u32::try_from(c).expect("a CPU number")).collect())
}

/// What `ductile run --report-bindings` said of each rank: (endpoint id, node, the CPUs
/// it was bound to as listed, or None for "not bound"), in the order printed.
pub fn reported_bindings(stderr: &str) -> Vec<(u32, u32, Option<String>)> {
    stderr
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("ductile: rank ")?;
            let (id, rest) = rest.split_once(" (node ")?;
            let (node, rest) = rest.split_once(", pid ")?;
            let (_, what) = rest.split_once("): ")?;
            let cpus = match what {
                "not bound" => None,
                w => Some(w.strip_prefix("bound to CPUs ")?.split_once(" (one ")?.0.to_string()),
            };
            Some((id.parse().ok()?, node.parse().ok()?, cpus))
        })
        .collect()
}
