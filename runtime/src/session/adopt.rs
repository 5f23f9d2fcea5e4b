//! A process started alone can grow: at its first request for more processes
//! (`Session::request_procs`, then a checkpoint), it starts the launcher
//! (`ductile run --adopt`), whose first node's agent adopts it as rank 0 of a new job
//! instead of starting a process. From there on it is a launched rank like any other:
//! the growth starts new node worlds running the same program, registered data moves
//! to them, and the launcher ends the job's other processes when it ends.
//!
//! The agent reaches the process through a Unix socket the process creates in the
//! user's private directory (mode 0700, as the launcher's control sockets) under a
//! random name, accepted once and only from a child of the launcher it started, of the
//! same user. The process then binds an endpoint of the new job (its own key and
//! identity) in place of its standalone one. Its `finalize` waits for the launcher, so
//! the job has ended when the process has; failing to start the launcher is a refusal,
//! and the process goes on alone.

use super::Session;
use crate::bootstrap::{self, FromRank, Membership, RankHandoff, ToRank, HANDOFF_VERSION};
use crate::error::{Error, Result};
use crate::launch;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Simulated nodes the launcher of a process started alone may use (one process each).
pub const ADOPTED_POOL: u32 = 64;
/// How long the process waits for the launcher's agent to reach it.
const ADOPT_WAIT: Duration = Duration::from_secs(60);

impl Session {
    /// Starts the launcher and becomes rank 0 of the job it runs. Called by a process
    /// started alone at a checkpoint that asks for processes.
    pub(super) fn adopt(&mut self) -> Result<()> {
        let fail = |why: String| Error::Reconfigure(format!("a process started alone cannot grow: {why}"));
        let dir = bootstrap::socket_dir();
        bootstrap::private_dir(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
        let mut nonce = [0u8; 8];
        getrandom::fill(&mut nonce).map_err(|e| fail(format!("random source: {e}")))?;
        let pid = std::process::id();
        let path = dir.join(format!("adopt-{pid}-{:016x}.sock", u64::from_le_bytes(nonce)));
        let listener = UnixListener::bind(&path).map_err(|e| fail(format!("{}: {e}", path.display())))?;
        let launcher = launch::launcher();
        let exe = std::env::current_exe().map_err(|e| fail(format!("this program's path: {e}")))?;
        let mut cmd = Command::new(&launcher);
        cmd.args(["run", "-n", "1", "--slots", "1", "--max-nodes", &ADOPTED_POOL.to_string()]);
        cmd.arg("--adopt").arg(&path).args(["--adopt-pid", &pid.to_string(), "--"]);
        cmd.arg(&exe).args(std::env::args_os().skip(1)).env_remove(bootstrap::CONTROL_FD_ENV).stdin(Stdio::null());
        // A process group of its own: the terminal's Ctrl-C, or a hang-up this process
        // ignores, is this process's to handle; the launcher ends the job when this
        // process ends (its agent watches it), not before.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let spawned = cmd.spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                let hint = format!("(set {} to the ductile binary)", launch::LAUNCHER_ENV);
                return Err(fail(format!("cannot start the launcher {}: {e} {hint}", launcher.display())));
            }
        };
        let watch = launch::Watch::new(&child);
        let accepted = accept(&listener, &mut child, &watch);
        let _ = std::fs::remove_file(&path);
        let joined = accepted
            .map_err(|why| fail(format!("the launcher {}: {why}", launcher.display())))
            .and_then(|control| self.join_adopting(control).map_err(|e| fail(e.to_string())));
        if let Err(e) = joined {
            watch.end(&mut child);
            return Err(e);
        }
        self.launcher = Some(child);
        Ok(())
    }

    /// Takes the agent's handoff on `control` and switches to the new job's endpoint.
    fn join_adopting(&mut self, mut control: UnixStream) -> Result<()> {
        let err = |e: bootstrap::ControlError| Error::Bootstrap(format!("control channel to the agent: {e}"));
        control.set_read_timeout(Some(ADOPT_WAIT)).map_err(|e| Error::Bootstrap(e.to_string()))?;
        let h: RankHandoff = match bootstrap::read_msg::<ToRank>(&mut control).map_err(err)? {
            ToRank::Handoff(h) if h.version == HANDOFF_VERSION => h,
            ToRank::Handoff(h) => {
                return Err(Error::Bootstrap(format!(
                    "handoff version {} (this build speaks {HANDOFF_VERSION})",
                    h.version
                )))
            }
            other => return Err(Error::Bootstrap(format!("expected the agent's handoff, got {other:?}"))),
        };
        let rt = self.rt.as_ref().ok_or_else(|| Error::Invalid("session is closed".into()))?;
        crate::launch::set_job(&h);
        let endpoint = super::bind(rt, &h)?;
        bootstrap::write_msg(&mut control, &FromRank::Ready { addr: endpoint.transport().local_addr() })
            .map_err(err)?;
        let m: Membership = match bootstrap::read_msg::<ToRank>(&mut control).map_err(err)? {
            ToRank::Membership(m) => m,
            other => return Err(Error::Bootstrap(format!("expected the job's membership, got {other:?}"))),
        };
        endpoint.transport().set_peers(&m.addrs)?;
        let timeout = Duration::from_millis(h.timeout_ms.max(1));
        control.set_read_timeout(Some(timeout)).map_err(|e| Error::Bootstrap(e.to_string()))?;
        self.world = Self::world_of(rt, self.spin, &endpoint, &m, timeout, &self.memberships)?;
        self.info = crate::JobInfo {
            job: h.job,
            node: h.node,
            nodes: super::node_count(&m),
            launched: true,
            transport: h.transport.name.clone(),
            id: h.id,
        };
        let old = std::mem::replace(&mut self.endpoint, endpoint);
        drop(old);
        self.membership = m;
        self.watcher = Some(super::control::Watcher::start(&control, self.endpoint.mailbox().clone())?);
        self.recover = h.recover;
        self.control = Some(control);
        self.timeout = timeout;
        self.method = h.redistribution;
        self.background = h.background;
        Ok(())
    }
}

/// Waits for the agent's connection (from a process of this user), or for the
/// launcher to fail first.
fn accept(
    listener: &UnixListener,
    launcher: &mut std::process::Child,
    watch: &launch::Watch,
) -> std::result::Result<UnixStream, String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + ADOPT_WAIT;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                // Only the launcher's own agent (its child, of this user) is taken.
                if !peer_is_child_of(&s, launcher.id()) {
                    continue;
                }
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e.to_string()),
        }
        // A pidfd sees it end even if this process ignores SIGCHLD.
        if let Some(status) = watch.wait(launcher, Instant::now()) {
            let how = status.map_or_else(|| "ended".to_string(), |s| format!("exited ({s})"));
            return Err(format!("{how} before it started the job"));
        }
        if Instant::now() >= deadline {
            return Err(format!("its agent did not connect within {} s", ADOPT_WAIT.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Waits (at most `bound` past the process's own part) for the launcher of a process
/// that grew to end the job, and says how the job ended: the processes it grew may
/// have failed after this one finalized.
pub(super) fn await_launcher(mut launcher: std::process::Child, bound: Duration) -> Result<()> {
    let watch = launch::Watch::new(&launcher);
    match watch.wait(&mut launcher, Instant::now() + bound + ADOPT_WAIT) {
        Some(Some(s)) if s.success() => Ok(()),
        // Reaped by another waiter (SIGCHLD ignored): its code is not known here.
        Some(None) => Ok(()),
        Some(Some(s)) => Err(Error::Reconfigure(format!(
            "the job this process grew into ended with code {} (the launcher said why above)",
            launch::exit_code(s)
        ))),
        None => {
            watch.end(&mut launcher);
            Err(Error::Reconfigure("the launcher of the job this process grew into did not end; ended it".into()))
        }
    }
}

/// Whether the peer of `s` runs as this process's user and is a child of `parent`.
fn peer_is_child_of(s: &UnixStream, parent: u32) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which we own.
    let cred = unsafe {
        let mut cred: libc::ucred = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        let rc = libc::getsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&raw mut cred).cast(), &mut len);
        (rc == 0 && cred.uid == libc::geteuid()).then_some(cred)
    };
    let Some(cred) = cred else { return false };
    // After "pid (comm) ": state, then the parent's pid.
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", cred.pid)).unwrap_or_default();
    let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
    ppid == Some(parent)
}
