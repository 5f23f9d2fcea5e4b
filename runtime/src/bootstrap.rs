//! The launcher-to-rank handoff and the control channel between a rank and its agent.
//!
//! The agent starts each rank with one end of a Unix socket pair as file descriptor
//! [`CONTROL_FD`] and names it in `DUCTILE_CONTROL_FD`. Over it flow length-prefixed
//! postcard messages: the agent sends [`ToRank::Handoff`] (job id, key, endpoint id,
//! node, transport); the rank binds its endpoint and answers [`FromRank::Ready`] with its
//! address; once every rank of the job is ready the agent sends [`ToRank::Membership`]
//! (the fence). The key travels only over this private channel, never in argv or the
//! environment.
//!
//! At a checkpoint, rank 0 sends [`FromRank::Checkpoint`] and gets a [`Decision`]; a
//! [`Change`] names the old ranks and the new membership. A process started by a resize
//! gets `joining: true` in its handoff and the [`Change`] it is part of instead of the
//! start-up membership.

use ductile_transport::{EndpointAddr, JobId, JobKey, NodeId, Rank};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

/// Version of the handoff; a rank refuses a handoff of another version.
pub const HANDOFF_VERSION: u32 = 11;
/// The file descriptor the control channel is passed as.
pub const CONTROL_FD: i32 = 3;
/// Environment variable naming the control channel's descriptor.
pub const CONTROL_FD_ENV: &str = "DUCTILE_CONTROL_FD";
/// Largest control message accepted.
pub const MAX_CONTROL_MSG: u32 = 64 << 20;

/// Everything a process needs to join its job.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankHandoff {
    /// Must be [`HANDOFF_VERSION`].
    pub version: u32,
    /// The job.
    pub job: JobId,
    /// The job key.
    pub key: JobKey,
    /// This process's endpoint id (stable for its lifetime; see [`Rank`]).
    pub id: Rank,
    /// The node this process runs on.
    pub node: NodeId,
    /// The transport to bind.
    pub transport: TransportSpec,
    /// Timeout of every wait, in milliseconds.
    pub timeout_ms: u64,
    /// Whether the process joins a running job (it was started by a resize).
    pub joining: bool,
    /// How registered data moves at a change (`--redistribution`).
    pub redistribution: crate::Method,
    /// Constant registered items move in the background (`--background`).
    pub background: bool,
    /// The job's output lines are prefixed with their rank (`--tag-output`).
    pub tag_output: bool,
    /// A failed process is a shrink of the job (`--on-failure shrink`): the others
    /// recover at their next checkpoint instead of the job ending.
    pub recover: bool,
}

/// Which transport backend a job uses, and its settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportSpec {
    /// Backend name (`tcp`, `quic`, `fabric`).
    pub name: String,
    /// The libfabric provider of the `fabric` backend; unset: `FI_PROVIDER`, then
    /// libfabric's choice.
    pub fabric_provider: Option<String>,
    /// The address the endpoint binds to; unset: loopback (a job on one host).
    pub bind_host: Option<std::net::IpAddr>,
}

impl TransportSpec {
    /// A backend by name with default settings.
    #[must_use]
    pub fn named(name: impl Into<String>) -> Self {
        Self { name: name.into(), fabric_provider: None, bind_host: None }
    }

    /// The transport settings this spec asks for.
    #[must_use]
    pub fn config(&self) -> ductile_transport::TransportConfig {
        let mut cfg = ductile_transport::TransportConfig::default();
        if let Some(host) = self.bind_host {
            cfg = cfg.bind_host(host);
        }
        match &self.fabric_provider {
            Some(p) => cfg.fabric_provider(p.clone()),
            None => cfg,
        }
    }
}

/// The job's membership in one epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Membership {
    /// The epoch: 0 at start, one more with every reconfiguration.
    pub epoch: u64,
    /// Endpoint id of each rank, in rank order.
    pub ranks: Vec<Rank>,
    /// Node of each rank, in rank order.
    pub nodes: Vec<NodeId>,
    /// Address of every endpoint id handed out so far, indexed by id (empty once the
    /// endpoint has left).
    pub addrs: Vec<EndpointAddr>,
}

/// A change of the job's group, decided by the controller at a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    /// Sequence number of the resource change (`rc/<seq>/added`, `rc/<seq>/removed`).
    pub seq: u32,
    /// The checkpoint count at which it happens (new processes continue counting from it).
    pub checkpoint: u64,
    /// Endpoint ids of the ranks before the change, in old rank order.
    pub before: Vec<Rank>,
    /// The membership after it.
    pub after: Membership,
    /// The processes of `before` that failed (a shrink the job did not ask for): they
    /// take no part, and their share of the registered data is lost.
    pub failed: Vec<Rank>,
}

/// The controller's answer to a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    /// No change now.
    Continue,
    /// No change now; the processes that left at the last change are gone, so the
    /// transports may let go of what they hold for them: the address of every endpoint
    /// id so far, by id, blank for those that left (and for a failed growth's).
    Tidy(Vec<EndpointAddr>),
    /// A change is under way (new processes are starting); ask again later.
    Pending,
    /// The group changes now.
    Change(Change),
}

/// How a checkpoint waits for a change that needs new processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CheckpointMode {
    /// Wait until the change is complete.
    Blocking,
    /// Answer [`Decision::Pending`] while new processes start.
    Background,
}

/// Messages from the agent to a rank.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ToRank {
    /// The first message: who the process is.
    Handoff(RankHandoff),
    /// The job's first membership (the start-up fence).
    Membership(Membership),
    /// The answer to [`FromRank::Checkpoint`], or the change a joining process is part of.
    Decision(Decision),
    /// Processes of the job failed (`--on-failure shrink`): every other process
    /// interrupts its waits and recovers at its next checkpoint ([`FromRank::Recover`]).
    Failure(Failure),
    /// Processes leaving in the change under way ended before it switched
    /// (`--on-failure shrink`): the others stop waiting for them, as if their
    /// connections had broken (a process need not have heard from them to see them
    /// go). Nothing else is interrupted and no recovery follows: a process that cannot
    /// finish its switch without them says it is ready to recover
    /// ([`FromRank::Recover`]), and the job ends.
    Gone(Failure),
    /// The change to `epoch` switched: a process that said its move to it was done
    /// ([`FromRank::Recover`]'s `moved`) takes it, and then recovers from there (or
    /// leaves, if it was leaving).
    Settled {
        /// The change's epoch.
        epoch: u64,
    },
}

/// Processes that failed, as the controller tells the others.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// The epoch they failed in.
    pub epoch: u64,
    /// Their endpoint ids.
    pub failed: Vec<Rank>,
    /// Why, for messages (`rank 2 on node 1 was killed by signal 9`).
    pub why: String,
}

/// Phase durations measured inside the ranks during one change, in microseconds
/// (maxima over the processes involved).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwitchTimes {
    /// Installing the new membership and handing the replicated state to new processes.
    pub connect_us: u64,
    /// Moving the registered data (with `--background`: the variable items, at the
    /// switch).
    pub redistribute_us: u64,
    /// With `--background`: moving the constant items while the application computed,
    /// from the decision until the last old rank saw the move finish (0 otherwise).
    pub background_us: u64,
}

/// Messages from a rank to its agent.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum FromRank {
    /// The rank's endpoint is bound at this address.
    Ready {
        /// The address.
        addr: EndpointAddr,
    },
    /// Rank 0 reached a checkpoint (the `count`-th of the job, counted from 1).
    Checkpoint {
        /// The current epoch.
        epoch: u64,
        /// Checkpoints so far.
        count: u64,
        /// How to wait for a change that needs new processes.
        mode: CheckpointMode,
        /// Processes the application asks for (evolving jobs), if any.
        want_procs: Option<u32>,
    },
    /// The new rank 0 finished switching to the membership of `epoch`.
    Switched {
        /// The new epoch.
        epoch: u64,
        /// What the switch cost inside the ranks.
        times: SwitchTimes,
    },
    /// The rank reached a checkpoint after a [`ToRank::Failure`] and waits for the
    /// change that leaves the failed processes out (every surviving rank sends it).
    Recover {
        /// Its epoch.
        epoch: u64,
        /// Checkpoints so far.
        count: u64,
        /// Whether its registered data is still that of `epoch`, whole: false once it
        /// began to move the data of a change it has not completed (a change to a later
        /// epoch, which the failure interrupted), unless it kept its old blocks (with
        /// `--on-failure shrink`, a blocking move keeps them until the change commits).
        /// A change that no process committed to can be abandoned, and the job recover at
        /// `epoch`.
        intact: bool,
        /// Its move in that change is done, but the change's last collective lost a
        /// process: it holds both its old blocks and its new ones, and takes the change
        /// ([`ToRank::Settled`]) or leaves it (a recovery from `epoch`), whichever the
        /// others allow.
        moved: bool,
    },
    /// The rank finalized cleanly.
    Finalized,
    /// The rank cannot join: its endpoint did not bind (unknown provider, missing
    /// library, ...). Sent instead of `Ready`, so the launcher can say why.
    Failed {
        /// What went wrong.
        reason: String,
    },
    /// A checkpoint failed on this rank (a change that could not complete: a peer lost
    /// or silent, registrations that differ, ...), or the change a new process was
    /// started for. The process can only finalize from here; the launcher ends the job
    /// soon after unless it ends first, so that no rank waits on a change that is over.
    CheckpointFailed {
        /// The checkpoint's number (0: the change a new process joined with).
        count: u64,
        /// The process's rank in its world at the checkpoint (the old membership's).
        rank: u32,
        /// What went wrong.
        reason: String,
    },
}

/// Errors of the control channel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// The channel failed or closed.
    #[error("control channel: {0}")]
    Io(std::io::Error),
    /// A message larger than [`MAX_CONTROL_MSG`].
    #[error("control message of {0} bytes exceeds the limit")]
    TooLarge(u32),
    /// A message that did not decode.
    #[error("control message does not decode: {0}")]
    Decode(postcard::Error),
}

// By hand rather than with `#[from]`, which would also make the cause the error's
// source: the message already says it, and `{:#}` printed it twice ("early eof: early eof").
impl From<std::io::Error> for ControlError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e)
    }
}

impl From<postcard::Error> for ControlError {
    fn from(e: postcard::Error) -> Self {
        Self::Decode(e)
    }
}

/// Encodes a control message with its length prefix.
///
/// # Errors
/// The message does not encode or is too large.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, ControlError> {
    let body = postcard::to_stdvec(msg)?;
    let len =
        u32::try_from(body.len()).ok().filter(|&l| l <= MAX_CONTROL_MSG).ok_or(ControlError::TooLarge(u32::MAX))?;
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Checks a length prefix.
///
/// # Errors
/// Larger than [`MAX_CONTROL_MSG`].
pub fn check_len(prefix: [u8; 4]) -> Result<usize, ControlError> {
    let len = u32::from_le_bytes(prefix);
    if len > MAX_CONTROL_MSG {
        return Err(ControlError::TooLarge(len));
    }
    Ok(len as usize)
}

/// Writes one message (blocking).
///
/// # Errors
/// Encoding or I/O failure.
pub fn write_msg<T: Serialize>(w: &mut impl Write, msg: &T) -> Result<(), ControlError> {
    w.write_all(&encode(msg)?)?;
    w.flush()?;
    Ok(())
}

/// Reads one message (blocking).
///
/// # Errors
/// I/O failure, oversized or undecodable message.
pub fn read_msg<T: DeserializeOwned>(r: &mut impl Read) -> Result<T, ControlError> {
    let mut p = [0u8; 4];
    r.read_exact(&mut p)?;
    let mut body = vec![0u8; check_len(p)?];
    r.read_exact(&mut body)?;
    Ok(postcard::from_bytes(&body)?)
}

/// Async counterparts for the agent and controller.
pub mod nonblocking {
    use super::{check_len, encode, ControlError};
    use serde::de::DeserializeOwned;
    use serde::Serialize;
    use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

    /// Writes one message.
    ///
    /// # Errors
    /// Encoding or I/O failure.
    pub async fn write_msg<T: Serialize>(w: &mut (impl AsyncWrite + Unpin), msg: &T) -> Result<(), ControlError> {
        w.write_all(&encode(msg)?).await?;
        w.flush().await?;
        Ok(())
    }

    /// Reads one message.
    ///
    /// # Errors
    /// I/O failure, oversized or undecodable message.
    pub async fn read_msg<T: DeserializeOwned>(r: &mut (impl AsyncRead + Unpin)) -> Result<T, ControlError> {
        let mut p = [0u8; 4];
        r.read_exact(&mut p).await?;
        let mut body = vec![0u8; check_len(p)?];
        r.read_exact(&mut body).await?;
        Ok(postcard::from_bytes(&body)?)
    }
}

/// Takes ownership of the control channel after checking that it is an open Unix
/// socket created by this process's parent (the agent). A stray `DUCTILE_CONTROL_FD`
/// inherited by some unrelated child is refused instead of reading a random descriptor.
/// Call it once per process: it takes ownership of the descriptor.
///
/// # Errors
/// The descriptor is not open, not a socket, or not from the parent process.
pub fn take_control(fd: i32) -> Result<UnixStream, String> {
    use std::os::fd::FromRawFd;
    let bad = |why: String| format!("DUCTILE_CONTROL_FD={fd}: {why}");
    // SAFETY: fcntl and getsockopt only read the descriptor table and socket state;
    // `cred` and `len` are valid for writes of the sizes given.
    let (flags, rc, cred) = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFD);
        let mut cred: libc::ucred = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        let rc = libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_PEERCRED, (&raw mut cred).cast(), &mut len);
        (flags, rc, cred)
    };
    if flags < 0 {
        return Err(bad("not an open descriptor".into()));
    }
    if rc != 0 {
        return Err(bad("not a socket".into()));
    }
    let parent = std::os::unix::process::parent_id();
    if u32::try_from(cred.pid).ok() != Some(parent) {
        return Err(bad(format!(
            "the socket was made by pid {}, not by this process's agent (pid {parent})",
            cred.pid
        )));
    }
    // SAFETY: the descriptor is open, is a socket from our agent, and is taken only
    // once per process (callers guard this); nothing else owns it.
    let stream = unsafe {
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        UnixStream::from_raw_fd(fd)
    };
    Ok(stream)
}

/// The directory of this user's job sockets (the launcher's control sockets, and the
/// socket a process started alone is adopted through).
#[must_use]
pub fn socket_dir() -> std::path::PathBuf {
    // SAFETY: geteuid cannot fail.
    let uid = unsafe { libc::geteuid() };
    std::env::temp_dir().join(format!("ductile-{uid}"))
}

/// Makes `dir` a directory only this user can enter (mode 0700), or checks that it is.
///
/// # Errors
/// It cannot be made, or it belongs to another user or is not a directory.
pub fn private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(dir)?;
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    if !meta.is_dir() || meta.uid() != me {
        return Err(std::io::Error::other(format!("{} is not a directory of this user", dir.display())));
    }
    if meta.permissions().mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_bad_input_is_refused() {
        let h = RankHandoff {
            version: HANDOFF_VERSION,
            job: JobId(1),
            key: JobKey::from_bytes([9; 32]),
            id: Rank(2),
            node: NodeId(1),
            transport: TransportSpec::named("tcp"),
            timeout_ms: 1000,
            joining: false,
            redistribution: crate::Method::Rma,
            background: true,
            tag_output: true,
            recover: true,
        };
        let bytes = encode(&ToRank::Handoff(h)).unwrap();
        let back: ToRank = read_msg(&mut &bytes[..]).unwrap();
        assert!(matches!(back, ToRank::Handoff(b) if b.id == Rank(2) && b.key.as_bytes() == &[9; 32]));
        let huge = (MAX_CONTROL_MSG + 1).to_le_bytes();
        assert!(matches!(read_msg::<ToRank>(&mut &huge[..]), Err(ControlError::TooLarge(_))));
        let garbage = [3u8, 0, 0, 0, 0xff, 0xff, 0xff];
        assert!(matches!(read_msg::<ToRank>(&mut &garbage[..]), Err(ControlError::Decode(_))));
        assert!(matches!(read_msg::<ToRank>(&mut &bytes[..5]), Err(ControlError::Io(_))));
    }

    proptest::proptest! {
        /// Whatever bytes come down a control channel, in either direction: a message or
        /// an error, never a panic or an allocation past the cap.
        #[test]
        fn any_bytes_decode_to_a_message_or_an_error(body: Vec<u8>, claimed in 0u32..(2 * MAX_CONTROL_MSG)) {
            for prefix in [claimed, u32::try_from(body.len()).unwrap()] {
                let mut framed = prefix.to_le_bytes().to_vec();
                framed.extend_from_slice(&body);
                let _ = read_msg::<ToRank>(&mut &framed[..]);
                let _ = read_msg::<FromRank>(&mut &framed[..]);
            }
        }
    }
}
