//! The few raw system calls the transport makes, kept in one place.

use bytes::BufMut;
use std::os::fd::RawFd;

/// Reads from a non-blocking socket into `buf`'s spare capacity, bypassing tokio's
/// readiness cache (a thread that polls a socket tokio also watches must see data that
/// tokio has already been told about). `WouldBlock` when nothing is there.
pub(crate) fn recv_nonblocking(fd: RawFd, buf: &mut impl BufMut) -> std::io::Result<usize> {
    let chunk = buf.chunk_mut();
    // SAFETY: `chunk` is writable memory of `chunk.len()` bytes owned by `buf`;
    // recv writes at most that many bytes and returns how many it wrote.
    let n = unsafe { libc::recv(fd, chunk.as_mut_ptr().cast(), chunk.len(), libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let n = n as usize;
    // SAFETY: recv initialised the first `n` bytes of the chunk.
    unsafe { buf.advance_mut(n) };
    Ok(n)
}

/// Writes `bufs` to a non-blocking socket with one `sendmsg` call, without raising
/// SIGPIPE on a closed peer. `WouldBlock` when the socket buffer is full.
pub(crate) fn send_vectored_nonblocking(fd: RawFd, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
    // SAFETY: an all-zero msghdr is a valid "no address, no control data" header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is guaranteed ABI-compatible with iovec on Unix.
    msg.msg_iov = bufs.as_ptr().cast_mut().cast();
    msg.msg_iovlen = bufs.len() as _;
    // SAFETY: msg points at `bufs`, which outlive the call; sendmsg only reads them.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as usize)
}
