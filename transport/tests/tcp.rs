//! What only the TCP backend can be asked: raw sockets against its listener, and its
//! refusal of a wrong key at connection time. Everything else is in `conformance.rs`.

use bytes::Bytes;
use ductile_transport::auth::Identity;
use ductile_transport::matching::{Pattern, SrcMatch, TagMatch};
use ductile_transport::{bind, Context, Endpoint, JobId, JobKey, Mailbox, Rank, Tag, TransportConfig, TransportSetup};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

const T: Duration = Duration::from_secs(5);

fn job(size: u32, key: u8) -> Vec<Endpoint> {
    let eps: Vec<Endpoint> = (0..size)
        .map(|r| {
            let mailbox = Arc::new(Mailbox::new());
            let setup = TransportSetup {
                identity: Identity { job: JobId(77), key: JobKey::from_bytes([key; 32]), rank: Rank(r) },
                size,
                config: TransportConfig::default().handshake_timeout(Duration::from_secs(5)),
                mailbox: mailbox.clone(),
            };
            Endpoint::new(bind("tcp", setup).unwrap(), mailbox, Rank(r))
        })
        .collect();
    let table: Vec<_> = eps.iter().map(|e| e.transport().local_addr()).collect();
    for e in &eps {
        e.transport().set_peers(&table).unwrap();
    }
    eps
}

fn from(src: u32, tag: u32) -> Pattern {
    Pattern { ctx: Context(0), src: SrcMatch::Rank(Rank(src)), tag: TagMatch::Tag(Tag(tag)) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_cannot_send() {
    let good = job(2, 1);
    let bad = job(2, 2);
    bad[0].transport().set_peers(&[bad[0].transport().local_addr(), good[1].transport().local_addr()]).unwrap();
    let err = bad[0].send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"intruder")).await.unwrap_err();
    assert!(err.to_string().contains("authentication"), "{err}");
    good[0].send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"friend")).await.unwrap();
    assert_eq!(good[1].recv(from(0, 1), T).await.unwrap().payload, &b"friend"[..]);
    assert_eq!(good[1].mailbox().queued(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_truncated_and_oversized_clients_are_dropped() {
    let eps = job(2, 1);
    let addr: std::net::SocketAddr = eps[1].transport().local_addr().0.parse().unwrap();
    let mut junk = tokio::net::TcpStream::connect(addr).await.unwrap();
    junk.write_all(&[0xff; 200]).await.unwrap();
    let mut truncated = tokio::net::TcpStream::connect(addr).await.unwrap();
    truncated.write_all(b"DUH1\x01\x02").await.unwrap();
    drop(truncated);
    let mut huge = tokio::net::TcpStream::connect(addr).await.unwrap();
    huge.write_all(&u64::MAX.to_le_bytes()).await.unwrap();
    eps[0].send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"still fine")).await.unwrap();
    assert_eq!(eps[1].recv(from(0, 1), T).await.unwrap().payload, &b"still fine"[..]);
}

/// A peer that holds the key and passed the handshake, then sends a bad frame: only its
/// connection closes. What it sent before the bad frame is delivered, nothing after it,
/// and the other peers carry on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authenticated_peer_sending_a_bad_frame_loses_only_its_connection() {
    use ductile_transport::frame::{FrameHeader, FrameKind};
    use tokio::io::AsyncReadExt;
    let eps = job(3, 1);
    let addr: std::net::SocketAddr = eps[1].transport().local_addr().0.parse().unwrap();
    // Rank 2's identity, on a raw socket (its endpoint stays silent).
    let me = Identity { job: JobId(77), key: JobKey::from_bytes([1; 32]), rank: Rank(2) };
    let data = |src: u32, len: u64| FrameHeader::data(Rank(src), Context(0), Tag(9), len).encode();
    let mut bad_magic = data(2, 1);
    bad_magic[0] ^= 0xff;
    let mut unknown_kind = data(2, 1);
    unknown_kind[3] = 0xee;
    let bye_with_fields = {
        let mut b = FrameHeader::bye(Rank(2)).encode();
        b[12] = 1;
        b
    };
    let get_request_too_long = FrameHeader::get(FrameKind::GetRequest, Rank(2), 1, 1 << 20).encode();
    for (what, bad) in [
        ("bad magic", bad_magic),
        ("unknown kind", unknown_kind),
        ("another rank's frame", data(0, 1)),
        ("a payload over the cap", data(2, u64::MAX)),
        ("a goodbye with fields set", bye_with_fields),
        ("a get request of the wrong length", get_request_too_long),
    ] {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        ductile_transport::auth::dial(&mut s, &me, Rank(1), T).await.unwrap();
        let mut good = data(2, 4).to_vec();
        good.extend_from_slice(b"good");
        s.write_all(&good).await.unwrap();
        s.write_all(&bad).await.unwrap();
        s.write_all(b"more bytes that must not be read").await.unwrap();
        assert_eq!(eps[1].recv(from(2, 9), T).await.unwrap().payload, &b"good"[..], "{what}");
        // The endpoint closes the connection: end of stream or a reset, within T.
        let mut b = [0u8; 64];
        let closed = tokio::time::timeout(T, s.read(&mut b)).await.unwrap_or_else(|_| panic!("{what}: still open"));
        assert!(matches!(closed, Ok(0) | Err(_)), "{what}: {closed:?}");
        eps[0].send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"still fine")).await.unwrap();
        assert_eq!(eps[1].recv(from(0, 1), T).await.unwrap().payload, &b"still fine"[..], "{what}");
        assert_eq!(eps[1].mailbox().queued(), 0, "{what}: nothing else was delivered");
    }
}

/// Many connections into one endpoint, read by an application thread that polls (past
/// two connections it asks which are readable, see the backend's inbound module): every
/// message arrives, in order per source, and peers that close leave nothing behind that
/// the poller keeps tripping over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_thread_reads_every_one_of_many_connections() {
    const N: u32 = 24;
    const ROUNDS: u8 = 3;
    let eps = job(N, 1);
    // Every other rank connects to rank 0 by sending it a first message.
    for (k, e) in eps.iter().enumerate().skip(1) {
        e.send(Rank(0), Context(0), Tag(1), Bytes::from(vec![k as u8; 8])).await.unwrap();
    }
    for k in 1..N {
        assert_eq!(eps[0].recv(from(k, 1), T).await.unwrap().payload[0], k as u8);
    }
    // Rank 0 now polls as a waiting application thread does, while all send at once.
    let ep0 = eps[0].clone();
    let want = (N as usize - 1) * usize::from(ROUNDS);
    let poller = std::thread::spawn(move || {
        ep0.poll_begin();
        let start = std::time::Instant::now();
        while ep0.mailbox().queued() < want && start.elapsed() < T {
            ep0.progress();
        }
        ep0.poll_end(false);
        ep0.mailbox().queued()
    });
    for round in 0..ROUNDS {
        for (k, e) in eps.iter().enumerate().skip(1) {
            e.send(Rank(0), Context(0), Tag(2), Bytes::from(vec![k as u8, round])).await.unwrap();
        }
    }
    assert_eq!(poller.join().unwrap(), want);
    for k in 1..N {
        for round in 0..ROUNDS {
            assert_eq!(eps[0].recv(from(k, 2), T).await.unwrap().payload, &[k as u8, round][..]);
        }
    }
    // Half the peers close; the poller reads their goodbyes and goes on with the rest.
    for e in &eps[1..N as usize / 2] {
        e.transport().close().await;
    }
    let ep0 = eps[0].clone();
    let poller = std::thread::spawn(move || {
        ep0.poll_begin();
        let start = std::time::Instant::now();
        while ep0.mailbox().queued() < 1 && start.elapsed() < T {
            ep0.progress();
        }
        ep0.poll_end(false);
    });
    eps[N as usize - 1].send(Rank(0), Context(0), Tag(3), Bytes::from_static(b"last")).await.unwrap();
    poller.join().unwrap();
    assert_eq!(eps[0].recv(from(N - 1, 3), T).await.unwrap().payload, &b"last"[..]);
    let closed = eps[0].recv(from(1, 3), T).await.unwrap_err();
    assert!(closed.to_string().contains("closed") || closed.to_string().contains("said goodbye"), "{closed}");
    for e in &eps {
        e.transport().close().await;
    }
}
