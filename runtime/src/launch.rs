//! Child jobs: [`Group::launch`] and [`AsyncGroup::launch`] (paper 002's
//! `MPI_Comm_launch`).
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
//! its path in `DUCTILE_LAUNCHER`), else `ductile` from `PATH`. The children must be
//! ductile programs (they call `ductile::init`), as under `ductile run`.
//!
//! Where DESIGN.md has each member's agent start its member's child on the member's
//! node, here the child job's own launcher starts them, on simulated nodes of its own:
//! with every simulated node on one host the placement is the same, and the child job
//! gets the launcher's guarantees (its own fences, exit codes, timeouts and clean-up)
//! without the agents serving two jobs.
//!
//! The child launcher's report comes back through a `memfd` it inherits
//! (`--report /dev/fd/N`), so nothing is left on disk if the first member dies.

use crate::bootstrap::{TransportSpec, CONTROL_FD_ENV};
use crate::error::{Error, Result};
use crate::group::{AsyncGroup, Group};
use crate::reduce::ReduceOp;
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::io::{Read, Seek};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// The variable naming the launcher binary (set by the agent for every process).
pub const LAUNCHER_ENV: &str = "DUCTILE_LAUNCHER";
/// Exit status of a child job that ran past its timeout (as `ductile run --timeout`).
pub const LAUNCH_TIMEOUT_EXIT: i32 = 124;
/// How long past its timeout the first member waits for the child launcher to end the
/// child job itself (start-up, tear-down, writing its report).
const LAUNCH_MARGIN: Duration = Duration::from_secs(15);
/// Between SIGTERM and SIGKILL of a child launcher that outlived the margin.
const KILL_GRACE: Duration = Duration::from_secs(5);
/// Default timeout of a child job, seconds.
const DEFAULT_LAUNCH_SECS: u64 = 300;
/// Longest timeout of a child job, seconds (as `ductile run --timeout`: 366 days).
pub const MAX_LAUNCH_SECS: u64 = 366 * 24 * 3600;

/// The transport of this process's job, which child jobs use too unless told otherwise.
static TRANSPORT: OnceLock<TransportSpec> = OnceLock::new();
/// Whether this process's job prefixes output lines with ranks; child jobs do too, so
/// that their children's lines can be told apart ("[0] [2] ...": the first member's
/// rank, then the child's).
static TAG_OUTPUT: OnceLock<bool> = OnceLock::new();

/// Records the job's settings that child jobs inherit (once, at `init`).
pub(crate) fn set_job(h: &crate::bootstrap::RankHandoff) {
    let _ = TRANSPORT.set(h.transport.clone());
    let _ = TAG_OUTPUT.set(h.tag_output);
}

/// A child job to start with [`Group::launch`]: a program, its arguments and extra
/// environment, and a time limit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launch {
    program: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    timeout_secs: u64,
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
            timeout_secs: DEFAULT_LAUNCH_SECS,
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

    /// The child job's time limit, rounded up to whole seconds (1 to 366 days): past it
    /// the child job is ended and the status is 124.
    #[must_use]
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout_secs = t.as_secs().saturating_add(u64::from(t.subsec_nanos() > 0));
        self
    }

    /// The child job's transport (default: the parent job's).
    #[must_use]
    pub fn transport(mut self, spec: TransportSpec) -> Self {
        self.transport = Some(spec);
        self
    }

    fn timeout_secs(&self) -> u64 {
        self.timeout_secs
    }

    fn check(&self) -> std::result::Result<(), String> {
        if self.program.is_empty() {
            return Err("the program is empty".into());
        }
        if !(1..=MAX_LAUNCH_SECS).contains(&self.timeout_secs) {
            return Err(format!("the timeout must be 1 to {MAX_LAUNCH_SECS} s, not {} s", self.timeout_secs));
        }
        if let Some((k, _)) = self.env.iter().find(|(k, _)| k.is_empty() || k.contains('=')) {
            return Err(format!("{k:?} is not an environment variable name"));
        }
        let texts = std::iter::once(&self.program).chain(&self.args).chain(self.env.iter().flat_map(|(k, v)| [k, v]));
        if let Some(t) = texts.into_iter().find(|t| t.contains('\0')) {
            return Err(format!("{t:?} holds a NUL byte"));
        }
        Ok(())
    }
}

/// Why a launch failed; every member of the group gets the same.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// Members asked for different child jobs.
    #[error("member {member} of the group asked for a different child job than member 0 ({program})")]
    Differs {
        /// The lowest member that differs from member 0.
        member: u64,
        /// Member 0's program.
        program: String,
    },
    /// The launch makes no sense (an empty program, a timeout out of range, ...).
    #[error("invalid launch: {0}")]
    Invalid(String),
    /// The launcher could not be started, or did not run the child job.
    #[error("{0}")]
    Launcher(String),
}

/// How a child job ended, the same on every member of the launching group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
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
        // The call lasts as long as the child job: it is bounded by the waits of
        // [`AsyncGroup::launch`], each within its own limit, and by their sum.
        let steps = self.as_async().timeout().saturating_mul(2).saturating_add(outcome_wait(what, self.as_async()));
        self.with_timeout(steps).block(self.as_async().launch(what))
    }
}

impl AsyncGroup {
    /// [`Group::launch`] for code that runs on an executor: starts a child job of one
    /// process per member and resolves once it has ended. The group's first member
    /// waits for the child launcher on a thread of the runtime's blocking pool
    /// (`tokio::task::spawn_blocking`), so the executor it runs on is never held up.
    /// Like every operation of the group, it must be polled within a Tokio runtime.
    /// Dropped before it resolves, it ends the child job (within a fraction of a
    /// second, and the launcher's grace period): nothing runs on unwatched.
    ///
    /// # Collective
    /// Every member passes an equal [`Launch`].
    ///
    /// # Errors
    /// As [`Group::launch`].
    pub async fn launch(&self, what: &Launch) -> Result<LaunchStatus> {
        let span = tracing::debug_span!("launch", program = %what.program, members = self.size());
        async {
            let first: Launch = broadcast(self, 0, what).await?;
            let mine = if first == *what { u64::MAX } else { self.rank() as u64 };
            let differs = self.allreduce(&[mine], ReduceOp::Min).await?[0];
            if differs != u64::MAX {
                return Err(LaunchError::Differs { member: differs, program: first.program }.into());
            }
            first.check().map_err(LaunchError::Invalid)?;
            let outcome: std::result::Result<LaunchStatus, LaunchError> = if self.rank() == 0 {
                let (launch, size) = (first.clone(), self.size());
                let abandoned = Abandoned::default();
                let flag = abandoned.0.clone();
                let waited = tokio::task::spawn_blocking(move || run_child(&launcher(), &launch, size, &flag)).await;
                drop(abandoned);
                waited.unwrap_or_else(|e| {
                    Err(LaunchError::Launcher(format!("the launcher's waiting thread failed: {e}")))
                })
            } else {
                Err(LaunchError::Launcher(String::new()))
            };
            let outcome = broadcast(&self.with_timeout(outcome_wait(&first, self)), 0, &outcome).await?;
            tracing::debug!("child job of {} ended: {outcome:?}", first.program);
            Ok(outcome?)
        }
        .instrument(span)
        .await
    }
}

/// How long the other members wait for the first member's word on the child job
/// `what`: as long as the first member can wait for it (the child's timeout, the
/// margin, and a grace period after each of SIGTERM and SIGKILL), plus the group's
/// timeout.
fn outcome_wait(what: &Launch, g: &AsyncGroup) -> Duration {
    let secs = what.timeout_secs().saturating_add(LAUNCH_MARGIN.as_secs()).saturating_add(2 * KILL_GRACE.as_secs());
    Duration::from_secs(secs).saturating_add(g.timeout())
}

/// Set when the launch that waits for a child job is dropped before the job ends, so
/// that the thread watching it ends it (see [`run_child`]).
#[derive(Default)]
struct Abandoned(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for Abandoned {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// How often the thread watching a child job looks whether its launch was abandoned.
const ABANDON_POLL: Duration = Duration::from_millis(100);

/// `root`'s `value`, on every member of `g`.
async fn broadcast<S: Serialize + DeserializeOwned>(g: &AsyncGroup, root: usize, value: &S) -> Result<S> {
    let payload =
        if g.rank() == root { Bytes::from(postcard::to_stdvec(value).map_err(Error::Encode)?) } else { Bytes::new() };
    let b = g.broadcast_bytes(root, payload).await?;
    postcard::from_bytes(&b).map_err(|source| Error::Decode { src: root, source })
}

/// The first member's part: runs the child launcher to its end.
fn run_child(
    launcher: &std::path::Path,
    what: &Launch,
    size: usize,
    abandoned: &std::sync::atomic::AtomicBool,
) -> std::result::Result<LaunchStatus, LaunchError> {
    let who = launcher.display();
    let mut report = ReportFd::new().map_err(|e| LaunchError::Launcher(format!("cannot make its report file: {e}")))?;
    let mut cmd = child_command(launcher, what, size, &report.path());
    let mut child = spawn_tied(&mut cmd, Some(report.raw())).map_err(|e| {
        LaunchError::Launcher(format!(
            "cannot start the launcher {who}: {e} (set {LAUNCHER_ENV} to the ductile binary)"
        ))
    })?;
    let watch = Watch::new(&child);
    let limit = Duration::from_secs(what.timeout_secs().saturating_add(LAUNCH_MARGIN.as_secs()));
    let end = Instant::now() + limit;
    let waited = loop {
        let waited = watch.wait(&mut child, end.min(Instant::now() + ABANDON_POLL));
        if waited.is_some() || Instant::now() >= end {
            break waited;
        }
        if abandoned.load(std::sync::atomic::Ordering::Relaxed) {
            watch.end(&mut child);
            return Err(LaunchError::Launcher("the launch was abandoned before its child job ended; ended it".into()));
        }
    };
    let Some(status) = waited else {
        watch.end(&mut child);
        return Ok(LaunchStatus {
            code: LAUNCH_TIMEOUT_EXIT,
            failure: Some(format!("the child job did not end within {} s; ended it", limit.as_secs())),
        });
    };
    let Some(doc) = report.read().and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok()) else {
        // No report: the launcher refused the job before starting it (a program it
        // cannot find, a bad option), or died.
        return Err(LaunchError::Launcher(match status.map(|s| (s.code(), exit_code(s))) {
            Some((None, code)) => format!("the launcher {who} was killed by signal {}", code - 128),
            Some((Some(code), _)) => format!(
                "the launcher {who} did not run the child job (it exited with {code}; its message is on the \
                 standard error of the group's first member)"
            ),
            None => format!("the launcher {who} ended without a report, and its exit status was taken elsewhere"),
        }));
    };
    // The launcher's own exit status, else (reaped elsewhere: SIGCHLD ignored) the
    // report's copy of it.
    let code = status.map(exit_code).or_else(|| doc["exit_code"].as_i64().and_then(|c| i32::try_from(c).ok()));
    let failure = doc["failure"].as_str().map(|f| cause(f).to_string());
    Ok(LaunchStatus { code: code.unwrap_or(1), failure })
}

/// The child launcher's report: a `memfd` it writes through `/dev/fd/N`, so that no file
/// outlives this process.
struct ReportFd(std::fs::File);

impl ReportFd {
    fn new() -> std::io::Result<Self> {
        // SAFETY: memfd_create with a NUL-terminated name; a valid fd it returns is ours.
        let fd = unsafe { libc::memfd_create(c"ductile-launch-report".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        Ok(Self(std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) })))
    }

    fn raw(&self) -> i32 {
        self.0.as_raw_fd()
    }

    fn path(&self) -> String {
        format!("/dev/fd/{}", self.raw())
    }

    /// What the launcher wrote, if anything.
    fn read(&mut self) -> Option<String> {
        let mut text = String::new();
        self.0.rewind().ok()?;
        self.0.read_to_string(&mut text).ok()?;
        Some(text).filter(|t| !t.is_empty())
    }
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

fn child_command(launcher: &std::path::Path, what: &Launch, size: usize, report: &str) -> Command {
    let n = size.to_string();
    let mut cmd = Command::new(launcher);
    cmd.args(["run", "--quiet", "-n", &n, "--nodes", &n, "--slots", "1"]);
    cmd.args(["--timeout", &what.timeout_secs().to_string(), "--report", report]);
    if TAG_OUTPUT.get() == Some(&true) {
        cmd.arg("--tag-output");
    }
    if let Some(spec) = what.transport.as_ref().or_else(|| TRANSPORT.get()) {
        cmd.args(["--transport", &spec.name]);
        if let Some(p) = &spec.fabric_provider {
            cmd.args(["--fabric-provider", p]);
        }
    }
    cmd.arg("--").arg(&what.program).args(&what.args);
    cmd.envs(what.env.iter().map(|(k, v)| (k, v))).env_remove(CONTROL_FD_ENV).stdin(Stdio::null());
    // Out of the member's process group, which its agent kills outright at the end of
    // the parent job: the child launcher ends with the member (its parent-death
    // signal), through its own clean end of the child job.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    cmd
}

/// Spawns `cmd` so that it gets SIGTERM if this thread ends first (the calling thread
/// waits for it, so that is when this process dies): the child launcher then ends the
/// child job instead of leaving it behind. `keep`: a descriptor it inherits.
fn spawn_tied(cmd: &mut Command, keep: Option<i32>) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (fcntl, prctl, getppid).
    unsafe {
        cmd.pre_exec(move || {
            if let Some(fd) = keep {
                if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
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

/// Watches a child through a pidfd, where the kernel has them: `poll` wakes the moment
/// it ends (a child job can take less than 10 ms), and signals go to it even if
/// another waiter reaped it (SIGCHLD ignored), never to a process that reused its pid.
pub(crate) struct Watch(Option<OwnedFd>);

impl Watch {
    pub(crate) fn new(child: &Child) -> Self {
        let Ok(pid) = libc::pid_t::try_from(child.id()) else { return Self(None) };
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        // SAFETY: a non-negative result is a new descriptor that nothing else owns.
        Self(i32::try_from(fd).ok().filter(|&fd| fd >= 0).map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Waits for the child until `deadline`: `None` if it is still running then, else
    /// its status (`Some(None)` if another waiter took it).
    pub(crate) fn wait(&self, child: &mut Child, deadline: Instant) -> Option<Option<ExitStatus>> {
        loop {
            match child.try_wait() {
                Ok(Some(s)) => return Some(Some(s)),
                Ok(None) => {}
                // ECHILD: reaped already (SIGCHLD ignored), so it has ended.
                Err(_) => return Some(None),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            match &self.0 {
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

    fn signal(&self, child: &mut Child, sig: i32) {
        match &self.0 {
            // SAFETY: pidfd_send_signal on our pidfd, with no siginfo.
            Some(fd) => unsafe {
                libc::syscall(libc::SYS_pidfd_send_signal, fd.as_raw_fd(), sig, std::ptr::null::<()>(), 0);
            },
            // Without a pidfd, only a child not yet reaped: its pid is still its own.
            None => {
                if let (Ok(None), Ok(pid)) = (child.try_wait(), libc::pid_t::try_from(child.id())) {
                    // SAFETY: kill(2) on our own unreaped child.
                    unsafe { libc::kill(pid, sig) };
                }
            }
        }
    }

    /// Ends a child launcher that outlived its limit: SIGTERM (it ends its job), then
    /// SIGKILL after a grace period (its agents and ranks die with it).
    pub(crate) fn end(&self, child: &mut Child) {
        self.signal(child, libc::SIGTERM);
        if self.wait(child, Instant::now() + KILL_GRACE).is_none() {
            self.signal(child, libc::SIGKILL);
            let _ = self.wait(child, Instant::now() + KILL_GRACE);
        }
    }
}

pub(crate) fn exit_code(s: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    s.code().or_else(|| s.signal().map(|sig| 128 + sig)).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// Writes an executable script by a child process: one this process wrote could be
    /// held open for writing, for a moment, by a process another test thread is forking
    /// then, and running it would fail with "text file busy".
    fn write_executable(path: &std::path::Path, body: &str) {
        use std::io::Write;
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "cat > \"$1\" && chmod 700 \"$1\"", "sh"])
            .arg(path)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        sh.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
        assert!(sh.wait().unwrap().success(), "cannot write {}", path.display());
    }

    #[test]
    fn launches_are_checked_before_anything_starts() {
        assert!(Launch::new("x").check().is_ok());
        assert!(Launch::new("").check().is_err());
        assert!(Launch::new("x").timeout(Duration::ZERO).check().is_err());
        assert!(Launch::new("x").timeout(Duration::MAX).check().is_err());
        assert!(Launch::new("x").timeout(Duration::from_secs(MAX_LAUNCH_SECS + 1)).check().is_err());
        assert!(Launch::new("x").timeout(Duration::from_secs(MAX_LAUNCH_SECS)).check().is_ok());
        assert!(Launch::new("x").env("A=B", "c").check().is_err());
        assert!(Launch::new("x").env("", "c").check().is_err());
        assert!(Launch::new("x").arg("a\0b").check().is_err());
        assert!(Launch::new("x").env("K", "v\0").check().is_err());
        assert_eq!(Launch::new("x").timeout(Duration::from_millis(1500)).timeout_secs(), 2);
        assert_eq!(Launch::new("x").timeout(Duration::from_micros(1)).timeout_secs(), 1);
    }

    #[test]
    fn the_child_command_is_one_process_per_member_on_a_node_of_its_own() {
        let what =
            Launch::new("prog").args(["a", "b c"]).env("K", "V").timeout(Duration::from_secs(7)).transport(
                TransportSpec { name: "fabric".into(), fabric_provider: Some("shm".into()), bind_host: None },
            );
        let cmd = child_command(std::path::Path::new("/bin/ductile"), &what, 3, "/dev/fd/9");
        let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        let want = "run --quiet -n 3 --nodes 3 --slots 1 --timeout 7 --report /dev/fd/9 --transport fabric \
                    --fabric-provider shm -- prog a";
        assert_eq!(args[..args.len() - 1].join(" "), want);
        assert_eq!(args.last().map(String::as_str), Some("b c"));
        let envs: Vec<_> = cmd.get_envs().collect();
        assert!(envs.contains(&(std::ffi::OsStr::new("K"), Some(std::ffi::OsStr::new("V")))));
        assert!(envs.contains(&(std::ffi::OsStr::new(CONTROL_FD_ENV), None)));
    }

    #[test]
    fn a_report_written_through_its_fd_path_is_read_back() {
        let mut r = ReportFd::new().unwrap();
        assert_eq!(r.read(), None);
        std::fs::write(r.path(), "{\"exit_code\": 3}").unwrap();
        assert_eq!(r.read().as_deref(), Some("{\"exit_code\": 3}"));
    }

    #[test]
    fn a_child_jobs_failure_is_its_cause() {
        assert_eq!(cause("rank 1 on node 1 exited with code 3; ending the job"), "rank 1 on node 1 exited with code 3");
        assert_eq!(cause("the job ran past --timeout 2s; ending it"), "the job ran past --timeout 2s");
        assert_eq!(cause("no suffix"), "no suffix");
    }

    #[test]
    fn a_launcher_that_cannot_start_is_an_error_naming_it() {
        let go = AtomicBool::new(false);
        let e = run_child(std::path::Path::new("/nonexistent/ductile"), &Launch::new("true"), 1, &go)
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/ductile") && e.contains(LAUNCHER_ENV), "{e}");
        // A launcher that runs but refuses the job writes no report.
        let e = run_child(std::path::Path::new("false"), &Launch::new("true"), 1, &go).unwrap_err().to_string();
        assert!(e.contains("did not run the child job") && e.contains("exited with 1"), "{e}");
        // One killed by a signal says so.
        let dir = std::env::temp_dir().join(format!("ductile-launch-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let killer = dir.join("launcher");
        write_executable(&killer, "#!/bin/sh\nkill -9 $$\n");
        let e = run_child(&killer, &Launch::new("true"), 1, &go).unwrap_err().to_string();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(e.contains("was killed by signal 9"), "{e}");
    }

    #[test]
    fn an_abandoned_launch_ends_its_child_job_at_once() {
        // A launcher that would run for a minute, whose launch is abandoned: it is ended
        // (SIGTERM) long before its timeout, and the launch says why.
        let dir = std::env::temp_dir().join(format!("ductile-launch-abandon-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let slow = dir.join("launcher");
        write_executable(&slow, "#!/bin/sh\nexec sleep 60\n");
        let abandoned = AtomicBool::new(false);
        let started = Instant::now();
        let e = std::thread::scope(|s| {
            let watching =
                s.spawn(|| run_child(&slow, &Launch::new("true").timeout(Duration::from_secs(60)), 1, &abandoned));
            std::thread::sleep(Duration::from_millis(300));
            abandoned.store(true, std::sync::atomic::Ordering::Relaxed);
            watching.join().unwrap().unwrap_err().to_string()
        });
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(e.contains("abandoned"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
    }
}
