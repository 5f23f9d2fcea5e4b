//! This host's network identity, for multi-host launch: its interface addresses, the
//! source address towards a peer, and its host name.
//!
//! Hand-written on `libc`: no crate in the workspace offers these (nix has `getifaddrs`
//! and `gethostname`, but only behind its `net` and `hostname` features, which the
//! workspace does not enable). This is the launcher's one module of network FFI.

use std::ffi::{c_int, c_uint};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::ptr;

/// The addresses of this host's interfaces that are up, without loopback and IPv6
/// link-local (`fe80::/10`) addresses: IPv4 first, then IPv6, each in the order the
/// system lists them, without duplicates.
///
/// # Errors
/// `getifaddrs` failing (out of memory or descriptors).
pub fn local_addrs() -> io::Result<Vec<IpAddr>> {
    let list = IfAddrs::new()?;
    let mut v4 = Vec::new();
    let mut v6 = Vec::new();
    for ifa in list.iter() {
        if ifa.ifa_flags & (libc::IFF_UP as c_uint) == 0 || ifa.ifa_flags & (libc::IFF_LOOPBACK as c_uint) != 0 {
            continue;
        }
        // SAFETY: getifaddrs fills `ifa_addr` with null or a socket address valid for
        // its family, alive until the list is freed, which `list` does only when dropped.
        let Some(ip) = (unsafe { sockaddr_ip(ifa.ifa_addr) }) else {
            continue;
        };
        let out = if ip.is_ipv4() { &mut v4 } else { &mut v6 };
        if usable(ip) && !out.contains(&ip) {
            out.push(ip);
        }
    }
    v4.append(&mut v6);
    Ok(v4)
}

/// Whether an interface address is one peers may reach this host at.
fn usable(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => !v4.is_loopback() && !v4.is_unspecified(),
        IpAddr::V6(v6) => !v6.is_loopback() && !v6.is_unspecified() && !v6.is_unicast_link_local(),
    }
}

/// The local address the kernel would send from to reach `dest`: a UDP socket bound to
/// the unspecified address of `dest`'s family is connected to it (a route lookup; no
/// packet is sent) and its local address read back.
///
/// # Errors
/// No route to `dest` (for instance an IPv6 destination on a host without IPv6), or the
/// socket calls failing.
pub fn route_source(dest: SocketAddr) -> io::Result<IpAddr> {
    let any: IpAddr = match dest {
        SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let socket = UdpSocket::bind((any, 0))?;
    socket.connect(dest)?;
    Ok(socket.local_addr()?.ip())
}

/// This host's name, as `gethostname` gives it.
///
/// # Errors
/// `gethostname` failing, or a name that is not UTF-8.
pub fn hostname() -> io::Result<String> {
    // Larger than any system's HOST_NAME_MAX (64 on Linux, 255 on the BSDs).
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for `buf.len()` bytes, and gethostname writes at most
    // that many.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // POSIX leaves the terminating NUL of a truncated name unspecified.
    let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8(buf[..len].to_vec()).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// The list `getifaddrs` returns, freed when dropped (so on every path).
struct IfAddrs(*mut libc::ifaddrs);

impl IfAddrs {
    fn new() -> io::Result<Self> {
        let mut head = ptr::null_mut();
        // SAFETY: `head` is a valid place for the list's head; on failure getifaddrs
        // allocates nothing.
        if unsafe { libc::getifaddrs(&mut head) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self(head))
    }

    fn iter(&self) -> impl Iterator<Item = &libc::ifaddrs> + '_ {
        let mut next = self.0.cast_const();
        std::iter::from_fn(move || {
            // SAFETY: `next` is null or a node of the list `self` owns; the nodes live
            // until `self` is dropped, which the borrow of `self` rules out meanwhile.
            let node = unsafe { next.as_ref() }?;
            next = node.ifa_next;
            Some(node)
        })
    }
}

impl Drop for IfAddrs {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the list came from getifaddrs and is freed only here, once.
            unsafe { libc::freeifaddrs(self.0) };
        }
    }
}

/// The IP address in a socket address, if it is IPv4 or IPv6.
///
/// # Safety
/// `addr` is null or points to a socket address valid for its family's size.
unsafe fn sockaddr_ip(addr: *const libc::sockaddr) -> Option<IpAddr> {
    if addr.is_null() {
        return None;
    }
    // SAFETY: non-null and valid by the caller's promise; every socket address starts
    // with its family.
    let family = c_int::from(unsafe { (*addr).sa_family });
    match family {
        libc::AF_INET => {
            // SAFETY: an AF_INET address is a sockaddr_in (caller's promise); read
            // unaligned, as a sockaddr pointer promises no more than sockaddr's alignment.
            let sin = unsafe { addr.cast::<libc::sockaddr_in>().read_unaligned() };
            // `s_addr` is in network order, so its bytes in memory are the octets.
            Some(IpAddr::V4(Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes())))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for AF_INET6 and sockaddr_in6.
            let sin6 = unsafe { addr.cast::<libc::sockaddr_in6>().read_unaligned() };
            Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
        }
        _ => None,
    }
}

/// Makes a TCP connection notice a peer that vanished (its host or the network to it
/// gone) within about half a minute: keepalive probes after 10 s of quiet, every 5 s,
/// 3 unanswered ones end it; and data unacknowledged for 30 s ends it too (keepalive
/// alone does not cover a connection with data in flight).
///
/// # Errors
/// A socket option cannot be set.
pub fn keep_alive(socket: &impl std::os::fd::AsRawFd) -> std::io::Result<()> {
    let fd = socket.as_raw_fd();
    let set = |level: i32, name: i32, value: i32| -> std::io::Result<()> {
        let len = std::mem::size_of::<i32>() as libc::socklen_t;
        // SAFETY: setsockopt on a socket we hold, with a pointer to an i32 and its size.
        let rc = unsafe { libc::setsockopt(fd, level, name, std::ptr::from_ref(&value).cast(), len) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 10)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 5)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3)?;
    set(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, 30_000)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn keep_alive_sets_its_options() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        keep_alive(&s).unwrap();
        let get = |level, name| {
            let mut v: i32 = 0;
            let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
            // SAFETY: getsockopt into an i32 of the given size.
            let rc =
                unsafe { libc::getsockopt(s.as_raw_fd(), level, name, std::ptr::from_mut(&mut v).cast(), &mut len) };
            assert_eq!(rc, 0);
            v
        };
        assert_eq!(get(libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(get(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 10);
        assert_eq!(get(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT), 30_000);
    }

    #[test]
    fn route_to_loopback_is_from_loopback() {
        let dest: SocketAddr = "127.0.0.1:9".parse().unwrap();
        assert_eq!(route_source(dest).unwrap(), IpAddr::from(Ipv4Addr::LOCALHOST));
    }

    #[test]
    fn local_addrs_skip_loopback_and_link_local() {
        let addrs = local_addrs().unwrap();
        assert!(addrs.iter().all(|ip| !ip.is_loopback()), "{addrs:?}");
        assert!(addrs.iter().all(|ip| usable(*ip)), "{addrs:?}");
        // IPv4 first, no duplicates.
        let first_v6 = addrs.iter().position(IpAddr::is_ipv6).unwrap_or(addrs.len());
        assert!(addrs[first_v6..].iter().all(IpAddr::is_ipv6), "{addrs:?}");
        assert!(addrs.iter().enumerate().all(|(i, a)| !addrs[..i].contains(a)), "{addrs:?}");
        // The source towards any of them is an interface address too.
        for ip in &addrs {
            if let Ok(src) = route_source(SocketAddr::new(*ip, 9)) {
                assert!(src == *ip || addrs.contains(&src), "{ip} -> {src}");
            }
        }
    }

    #[test]
    fn usable_addresses() {
        for bad in ["127.0.0.1", "127.9.9.9", "0.0.0.0", "::1", "::", "fe80::1", "febf::1"] {
            assert!(!usable(bad.parse().unwrap()), "{bad}");
        }
        for good in ["10.0.0.1", "192.168.1.2", "2001:db8::1", "fd00::1", "fec0::1"] {
            assert!(usable(good.parse().unwrap()), "{good}");
        }
    }

    #[test]
    fn hostname_is_readable() {
        let name = hostname().unwrap();
        assert!(!name.is_empty() && !name.contains('\0'), "{name:?}");
    }
}
