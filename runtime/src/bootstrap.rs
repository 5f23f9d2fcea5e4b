//! The launcher-to-rank handoff and the control channel between a rank and its agent.
//!
//! The agent starts each rank with one end of a Unix socket pair as file descriptor
//! [`CONTROL_FD`] and names it in `DUCTILE_CONTROL_FD`. Over it flow length-prefixed
//! postcard messages: the agent sends [`ToRank::Handoff`] (job id, key, rank, size, node,
//! transport); the rank binds its endpoint and answers [`FromRank::Ready`] with its
//! address; once every rank of the job is ready the agent sends [`ToRank::Peers`] (the
//! fence). The key travels only over this private channel, never in argv or the
//! environment.

use ductile_transport::{EndpointAddr, JobId, JobKey, NodeId, Rank};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

/// Version of the handoff; a rank refuses a handoff of another version.
pub const HANDOFF_VERSION: u32 = 1;
/// The file descriptor the control channel is passed as.
pub const CONTROL_FD: i32 = 3;
/// Environment variable naming the control channel's descriptor.
pub const CONTROL_FD_ENV: &str = "DUCTILE_CONTROL_FD";
/// Largest control message accepted.
pub const MAX_CONTROL_MSG: u32 = 64 << 20;

/// Everything a rank needs to join its job.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankHandoff {
    /// Must be [`HANDOFF_VERSION`].
    pub version: u32,
    /// The job.
    pub job: JobId,
    /// The job key.
    pub key: JobKey,
    /// This process's rank.
    pub rank: Rank,
    /// Number of ranks in the job.
    pub size: u32,
    /// The node this rank runs on.
    pub node: NodeId,
    /// Number of nodes in the job.
    pub nodes: u32,
    /// Transport backend name.
    pub transport: String,
    /// Timeout of every wait, in milliseconds.
    pub timeout_ms: u64,
}

/// Messages from the agent to a rank.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ToRank {
    /// The first message: who the rank is.
    Handoff(RankHandoff),
    /// The job's address table, indexed by rank (the fence).
    Peers(Vec<EndpointAddr>),
}

/// Messages from a rank to its agent.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum FromRank {
    /// The rank's endpoint is bound at this address.
    Ready {
        /// The address.
        addr: EndpointAddr,
    },
    /// The rank finalized cleanly.
    Finalized,
}

/// Errors of the control channel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// The channel failed or closed.
    #[error("control channel: {0}")]
    Io(#[from] std::io::Error),
    /// A message larger than [`MAX_CONTROL_MSG`].
    #[error("control message of {0} bytes exceeds the limit")]
    TooLarge(u32),
    /// A message that did not decode.
    #[error("control message does not decode: {0}")]
    Decode(#[from] postcard::Error),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_bad_input_is_refused() {
        let h = RankHandoff {
            version: HANDOFF_VERSION,
            job: JobId(1),
            key: JobKey::from_bytes([9; 32]),
            rank: Rank(2),
            size: 4,
            node: NodeId(1),
            nodes: 2,
            transport: "tcp".into(),
            timeout_ms: 1000,
        };
        let bytes = encode(&ToRank::Handoff(h)).unwrap();
        let back: ToRank = read_msg(&mut &bytes[..]).unwrap();
        assert!(matches!(back, ToRank::Handoff(b) if b.rank == Rank(2) && b.key.as_bytes() == &[9; 32]));
        let huge = (MAX_CONTROL_MSG + 1).to_le_bytes();
        assert!(matches!(read_msg::<ToRank>(&mut &huge[..]), Err(ControlError::TooLarge(_))));
        let garbage = [3u8, 0, 0, 0, 0xff, 0xff, 0xff];
        assert!(matches!(read_msg::<ToRank>(&mut &garbage[..]), Err(ControlError::Decode(_))));
        assert!(matches!(read_msg::<ToRank>(&mut &bytes[..5]), Err(ControlError::Io(_))));
    }
}
