//! Child jobs: [`Group::launch`] (paper 002's `MPI_Comm_launch`).
//!
//! Every member of a group calls `launch` with the same [`Launch`]; the group's first
//! member starts the child job with the ductile launcher (`ductile run`, one process
//! per member, one simulated node each, ranks ordered like the group) and waits for it;
//! the others wait for its outcome, which the first member then broadcasts. So every
//! member returns the same [`LaunchStatus`]. The child job is a job of its own (its own
//! key, world and transport connections): a child that crashes or hangs ends only the
//! child job, never the parent.
//!
//! The status is `ductile run`'s: 0 if every child exited 0, else the code of the first
//! child that failed (128 + N for signal N), which the launcher then ends the others
//! for; 124 if the child job ran past its timeout. Paper 002 leaves the choice among
//! several failures open (any one, agreed), and DESIGN.md asked for the lowest rank's
//! code; but once one child fails the launcher terminates the rest, so the lowest
//! failing rank is often a child ended by the launcher (143), not the cause.
//!
//! The launcher is the `ductile` binary that started this process (the agent passes
//! its path in `DUCTILE_LAUNCHER`), else `ductile` from `PATH`.

use crate::bootstrap::{TransportSpec, CONTROL_FD_ENV};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::reduce::ReduceOp;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The variable naming the launcher binary (set by the agent for every process).
pub const LAUNCHER_ENV: &str = "DUCTILE_LAUNCHER";
/// Exit status of a child job that ran past its timeout (as `ductile run --timeout`).
pub const LAUNCH_TIMEOUT_EXIT: i32 = 124;
/// How long past its timeout the first member waits for the child launcher to end the
/// child job itself (start-up, tear-down, writing its report).
const LAUNCH_MARGIN: Duration = Duration::from_secs(15);
/// Between SIGTERM and SIGKILL of a child launcher that outlived the margin.
const KILL_GRACE: Duration = Duration::from_secs(5);
/// Default timeout of a child job.
const DEFAULT_LAUNCH_TIMEOUT: Duration = Duration::from_secs(300);

/// The transport of this process's job, which child jobs use too unless told otherwise.
static TRANSPORT: OnceLock<TransportSpec> = OnceLock::new();
/// Numbers the report files of this process's child jobs.
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// Records the job's transport (once, at `init`).
pub(crate) fn set_job_transport(spec: &TransportSpec) {
    let _ = TRANSPORT.set(spec.clone());
}

/// A child job to start with [`Group::launch`]: a program, its arguments and extra
/// environment, and a time limit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launch {
    program: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    timeout_ms: u64,
    transport: Option<TransportSpec>,
}

impl Launch {
    /// A child job running `program` (a path, or a name looked up in `PATH`), with no
    /// arguments and a timeout of 300 s.
    #[must_use]
    pub fn new(program: impl Into<String>) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            timeout_ms: duration_ms(DEFAULT_LAUNCH_TIMEOUT),
            transport: None,
        }
    }

    /// Adds an argument.
    #[must_use]
    pub fn arg(mut self, a: impl Into<String>) -> Self {
        self.args.push(a.into());
        self
    }

    /// Adds arguments.
    #[must_use]
    pub fn args<I: IntoIterator<Item = S>, S: Into<String>>(mut self, args: I) -> Self {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets a variable in the children's environment (they inherit the rest from the
    /// group's first member).
    #[must_use]
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// The child job's time limit (whole seconds, at least 1; rounded up): past it the
    /// child job is ended and the status is 124.
    #[must_use]
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout_ms = duration_ms(t);
        self
    }

    /// The child job's transport (default: the parent job's).
    #[must_use]
    pub fn transport(mut self, spec: TransportSpec) -> Self {
        self.transport = Some(spec);
        self
    }

    fn timeout_secs(&self) -> u64 {
        self.timeout_ms.div_ceil(1000)
    }

    fn check(&self) -> std::result::Result<(), String> {
        if self.program.is_empty() {
            return Err("the program is empty".into());
        }
        if self.timeout_ms == 0 {
            return Err("the timeout must be at least 1 s".into());
        }
        if let Some((k, _)) = self.env.iter().find(|(k, _)| k.is_empty() || k.contains('=') || k.contains('\0')) {
            return Err(format!("{k:?} is not an environment variable name"));
        }
        Ok(())
    }
}

fn duration_ms(t: Duration) -> u64 {
    u64::try_from(t.as_millis()).unwrap_or(u64::MAX)
}

/// How a child job ended, the same on every member of the launching group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchStatus {
    /// 0 if every child exited 0; else the first failing child's code (128 + N for
    /// signal N), or 124 if the child job ran past its timeout.
    pub code: i32,
    /// Why the child job ended early, as its launcher put it (which child, how).
    pub failure: Option<String>,
}

impl LaunchStatus {
    /// Whether every child exited 0.
    #[must_use]
    pub fn success(&self) -> bool {
        self.code == 0
    }
}

impl Group {
    /// Starts a child job of one process per member and waits for it to end.
    ///
    /// The children form a job of their own, ranked like this group's members (the
    /// child of member `i` is its rank `i`), over the parent's transport unless
    /// [`Launch::transport`] says otherwise; their output comes back through the group's
    /// first member. A child that fails ends only the child job; every member returns
    /// the same status. See the module docs for the status rule.
    ///
    /// # Collective
    /// Every member passes an equal [`Launch`].
    ///
    /// # Errors
    /// Members passed different launches (every member gets the error, naming the
    /// lowest one that differs from the first), the launch is invalid, the launcher
    /// cannot be started, or the group's messages fail. Members that do not get the
    /// outcome within the child's timeout plus a margin time out.
    pub fn launch(&self, what: &Launch) -> Result<LaunchStatus> {
        let mut first = what.clone();
        self.broadcast_value(0, &mut first)?;
        let mine = if first == *what { u64::MAX } else { self.rank() as u64 };
        let differs = self.allreduce(&[mine], ReduceOp::Min)?[0];
        if differs != u64::MAX {
            return Err(Error::Launch(format!(
                "member {differs} of the group asked for a different child job than member 0 ({})",
                first.program
            )));
        }
        if let Err(why) = first.check() {
            return Err(Error::Launch(why));
        }
        let mut outcome: std::result::Result<LaunchStatus, String> =
            if self.rank() == 0 { run_child(&launcher(), &first, self.size()) } else { Err(String::new()) };
        let wait = Duration::from_secs(first.timeout_secs()) + LAUNCH_MARGIN + KILL_GRACE + self.as_async().timeout();
        self.with_timeout(wait).broadcast_value(0, &mut outcome)?;
        outcome.map_err(Error::Launch)
    }
}

/// The first member's part: runs the child launcher to its end.
fn run_child(launcher: &std::path::Path, what: &Launch, size: usize) -> std::result::Result<LaunchStatus, String> {
    let n = LAUNCHES.fetch_add(1, Ordering::Relaxed);
    let report = std::env::temp_dir().join(format!("ductile-launch-{}-{n}.json", std::process::id()));
    let _ = std::fs::remove_file(&report);
    let mut cmd = child_command(launcher, what, size, &report);
    let mut child = spawn_tied(&mut cmd).map_err(|e| {
        format!("cannot start the launcher {}: {e} (set {LAUNCHER_ENV} to the ductile binary)", launcher.display())
    })?;
    let limit = Duration::from_secs(what.timeout_secs()) + LAUNCH_MARGIN;
    let status = match wait_until(&mut child, Instant::now() + limit) {
        Some(s) => s,
        None => {
            end_child(&mut child);
            let _ = std::fs::remove_file(&report);
            return Ok(LaunchStatus {
                code: LAUNCH_TIMEOUT_EXIT,
                failure: Some(format!("the child job did not end within {} s; ended it", limit.as_secs())),
            });
        }
    };
    let written = std::fs::read_to_string(&report).ok();
    let _ = std::fs::remove_file(&report);
    let code = exit_code(status);
    let Some(text) = written else {
        // No report: the launcher refused the job before starting it (a program it
        // cannot find, a bad option); its own message is on the first member's
        // standard error.
        return Err(format!(
            "the launcher {} did not run the child job (it exited with {code}; its message is above)",
            launcher.display()
        ));
    };
    let failure = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["failure"].as_str().map(|f| cause(f).to_string()));
    Ok(LaunchStatus { code, failure })
}

/// A child launcher's reason for ending its job, without what it did about it ("rank 1
/// on node 1 exited with code 3; ending the job").
fn cause(failure: &str) -> &str {
    failure.rsplit_once("; ending").map_or(failure, |(cause, _)| cause)
}

/// The launcher binary: `DUCTILE_LAUNCHER`, else `ductile` from `PATH`.
pub(crate) fn launcher() -> PathBuf {
    std::env::var_os(LAUNCHER_ENV).map_or_else(|| PathBuf::from("ductile"), PathBuf::from)
}

fn child_command(launcher: &std::path::Path, what: &Launch, size: usize, report: &std::path::Path) -> Command {
    let n = size.to_string();
    let mut cmd = Command::new(launcher);
    cmd.args(["run", "-n", &n, "--nodes", &n, "--slots", "1", "--timeout", &what.timeout_secs().to_string()]);
    cmd.arg("--report").arg(report);
    if let Some(spec) = what.transport.as_ref().or_else(|| TRANSPORT.get()) {
        cmd.args(["--transport", &spec.name]);
        if let Some(p) = &spec.fabric_provider {
            cmd.args(["--fabric-provider", p]);
        }
    }
    cmd.arg("--").arg(&what.program).args(&what.args);
    cmd.envs(what.env.iter().map(|(k, v)| (k, v))).env_remove(CONTROL_FD_ENV).stdin(Stdio::null());
    cmd
}

/// Spawns `cmd` so that it gets SIGTERM if this thread ends first (the calling thread
/// waits for it, so that is when this process dies): the child launcher then ends the
/// child job instead of leaving it behind.
fn spawn_tied(cmd: &mut Command) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (prctl, getppid).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before the death signal was armed.
            if u32::try_from(libc::getppid()).ok() != Some(parent) {
                return Err(std::io::Error::other("the launching process exited during the spawn"));
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// Waits for `child` until `deadline`; `None` if it is still running then. Sleeps in
/// `poll` on a pidfd, which wakes the moment the child ends (a child job can take less
/// than 10 ms), or in naps of 2 ms where the kernel has no pidfds.
fn wait_until(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let pid = libc::pid_t::try_from(child.id()).ok()?;
    // SAFETY: pidfd_open on our own unreaped child; a valid fd it returns is ours to own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: `fd` is a new descriptor nothing else owns.
    let pidfd = i32::try_from(fd).ok().filter(|&fd| fd >= 0).map(|fd| unsafe { OwnedFd::from_raw_fd(fd) });
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return Some(s),
            Ok(None) => {}
            // Not ours to wait for any more (cannot happen for a child we spawned).
            Err(_) => return None,
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        match &pidfd {
            Some(fd) => {
                let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                let ms = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
                // SAFETY: one valid pollfd for the duration of the call.
                unsafe { libc::poll(&raw mut p, 1, ms) };
            }
            None => std::thread::sleep(left.min(Duration::from_millis(2))),
        }
    }
}

/// Ends a child launcher that outlived its limit: SIGTERM (it ends its job), then
/// SIGKILL after a grace period (its agents and ranks die with it).
fn end_child(child: &mut Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) on our own child's pid, which we have not reaped yet.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
    if wait_until(child, Instant::now() + KILL_GRACE).is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn exit_code(s: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    s.code().or_else(|| s.signal().map(|sig| 128 + sig)).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_are_checked_before_anything_starts() {
        assert!(Launch::new("x").check().is_ok());
        assert!(Launch::new("").check().is_err());
        assert!(Launch::new("x").timeout(Duration::ZERO).check().is_err());
        assert!(Launch::new("x").env("A=B", "c").check().is_err());
        assert!(Launch::new("x").env("", "c").check().is_err());
        assert_eq!(Launch::new("x").timeout(Duration::from_millis(1500)).timeout_secs(), 2);
    }

    #[test]
    fn the_child_command_is_one_process_per_member_on_a_node_of_its_own() {
        let what = Launch::new("prog")
            .args(["a", "b c"])
            .env("K", "V")
            .timeout(Duration::from_secs(7))
            .transport(TransportSpec { name: "fabric".into(), fabric_provider: Some("shm".into()) });
        let cmd = child_command(std::path::Path::new("/bin/ductile"), &what, 3, std::path::Path::new("/tmp/r.json"));
        let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        let want = "run -n 3 --nodes 3 --slots 1 --timeout 7 --report /tmp/r.json --transport fabric \
                    --fabric-provider shm -- prog a";
        assert_eq!(args[..args.len() - 1].join(" "), want);
        assert_eq!(args.last().map(String::as_str), Some("b c"));
        let envs: Vec<_> = cmd.get_envs().collect();
        assert!(envs.contains(&(std::ffi::OsStr::new("K"), Some(std::ffi::OsStr::new("V")))));
        assert!(envs.contains(&(std::ffi::OsStr::new(CONTROL_FD_ENV), None)));
    }

    #[test]
    fn a_child_jobs_failure_is_its_cause() {
        assert_eq!(cause("rank 1 on node 1 exited with code 3; ending the job"), "rank 1 on node 1 exited with code 3");
        assert_eq!(cause("the job ran past --timeout 2s; ending it"), "the job ran past --timeout 2s");
        assert_eq!(cause("no suffix"), "no suffix");
    }

    #[test]
    fn a_launcher_that_cannot_start_is_an_error_naming_it() {
        let e = run_child(std::path::Path::new("/nonexistent/ductile"), &Launch::new("true"), 1).unwrap_err();
        assert!(e.contains("/nonexistent/ductile") && e.contains(LAUNCHER_ENV), "{e}");
        // A launcher that runs but refuses the job writes no report.
        let e = run_child(std::path::Path::new("false"), &Launch::new("true"), 1).unwrap_err();
        assert!(e.contains("did not run the child job") && e.contains("exited with 1"), "{e}");
    }
}
