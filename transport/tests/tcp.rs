//! The TCP backend between endpoints in one process, over loopback.

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
                config: TransportConfig::default().handshake_timeout(Duration::from_millis(500)),
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
async fn messages_of_all_sizes_arrive_in_order() {
    let eps = job(2, 1);
    let sizes = [0usize, 1, 8, 100, 16 * 1024, 16 * 1024 + 1, 65_536, 65_537, 3 << 20];
    for (i, &n) in sizes.iter().enumerate() {
        let body: Vec<u8> = (0..n).map(|k| (k * 7 + i) as u8).collect();
        eps[0].send(Rank(1), Context(0), Tag(9), Bytes::from(body)).await.unwrap();
    }
    for (i, &n) in sizes.iter().enumerate() {
        let e = eps[1].recv(from(0, 9), T).await.unwrap();
        assert_eq!(e.payload.len(), n);
        assert!(e.payload.iter().enumerate().all(|(k, &b)| b == (k * 7 + i) as u8));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_source_any_tag_and_self_sends() {
    let eps = job(3, 1);
    eps[1].send(Rank(0), Context(0), Tag(1), Bytes::from_static(b"one")).await.unwrap();
    eps[2].send(Rank(0), Context(0), Tag(2), Bytes::from_static(b"two")).await.unwrap();
    eps[0].send(Rank(0), Context(0), Tag(3), Bytes::from_static(b"self")).await.unwrap();
    let mut got = Vec::new();
    for _ in 0..3 {
        let any = Pattern { ctx: Context(0), src: SrcMatch::Any, tag: TagMatch::Any };
        let e = eps[0].recv(any, T).await.unwrap();
        got.push((e.src.0, e.tag.0, e.payload));
    }
    got.sort();
    assert_eq!(got[0], (0, 3, Bytes::from_static(b"self")));
    assert_eq!(got[1], (1, 1, Bytes::from_static(b"one")));
    assert_eq!(got[2], (2, 2, Bytes::from_static(b"two")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_names_the_peer_and_loses_nothing() {
    let eps = job(2, 1);
    let err = eps[1].recv(from(0, 4), Duration::from_millis(50)).await.unwrap_err();
    assert!(err.to_string().contains("rank 0"), "{err}");
    eps[0].send(Rank(1), Context(0), Tag(4), Bytes::from_static(b"late")).await.unwrap();
    assert_eq!(eps[1].recv(from(0, 4), T).await.unwrap().payload, &b"late"[..]);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goodbye_and_loss_fail_waiting_receives_at_once() {
    let eps = job(3, 1);
    eps[0].send(Rank(2), Context(0), Tag(1), Bytes::from_static(b"last")).await.unwrap();
    eps[0].transport().close().await;
    assert_eq!(eps[2].recv(from(0, 1), T).await.unwrap().payload, &b"last"[..]);
    let err = eps[2].recv(from(0, 1), T).await.unwrap_err();
    assert!(matches!(err, ductile_transport::TransportError::PeerClosed(Rank(0))), "{err}");
    eps[1].send(Rank(2), Context(0), Tag(1), Bytes::from_static(b"x")).await.unwrap();
    assert_eq!(eps[2].recv(from(1, 1), T).await.unwrap().payload, &b"x"[..]);
}
