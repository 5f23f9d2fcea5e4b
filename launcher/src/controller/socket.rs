//! The controller's socket: agents started by a resize connect to it, and so do
//! `ductile resize` and `ductile status`.
//!
//! It lives in `$TMPDIR/ductile-<uid>/` (created with mode 0700, refused if another user
//! owns it) as `job-<id>.sock`, and is removed when the job ends. Every connection must
//! come from the same user (SO_PEERCRED) and open with a [`Hello`]; an agent also
//! proves who it is with its one-time token.

pub use super::remote::CONTROLLER_RANK;
use crate::plan::resize::Target;
use crate::proto::{ChannelRead, ChannelWrite, Hello, ResizeReply, Token};
use ductile::bootstrap::nonblocking;
use ductile_transport::{JobId, NodeId};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, Notify};

/// Time a connection has to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// What arrives on the socket.
pub enum Arrival {
    /// An agent started by a resize.
    Agent {
        /// Its node.
        node: NodeId,
        /// Its token.
        token: Token,
        /// Its pid (from the socket's credentials; over TCP, as it says).
        pid: u32,
        /// The connection.
        rx: ChannelRead,
        /// The connection.
        tx: ChannelWrite,
        /// It came over TCP, from another host: its pid is not ours to signal.
        remote: bool,
    },
    /// A resize request; answers go into `reply`.
    Resize {
        /// What is asked.
        target: Target,
        /// Where the answers go.
        reply: mpsc::UnboundedSender<ResizeReply>,
    },
    /// `ductile status`: the job's layout goes into `reply`.
    Status {
        /// Where the answer goes.
        reply: tokio::sync::oneshot::Sender<String>,
    },
}

/// The directory of this user's job sockets.
#[must_use]
pub fn socket_dir() -> PathBuf {
    ductile::bootstrap::socket_dir()
}

/// The socket of job `job`.
#[must_use]
pub fn socket_path(job: JobId) -> PathBuf {
    socket_dir().join(format!("job-{job}.sock"))
}

fn private_dir(dir: &Path) -> std::io::Result<()> {
    ductile::bootstrap::private_dir(dir)
}

/// Removes the sockets in `dir` of jobs whose controller is gone: one killed with
/// SIGKILL could not remove its own. A socket nobody listens on refuses connections.
/// The probe does not block (a live controller whose queue is full answers `EAGAIN` and
/// is kept), and a live controller sees it close before its hello, which it ignores
/// quietly. Jobs bind their socket under a temporary name and rename it once it listens
/// ([`serve`]), so no probe meets one between its bind and its listen.
fn remove_stale(dir: &Path) {
    use std::os::unix::fs::FileTypeExt;
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let socket = e.file_type().is_ok_and(|t| t.is_socket());
        if socket && name.starts_with("adopt-") {
            // A process started alone that was growing (`adopt-<pid>-<nonce>.sock`): not
            // probed by connecting, which it would take for its agent; gone with its pid.
            let pid = name.split('-').nth(1).and_then(|p| p.parse::<libc::pid_t>().ok()).filter(|&p| p > 0);
            // SAFETY: kill with signal 0 only checks that the process exists.
            let gone = pid.is_some_and(|p| unsafe { libc::kill(p, 0) } != 0 && errno_is_esrch());
            if gone && std::fs::remove_file(e.path()).is_ok() {
                tracing::debug!("removed the socket of a process that is gone: {}", e.path().display());
            }
            continue;
        }
        if !(socket && name.starts_with("job-") && name.ends_with(".sock")) {
            continue;
        }
        let refused = socket2::SockAddr::unix(e.path()).and_then(|addr| {
            let s = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)?;
            s.set_nonblocking(true)?;
            s.connect(&addr)
        });
        if refused.is_err_and(|err| err.kind() == std::io::ErrorKind::ConnectionRefused)
            && std::fs::remove_file(e.path()).is_ok()
        {
            tracing::debug!("removed the socket of a job that is gone: {}", e.path().display());
        }
    }
}

fn errno_is_esrch() -> bool {
    std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// The resize requests whose connections may still have answers to write. Each
/// connection's task writes its answers, so a controller that returned as soon as the
/// job ended could end that task before it wrote the answer to a resize completed
/// just then (a change that ends the application): the controller waits for them
/// ([`Answering::flushed`]) before it exits.
#[derive(Clone, Default)]
pub struct Answering(Arc<Connections>);

/// The count of [`Answering`], and the signal of each connection's end.
#[derive(Default)]
struct Connections {
    open: AtomicUsize,
    ended: Notify,
}

/// One connection's share of [`Answering`], released when its task ends.
struct Answer(Answering);

impl Drop for Answer {
    fn drop(&mut self) {
        let c = &(self.0).0;
        c.open.fetch_sub(1, Ordering::AcqRel);
        c.ended.notify_waiters();
    }
}

impl Answering {
    fn start(&self) -> Answer {
        self.0.open.fetch_add(1, Ordering::AcqRel);
        Answer(self.clone())
    }

    /// Waits until every connection has written its last answer (they do once the
    /// controller drops the requests), for at most `limit`.
    pub async fn flushed(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            // Registered before the check: a task that ends in between still wakes us.
            let ended = self.0.ended.notified();
            if self.0.open.load(Ordering::Acquire) == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, ended).await.is_err() {
                tracing::warn!("a resize request's answer could not be written before the job ended");
                return;
            }
        }
    }
}

/// Binds the job's socket and serves it; arrivals go into `tx`. Returns the socket's
/// path and the connections answering resize requests.
///
/// # Errors
/// The directory or socket cannot be made.
pub fn serve(job: JobId, tx: mpsc::UnboundedSender<Arrival>) -> std::io::Result<(PathBuf, Answering)> {
    let path = socket_path(job);
    let dir = path.parent().unwrap_or(Path::new("/"));
    private_dir(dir)?;
    remove_stale(dir);
    // Listening before it has its name (see `remove_stale`).
    let binding = dir.join(format!(".binding-{job}"));
    let _ = std::fs::remove_file(&binding);
    let listener = UnixListener::bind(&binding)?;
    std::fs::rename(&binding, &path)?;
    let answering = Answering::default();
    let answers = answering.clone();
    tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((s, _)) => {
                    tokio::spawn(greet(s, tx.clone(), answers.clone()));
                }
                Err(e) => {
                    tracing::warn!("control socket accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    });
    Ok((path, answering))
}

async fn greet(s: UnixStream, tx: mpsc::UnboundedSender<Arrival>, answering: Answering) {
    let cred = match s.peer_cred() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("control socket: no peer credentials: {e}");
            return;
        }
    };
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    if cred.uid() != me {
        tracing::warn!("control socket: refused a connection from uid {}", cred.uid());
        return;
    }
    let pid = cred.pid().and_then(|p| u32::try_from(p).ok()).unwrap_or(0);
    let (mut rx, mut wtx) = s.into_split();
    let hello = match tokio::time::timeout(HELLO_TIMEOUT, nonblocking::read_msg::<Hello>(&mut rx)).await {
        Ok(Ok(h)) => h,
        // Closed before saying anything: another controller probing for stale sockets.
        Ok(Err(ductile::bootstrap::ControlError::Io(e))) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            tracing::debug!("control socket: pid {pid} closed before its hello");
            return;
        }
        Ok(Err(e)) => {
            tracing::warn!("control socket: bad hello from pid {pid}: {e}");
            return;
        }
        Err(_) => {
            tracing::warn!("control socket: pid {pid} said nothing within {HELLO_TIMEOUT:?}");
            return;
        }
    };
    match hello {
        Hello::Agent { node, token, pid: _ } => {
            let _ = tx.send(Arrival::Agent { node, token, pid, rx: Box::new(rx), tx: Box::new(wtx), remote: false });
        }
        Hello::Resize(target) => {
            let _answer = answering.start();
            let (reply, mut replies) = mpsc::unbounded_channel();
            if tx.send(Arrival::Resize { target, reply }).is_err() {
                return;
            }
            while let Some(r) = replies.recv().await {
                let last = !matches!(r, ResizeReply::Queued);
                if nonblocking::write_msg(&mut wtx, &r).await.is_err() || last {
                    return;
                }
            }
        }
        Hello::Probe => tracing::debug!("control socket: a probe from pid {pid}"),
        Hello::Status => {
            let (reply, answer) = tokio::sync::oneshot::channel();
            if tx.send(Arrival::Status { reply }).is_ok() {
                if let Ok(text) = answer.await {
                    let _ = nonblocking::write_msg(&mut wtx, &text).await;
                }
            }
        }
    }
}

/// The control socket of `job` (a socket path or a job id), connected; else the exit
/// code, the reason printed.
async fn reach(job: &str) -> Result<UnixStream, i32> {
    let path = if job.contains('/') {
        PathBuf::from(job)
    } else {
        match job.parse::<JobId>() {
            Ok(id) => socket_path(id),
            Err(_) => {
                crate::say_errln!("ductile: {job:?} is neither a job id nor a socket path");
                return Err(2);
            }
        }
    };
    UnixStream::connect(&path).await.map_err(|e| {
        crate::say_errln!("ductile: cannot reach job {job} at {}: {e} (is it running?)", path.display());
        1
    })
}

/// `ductile status`: prints the layout of the running job `job` (a socket path or a job
/// id). Returns the exit code.
pub async fn status(job: &str, wait: Duration) -> i32 {
    let s = match reach(job).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let (mut rx, mut tx) = s.into_split();
    if let Err(e) = nonblocking::write_msg(&mut tx, &Hello::Status).await {
        crate::say_errln!("ductile: cannot ask job {job}: {e}");
        return 1;
    }
    match tokio::time::timeout(wait, nonblocking::read_msg::<String>(&mut rx)).await {
        Ok(Ok(text)) => {
            crate::say!("{text}");
            0
        }
        Ok(Err(e)) => {
            crate::say_errln!("ductile: job {job} closed the connection without an answer ({e})");
            1
        }
        Err(_) => {
            crate::say_errln!("ductile: no answer from job {job} within {}s", wait.as_secs());
            1
        }
    }
}

/// `ductile resize`: sends the request to the job's socket and prints the answers.
/// `job` is a socket path or a job id. Returns the exit code.
pub async fn request(job: &str, target: Target, wait: Duration) -> i32 {
    let s = match reach(job).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let (mut rx, mut tx) = s.into_split();
    if let Err(e) = nonblocking::write_msg(&mut tx, &Hello::Resize(target)).await {
        crate::say_errln!("ductile: cannot send the request: {e}");
        return 1;
    }
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, nonblocking::read_msg::<ResizeReply>(&mut rx)).await {
            Ok(Ok(ResizeReply::Queued)) => {
                crate::say_errln!("ductile: resize to {target} queued for the next checkpoint")
            }
            Ok(Ok(ResizeReply::Done(s))) => {
                crate::sayln!("{s}");
                return 0;
            }
            Ok(Ok(ResizeReply::Refused(why))) => {
                crate::say_errln!("ductile: resize refused: {why}");
                return 1;
            }
            Ok(Ok(ResizeReply::Failed(why))) => {
                crate::say_errln!("ductile: resize failed: {why}");
                return 1;
            }
            Ok(Err(e)) => {
                crate::say_errln!("ductile: the job closed the connection before the resize was done ({e})");
                return 1;
            }
            Err(_) => {
                crate::say_errln!(
                    "ductile: no answer within {}s (the job may not have reached a checkpoint)",
                    wait.as_secs()
                );
                return 1;
            }
        }
    }
}
