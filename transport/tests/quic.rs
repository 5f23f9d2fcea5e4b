//! What only the QUIC backend can be asked: certificate pinning, stray datagrams on its
//! UDP port, its address text, and death detection by idle timeout when a peer vanishes
//! without a word. Everything else is in `conformance.rs`.
#![cfg(feature = "quic")]

use bytes::Bytes;
use ductile_transport::auth::Identity;
use ductile_transport::matching::{Pattern, SrcMatch, TagMatch};
use ductile_transport::{
    bind, Context, Endpoint, EndpointAddr, JobId, JobKey, Mailbox, Rank, Tag, TransportConfig, TransportError,
    TransportSetup,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(10);

/// An endpoint of job 77 with key bytes all `key`; binds on the current runtime.
fn endpoint(key: u8, rank: u32, size: u32) -> Endpoint {
    let mailbox = Arc::new(Mailbox::new());
    let setup = TransportSetup {
        identity: Identity { job: JobId(77), key: JobKey::from_bytes([key; 32]), rank: Rank(rank) },
        size,
        config: TransportConfig::default().handshake_timeout(Duration::from_secs(5)),
        mailbox: mailbox.clone(),
    };
    Endpoint::new(bind("quic", setup).unwrap(), mailbox, Rank(rank))
}

fn job(size: u32) -> Vec<Endpoint> {
    let eps: Vec<Endpoint> = (0..size).map(|r| endpoint(1, r, size)).collect();
    let table = addrs(&eps);
    for e in &eps {
        e.transport().set_peers(&table).unwrap();
    }
    eps
}

fn addrs(eps: &[Endpoint]) -> Vec<EndpointAddr> {
    eps.iter().map(|e| e.transport().local_addr()).collect()
}

fn socket_addr(a: &EndpointAddr) -> SocketAddr {
    a.0.split_once('#').unwrap().0.parse().unwrap()
}

fn from(src: u32, tag: u32) -> Pattern {
    Pattern { ctx: Context(0), src: SrcMatch::Rank(Rank(src)), tag: TagMatch::Tag(Tag(tag)) }
}

/// Rank 0 of a job of 2, on a runtime of its own: shutting that runtime down stops its
/// tasks and closes its socket without a word on the wire, as a killed process would.
fn doomed_rank_0() -> (tokio::runtime::Runtime, Endpoint) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let doomed = {
        let _on = rt.enter();
        endpoint(1, 0, 2)
    };
    (rt, doomed)
}

async fn close_all(eps: &[Endpoint]) {
    for e in eps {
        e.transport().close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addresses_pin_a_certificate_and_bad_ones_are_refused() {
    let eps = job(2);
    let a = eps[0].transport().local_addr().0;
    let (sock, hex) = a.split_once('#').unwrap();
    assert!(sock.parse::<SocketAddr>().is_ok(), "{a}");
    assert_eq!(hex.len(), 64, "{a}");
    assert!(hex.bytes().all(|c| c.is_ascii_hexdigit()), "{a}");
    assert_ne!(a, eps[1].transport().local_addr().0, "each endpoint has its own certificate");
    for bad in [sock.to_string(), format!("{sock}#{}", &hex[1..]), format!("nowhere:1#{hex}"), "#".into()] {
        let table = [EndpointAddr(a.clone()), EndpointAddr(bad.clone())];
        match eps[0].transport().set_peers(&table) {
            Err(TransportError::BadAddress { peer: Rank(1), .. }) => {}
            other => panic!("{bad:?} was not refused: {other:?}"),
        }
    }
    // A departed endpoint ("") is accepted, and sending to it fails cleanly.
    eps[0].transport().set_peers(&[EndpointAddr(a), EndpointAddr(String::new())]).unwrap();
    let err = eps[0].send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"x")).await.unwrap_err();
    assert!(matches!(err, TransportError::UnknownPeer(Rank(1))), "{err}");
    close_all(&eps).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_that_is_not_the_pinned_one_is_refused() {
    let eps = job(3);
    let table = addrs(&eps);
    // Rank 0 is told rank 1's socket address with rank 2's certificate fingerprint.
    let (_, other_fp) = table[2].0.split_once('#').unwrap();
    let forged = EndpointAddr(format!("{}#{other_fp}", socket_addr(&table[1])));
    eps[0].transport().set_peers(&[table[0].clone(), forged, table[2].clone()]).unwrap();
    let err = eps[0].send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"misdirected")).await.unwrap_err();
    let text = err.to_string();
    assert!(text.contains("rank 1") && text.contains("does not match"), "{text}");
    // The get path dials the same way and is refused the same way.
    let w = eps[1].expose(Bytes::from_static(b"secret")).unwrap();
    assert!(eps[0].get(Rank(1), w, 0, 6, T).await.is_err());
    // Nothing reached rank 1, which still takes traffic from a correctly pinned peer.
    eps[2].send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"friend")).await.unwrap();
    assert_eq!(eps[1].recv(from(2, 1), T).await.unwrap().payload, &b"friend"[..]);
    assert!(eps[1].recv(from(0, 1), Duration::from_millis(300)).await.is_err());
    assert_eq!(eps[1].mailbox().queued(), 0);
    close_all(&eps).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_datagrams_do_not_disturb_the_endpoint() {
    let eps = job(2);
    let target = socket_addr(&eps[1].transport().local_addr());
    let junk = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let mut initial_like = vec![0xc0u8, 0, 0, 0, 1, 8];
    initial_like.resize(1200, 0x5a);
    let datagrams: Vec<Vec<u8>> =
        vec![vec![], vec![0xff], vec![0; 1200], vec![0x40; 40], initial_like, (0..=255).collect::<Vec<u8>>()];
    for d in &datagrams {
        junk.send_to(d, target).await.unwrap();
    }
    eps[0].send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"first")).await.unwrap();
    assert_eq!(eps[1].recv(from(0, 1), T).await.unwrap().payload, &b"first"[..]);
    // Garbage during an established connection, at both ends, is dropped too.
    let source = socket_addr(&eps[0].transport().local_addr());
    for d in &datagrams {
        junk.send_to(d, target).await.unwrap();
        junk.send_to(d, source).await.unwrap();
    }
    eps[0].send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"second")).await.unwrap();
    assert_eq!(eps[1].recv(from(0, 1), T).await.unwrap().payload, &b"second"[..]);
    assert_eq!(eps[1].mailbox().queued(), 0);
    close_all(&eps).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_vanishes_silently_is_lost_within_the_idle_timeout() {
    let (rt, doomed) = doomed_rank_0();
    let alive = endpoint(1, 1, 2);
    let table = [doomed.transport().local_addr(), alive.transport().local_addr()];
    doomed.transport().set_peers(&table).unwrap();
    alive.transport().set_peers(&table).unwrap();
    let sender = doomed.clone();
    rt.spawn(async move { sender.send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"hello")).await })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(alive.recv(from(0, 1), T).await.unwrap().payload, &b"hello"[..]);
    rt.shutdown_background();
    let started = Instant::now();
    let err = alive.recv(from(0, 1), Duration::from_secs(15)).await.unwrap_err();
    assert!(matches!(err, TransportError::PeerLost(Rank(0))), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10), "noticed after {:?}", started.elapsed());
    drop(doomed);
    alive.transport().close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dial_to_a_peer_known_to_have_ended_fails_as_lost_not_as_a_timeout() {
    // Rank 0 is gone before anyone dialed it (its runtime shut down, its socket closed
    // without a word): a handshake with it can only time out.
    let (rt, doomed) = doomed_rank_0();
    let mailbox = Arc::new(Mailbox::new());
    let setup = TransportSetup {
        identity: Identity { job: JobId(77), key: JobKey::from_bytes([1; 32]), rank: Rank(1) },
        size: 2,
        config: TransportConfig::default().connect_timeout(Duration::from_millis(500)),
        mailbox: mailbox.clone(),
    };
    let alive = Endpoint::new(bind("quic", setup).unwrap(), mailbox, Rank(1));
    alive.transport().set_peers(&[doomed.transport().local_addr(), alive.transport().local_addr()]).unwrap();
    rt.shutdown_background();
    let hello = || alive.send(Rank(0), Context(0), Tag(1), Bytes::from_static(b"hello"));
    // Nobody said it ended: the dial's own error.
    let err = hello().await.unwrap_err();
    assert!(matches!(err, TransportError::Timeout { .. }), "{err}");
    // Once the mailbox knows (the launcher said the process is gone), the same dial
    // fails as a lost peer, which a job run with --on-failure shrink recovers from.
    alive.mailbox().peer_ended(Rank(0), ductile_transport::PeerEnd::Lost);
    let err = hello().await.unwrap_err();
    assert!(matches!(err, TransportError::PeerLost(Rank(0))), "{err}");
    drop(doomed);
    alive.transport().close().await;
}
