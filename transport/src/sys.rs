//! The few raw system calls the transport makes, kept in one place.

use bytes::BufMut;
use std::os::fd::RawFd;

/// What a read from a socket got.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Got {
    /// Bytes read.
    pub(crate) n: usize,
    /// Whether they filled the space offered. A TCP socket's `recv` stops short when its
    /// receive queue is empty (or at urgent data, which the backend never sends), so
    /// after a short read there is nothing more to read until new data arrives, which
    /// raises a new edge for edge-triggered `epoll` (data held back while the read had
    /// the socket is released, and signalled, when the read ends). A read limited to a
    /// frame's rest that fills it says nothing about what follows.
    pub(crate) full: bool,
}

/// Reads from a non-blocking socket into `buf`'s spare capacity, bypassing tokio's
/// readiness cache (a thread that polls a socket tokio also watches must see data that
/// tokio has already been told about). `WouldBlock` when nothing is there.
pub(crate) fn recv_nonblocking(fd: RawFd, buf: &mut impl BufMut) -> std::io::Result<Got> {
    let chunk = buf.chunk_mut();
    let offered = chunk.len();
    // SAFETY: `chunk` is writable memory of `chunk.len()` bytes owned by `buf`;
    // recv writes at most that many bytes and returns how many it wrote.
    let n = unsafe { libc::recv(fd, chunk.as_mut_ptr().cast(), chunk.len(), libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let n = n as usize;
    // SAFETY: recv initialised the first `n` bytes of the chunk.
    unsafe { buf.advance_mut(n) };
    Ok(Got { n, full: n == offered })
}

/// Waits until `fd` has something to read (or its peer closed), for at most `timeout`;
/// false if the time passed first. An interrupted or failed wait counts as readable,
/// so that the caller reads again and sees the error itself.
pub(crate) fn wait_readable(fd: RawFd, timeout: std::time::Duration) -> bool {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // `ppoll`, not `poll`: waits shorter than a millisecond.
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos()),
    };
    // SAFETY: one valid pollfd that the call reads and writes, a valid timeout it only
    // reads, and no signal mask.
    unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) != 0 }
}

/// A level-triggered `epoll` set: which of many sockets have something to read, asked
/// in one system call whatever their number. Written by hand because mio, which the
/// progress thread's set uses, registers every source edge-triggered, and a thread that
/// polls, stops reading at a short read or finds a socket busy with another reader must
/// be told again about data it left.
pub(crate) struct ReadySet(std::os::fd::OwnedFd);

impl ReadySet {
    /// An empty set.
    pub(crate) fn new() -> std::io::Result<Self> {
        use std::os::fd::FromRawFd;
        // SAFETY: epoll_create1 has no memory preconditions.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        Ok(Self(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }))
    }

    /// Adds `fd`, reported with `key` while it has something to read (data, its end, an
    /// error). Remove it before closing it (a socket leaves the set by itself only when
    /// its last descriptor closes).
    pub(crate) fn add(&self, fd: RawFd, key: u64) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let mut ev = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLRDHUP) as u32, u64: key };
        // SAFETY: both descriptors are open; `ev` is a valid event the call only reads.
        if unsafe { libc::epoll_ctl(self.0.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &raw mut ev) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Removes `fd` (best effort: closing it removes it too).
    pub(crate) fn remove(&self, fd: RawFd) {
        use std::os::fd::AsRawFd;
        // SAFETY: a null event is allowed for EPOLL_CTL_DEL since Linux 2.6.9.
        let _ = unsafe { libc::epoll_ctl(self.0.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
    }

    /// The keys of the members that have something to read now, at most `out.len()`
    /// (the others are reported by the next call); never waits.
    pub(crate) fn ready<'a>(
        &self,
        out: &'a mut [libc::epoll_event],
    ) -> std::io::Result<impl Iterator<Item = u64> + 'a> {
        use std::os::fd::AsRawFd;
        let max = i32::try_from(out.len()).unwrap_or(i32::MAX);
        // SAFETY: `out` has room for `max` events, which the call writes.
        let n = unsafe { libc::epoll_wait(self.0.as_raw_fd(), out.as_mut_ptr(), max, 0) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // A packed struct's field is read by value.
        Ok(out[..n as usize].iter().map(|e| e.u64))
    }
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

/// The MTU of the local route to `peer` as the kernel knows it (`IP_MTU` on a connected
/// UDP socket; nothing is sent): 65536 on loopback, 65520 on IPoIB in connected mode,
/// 9000 on a jumbo-frame link. None where the kernel cannot tell.
#[cfg(any(feature = "quic", test))]
pub(crate) fn route_mtu(peer: std::net::SocketAddr) -> Option<u32> {
    use std::net::{Ipv4Addr, Ipv6Addr, UdpSocket};
    use std::os::fd::AsRawFd;
    let (any, level, name) = if peer.is_ipv4() {
        ((Ipv4Addr::UNSPECIFIED, 0).into(), libc::IPPROTO_IP, libc::IP_MTU)
    } else {
        ((Ipv6Addr::UNSPECIFIED, 0).into(), libc::IPPROTO_IPV6, libc::IPV6_MTU)
    };
    let any: std::net::SocketAddr = any;
    let socket = UdpSocket::bind(any).ok()?;
    socket.connect(peer).ok()?;
    let mut mtu: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a valid socket; `mtu` and `len` describe a c_int the kernel writes into.
    let rc = unsafe { libc::getsockopt(socket.as_raw_fd(), level, name, (&raw mut mtu).cast(), &raw mut len) };
    (rc == 0).then(|| u32::try_from(mtu).ok()).flatten().filter(|&m| m > 0)
}

/// Asks for socket buffers of `bytes` each way: past `net.core.rmem_max`/`wmem_max` if
/// the process may (`SO_RCVBUFFORCE`, root), else capped there by the kernel. A refusal
/// leaves the defaults.
#[cfg(any(feature = "quic", test))]
pub(crate) fn set_socket_buffers(fd: RawFd, bytes: usize) {
    let v = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    let set = |opt| {
        // SAFETY: a valid socket and a c_int option value that outlives the call.
        unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, opt, (&raw const v).cast(), size_of::<libc::c_int>() as _) }
    };
    for (forced, capped) in [(libc::SO_RCVBUFFORCE, libc::SO_RCVBUF), (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF)] {
        if set(forced) != 0 {
            let _ = set(capped);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_route_to_loopback_has_a_large_mtu() {
        // Linux gives loopback an MTU of 65536; the quic backend relies on large routes
        // being recognised to send large datagrams.
        let mtu = route_mtu("127.0.0.1:9".parse().unwrap()).expect("the loopback route's MTU");
        assert!(mtu >= 16 << 10, "loopback MTU {mtu}");
    }

    #[test]
    fn socket_buffers_only_grow() {
        use std::os::fd::AsRawFd;
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let rcvbuf = || {
            let mut v: libc::c_int = 0;
            let mut len = size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: a valid socket; `v` and `len` describe a c_int.
            let rc = unsafe {
                libc::getsockopt(
                    socket.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVBUF,
                    (&raw mut v).cast(),
                    &raw mut len,
                )
            };
            assert_eq!(rc, 0);
            v
        };
        let before = rcvbuf();
        set_socket_buffers(socket.as_raw_fd(), 4 << 20);
        assert!(rcvbuf() >= before, "{} < {before}", rcvbuf());
    }

    #[test]
    fn a_ready_set_reports_what_has_something_to_read_until_it_is_read() {
        use std::io::{Read, Write};
        use std::os::fd::AsRawFd;
        let set = ReadySet::new().unwrap();
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let (mut c, mut d) = std::os::unix::net::UnixStream::pair().unwrap();
        set.add(b.as_raw_fd(), 7).unwrap();
        set.add(d.as_raw_fd(), 9).unwrap();
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 4];
        let mut keys = |set: &ReadySet| set.ready(&mut events).unwrap().collect::<Vec<_>>();
        assert!(keys(&set).is_empty());
        c.write_all(b"x").unwrap();
        // Level-triggered: reported again while unread.
        assert_eq!(keys(&set), [9]);
        assert_eq!(keys(&set), [9]);
        d.read_exact(&mut [0u8; 1]).unwrap();
        assert!(keys(&set).is_empty());
        // A peer's end counts as something to read; a removed member is not reported.
        a.write_all(b"y").unwrap();
        set.remove(b.as_raw_fd());
        drop(c);
        assert_eq!(keys(&set), [9]);
    }
}
