//! One conformance suite for every transport backend.
//!
//! Each test is written once, against [`Backend`], and instantiated for every backend
//! this build has by the `conformance!` macro at the bottom: tcp always, quic and
//! fabric (with the `tcp;ofi_rxm` and `shm` providers) when their cargo features are
//! on. Endpoints live in this process and talk over loopback (or shared memory).
//!
//! A peer that "dies" is an endpoint dropped without `close()`: no goodbye is sent and
//! its sockets or queues vanish, as when its process is killed. Multi-process deaths are
//! covered by the launcher tests.

use bytes::Bytes;
use ductile_transport::auth::Identity;
use ductile_transport::matching::{Pattern, SrcMatch, TagMatch};
use ductile_transport::{
    bind, Context, Endpoint, EndpointAddr, JobId, JobKey, Landing, Mailbox, Rank, Tag, TransportConfig, TransportError,
    TransportSetup, WindowId,
};
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(20);

/// A backend as the suite binds it: its registered name and its settings.
#[derive(Clone)]
struct Backend {
    name: &'static str,
    provider: Option<&'static str>,
}

impl Backend {
    fn config(&self) -> TransportConfig {
        let cfg = TransportConfig::default().handshake_timeout(Duration::from_secs(5));
        match self.provider {
            Some(p) => cfg.fabric_provider(p),
            None => cfg,
        }
    }

    fn endpoint(&self, job: u64, key: u8, rank: u32, size: u32) -> Endpoint {
        let mailbox = Arc::new(Mailbox::new());
        let setup = TransportSetup {
            identity: Identity { job: JobId(job), key: JobKey::from_bytes([key; 32]), rank: Rank(rank) },
            size,
            config: self.config(),
            mailbox: mailbox.clone(),
        };
        let t = bind(self.name, setup).unwrap_or_else(|e| panic!("binding {}: {e}", self.name));
        Endpoint::new(t, mailbox, Rank(rank))
    }

    /// `size` endpoints of one job, each knowing the others' addresses.
    fn job(&self, size: u32, key: u8) -> Vec<Endpoint> {
        let eps: Vec<Endpoint> = (0..size).map(|r| self.endpoint(77, key, r, size)).collect();
        let table: Vec<_> = eps.iter().map(|e| e.transport().local_addr()).collect();
        for e in &eps {
            e.transport().set_peers(&table).unwrap();
        }
        eps
    }
}

fn from(src: u32, tag: u32) -> Pattern {
    Pattern { ctx: Context(0), src: SrcMatch::Rank(Rank(src)), tag: TagMatch::Tag(Tag(tag)) }
}

fn pattern(src: u32, k: u32) -> u8 {
    // Position- and message-dependent bytes, so a shifted or swapped buffer shows.
    (src.wrapping_mul(31).wrapping_add(k.wrapping_mul(7)) % 251) as u8
}

fn body(n: usize, seed: u32) -> Bytes {
    Bytes::from((0..n).map(|k| pattern(seed, k as u32)).collect::<Vec<u8>>())
}

fn check(b: &[u8], n: usize, seed: u32) {
    assert_eq!(b.len(), n, "length of message {seed}");
    if let Some(k) = (0..n).find(|&k| b[k] != pattern(seed, k as u32)) {
        panic!("message {seed} of {n} bytes differs at byte {k}");
    }
}

async fn sizes_from_zero_to_256_mib_arrive_intact(b: Backend) {
    let eps = b.job(2, 1);
    let sizes = [0usize, 1, 8, 100, 16 * 1024, 65_537, 1 << 20, 4 << 20, 256 << 20];
    let recv = eps[1].clone();
    let reader = tokio::spawn(async move {
        for (i, &n) in sizes.iter().enumerate() {
            let e = recv.recv(from(0, 9), T).await.unwrap();
            check(&e.payload, n, i as u32);
        }
    });
    for (i, &n) in sizes.iter().enumerate() {
        eps[0].send(Rank(1), Context(0), Tag(9), body(n, i as u32)).await.unwrap();
    }
    reader.await.unwrap();
    close_all(&eps).await;
}

async fn large_messages_fanning_out_to_several_peers_arrive_intact(b: Backend) {
    // One sender, three receivers, two large messages each, all in flight at once (over
    // fabric shm these go as bulk payloads); one of them received in place.
    let eps = b.job(4, 1);
    // Connected first, so that the large messages leave together.
    for r in 1..4u32 {
        eps[0].send(Rank(r), Context(0), Tag(3), Bytes::from_static(b"hi")).await.unwrap();
        assert_eq!(eps[r as usize].recv(from(0, 3), T).await.unwrap().payload, &b"hi"[..]);
    }
    let n = 3 << 20;
    let landing = Landing::new(vec![0; n / 8], n).unwrap();
    let into = eps[3].post_into(from(0, 1), landing.part(0..n).unwrap()).unwrap();
    let mut sends = Vec::new();
    for r in 1..4u32 {
        for k in 0..2u32 {
            let ep = eps[0].clone();
            let msg = body(n + k as usize, 10 * r + k);
            sends.push(tokio::spawn(async move { ep.send(Rank(r), Context(0), Tag(k + 1), msg).await }));
        }
    }
    let mut recvs = Vec::new();
    for (r, k) in [(1u32, 0u32), (1, 1), (2, 0), (2, 1), (3, 1)] {
        let ep = eps[r as usize].clone();
        recvs.push(tokio::spawn(async move { (r, k, ep.recv(from(0, k + 1), T).await) }));
    }
    for s in sends {
        s.await.unwrap().unwrap();
    }
    for h in recvs {
        let (r, k, e) = h.await.unwrap();
        check(&e.unwrap().payload, n + k as usize, 10 * r + k);
    }
    check(into.await.unwrap().part.as_slice(), n, 30);
    close_all(&eps).await;
}

async fn order_holds_per_source_and_tag(b: Backend) {
    let eps = b.job(3, 1);
    // Two sources, two tags each, interleaved; receives by (source, tag) see each
    // stream in the order sent, whatever the order the streams are drained in.
    for i in 0..50u32 {
        for src in [1usize, 2] {
            for tag in [5u32, 6] {
                let msg = Bytes::from(format!("{src}/{tag}/{i}"));
                eps[src].send(Rank(0), Context(0), Tag(tag), msg).await.unwrap();
            }
        }
    }
    for (src, tag) in [(2u32, 6u32), (1, 5), (2, 5), (1, 6)] {
        for i in 0..50u32 {
            let e = eps[0].recv(from(src, tag), T).await.unwrap();
            assert_eq!(e.payload, Bytes::from(format!("{src}/{tag}/{i}")));
        }
    }
    assert_eq!(eps[0].mailbox().queued(), 0);
    close_all(&eps).await;
}

async fn wildcards_contexts_and_self_sends_match(b: Backend) {
    let eps = b.job(3, 1);
    eps[1].send(Rank(0), Context(0), Tag(1), Bytes::from_static(b"one")).await.unwrap();
    eps[2].send(Rank(0), Context(0), Tag(2), Bytes::from_static(b"two")).await.unwrap();
    eps[0].send(Rank(0), Context(0), Tag(3), Bytes::from_static(b"self")).await.unwrap();
    eps[1].send(Rank(0), Context(4), Tag(1), Bytes::from_static(b"other context")).await.unwrap();
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
    let ctx4 = Pattern { ctx: Context(4), src: SrcMatch::Any, tag: TagMatch::Any };
    assert_eq!(eps[0].recv(ctx4, T).await.unwrap().payload, &b"other context"[..]);
    close_all(&eps).await;
}

async fn a_timeout_names_the_peer_and_loses_nothing(b: Backend) {
    let eps = b.job(2, 1);
    let err = eps[1].recv(from(0, 4), Duration::from_millis(50)).await.unwrap_err();
    assert!(err.to_string().contains("rank 0"), "{err}");
    eps[0].send(Rank(1), Context(0), Tag(4), Bytes::from_static(b"late")).await.unwrap();
    assert_eq!(eps[1].recv(from(0, 4), T).await.unwrap().payload, &b"late"[..]);
    // A receive dropped after its message came gives it back: it keeps its place
    // ahead of a later one. A message on another tag sent after both, which cannot
    // overtake them, says they have come.
    let pending = eps[1].post(from(0, 5)).unwrap();
    eps[0].send(Rank(1), Context(0), Tag(5), Bytes::from_static(b"first")).await.unwrap();
    eps[0].send(Rank(1), Context(0), Tag(5), Bytes::from_static(b"second")).await.unwrap();
    eps[0].send(Rank(1), Context(0), Tag(8), Bytes::from_static(b"marker")).await.unwrap();
    assert_eq!(eps[1].recv(from(0, 8), T).await.unwrap().payload, &b"marker"[..]);
    drop(pending);
    assert_eq!(eps[1].recv(from(0, 5), T).await.unwrap().payload, &b"first"[..]);
    assert_eq!(eps[1].recv(from(0, 5), T).await.unwrap().payload, &b"second"[..]);
    // The same with a large message (in pieces over quic), surely answered before the
    // receive is dropped: a message on another tag sent after it, which cannot overtake
    // it, has come.
    let n = 1 << 20;
    let pending = eps[1].post(from(0, 6)).unwrap();
    eps[0].send(Rank(1), Context(0), Tag(6), body(n, 1)).await.unwrap();
    eps[0].send(Rank(1), Context(0), Tag(6), Bytes::from_static(b"after")).await.unwrap();
    eps[0].send(Rank(1), Context(0), Tag(7), Bytes::from_static(b"marker")).await.unwrap();
    assert_eq!(eps[1].recv(from(0, 7), T).await.unwrap().payload, &b"marker"[..]);
    drop(pending);
    check(&eps[1].recv(from(0, 6), T).await.unwrap().payload, n, 1);
    assert_eq!(eps[1].recv(from(0, 6), T).await.unwrap().payload, &b"after"[..]);
    close_all(&eps).await;
}

async fn a_wrong_key_delivers_nothing(b: Backend) {
    let good = b.job(2, 1);
    let intruder = b.endpoint(77, 2, 0, 2);
    let table = [intruder.transport().local_addr(), good[1].transport().local_addr()];
    intruder.transport().set_peers(&table).unwrap();
    // Connection-oriented backends refuse the send; connectionless ones may accept it
    // locally, but the message must never be delivered.
    let sent = intruder.send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"intruder")).await;
    if let Err(e) = &sent {
        let text = e.to_string();
        assert!(text.contains("authentication") || text.contains("key"), "{text}");
    }
    good[0].send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"friend")).await.unwrap();
    assert_eq!(good[1].recv(from(0, 1), T).await.unwrap().payload, &b"friend"[..]);
    let stray = good[1].recv(from(0, 1), Duration::from_millis(300)).await;
    assert!(stray.is_err(), "a message from a wrong key was delivered");
    assert_eq!(good[1].mailbox().queued(), 0);
    close_all(&good).await;
    intruder.transport().close().await;
}

async fn goodbye_fails_waiting_receives_at_once(b: Backend) {
    let eps = b.job(3, 1);
    eps[0].send(Rank(2), Context(0), Tag(1), Bytes::from_static(b"last")).await.unwrap();
    eps[0].transport().close().await;
    assert_eq!(eps[2].recv(from(0, 1), T).await.unwrap().payload, &b"last"[..]);
    let err = eps[2].recv(from(0, 1), T).await.unwrap_err();
    assert!(matches!(err, TransportError::PeerClosed(Rank(0))), "{err}");
    eps[1].send(Rank(2), Context(0), Tag(1), Bytes::from_static(b"x")).await.unwrap();
    assert_eq!(eps[2].recv(from(1, 1), T).await.unwrap().payload, &b"x"[..]);
    close_all(&eps[1..]).await;
}

async fn a_dead_peer_is_an_error_not_a_hang(b: Backend) {
    let mut eps = b.job(3, 1);
    eps[0].send(Rank(2), Context(0), Tag(1), Bytes::from_static(b"before")).await.unwrap();
    assert_eq!(eps[2].recv(from(0, 1), T).await.unwrap().payload, &b"before"[..]);
    // Rank 1 and the peer that dies are connected both ways, so that rank 1 has seen
    // the connection from it end before it asks for its window.
    eps[1].send(Rank(0), Context(0), Tag(1), Bytes::from_static(b"hello")).await.unwrap();
    assert_eq!(eps[0].recv(from(1, 1), T).await.unwrap().payload, &b"hello"[..]);
    eps[0].send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"hello")).await.unwrap();
    assert_eq!(eps[1].recv(from(0, 1), T).await.unwrap().payload, &b"hello"[..]);
    let window = eps[0].expose(body(1 << 20, 3)).unwrap();
    drop(eps.remove(0));
    let (one, two) = (&eps[0], &eps[1]);
    // A receive from the dead peer and a get of its window end in an error naming it,
    // before the wait's own timeout: also a get started after its end was seen (over
    // tcp, its request went into a socket nobody read, and it waited for ever).
    let limit = Duration::from_secs(15);
    let started = std::time::Instant::now();
    for ep in [two, one] {
        let err = ep.recv(from(0, 1), limit).await.unwrap_err();
        assert!(err.to_string().contains("rank 0"), "{err}");
        assert!(!matches!(err, TransportError::Timeout { .. }), "{err}");
    }
    let (seen, took) = (started.elapsed(), std::time::Instant::now());
    let err = one.get(Rank(0), window, 0, 1 << 20, limit).await.unwrap_err();
    assert!(err.to_string().contains("rank 0") && !matches!(err, TransportError::Timeout { .. }), "{err}");
    let landing = Landing::new(vec![0; 1 << 17], 1 << 20).unwrap();
    let part = landing.part(0..1 << 20).unwrap();
    let err = one.get_into(Rank(0), window, 0, part, limit).await.unwrap_err();
    assert!(err.to_string().contains("rank 0") && !matches!(err, TransportError::Timeout { .. }), "{err}");
    // Once the end is seen, a get fails at once.
    assert!(
        took.elapsed() < Duration::from_secs(3),
        "the gets took {:?} (the end seen after {seen:?})",
        took.elapsed()
    );
    assert!(seen < 2 * limit, "the end seen after {seen:?}");
    // The survivors carry on.
    one.send(Rank(2), Context(0), Tag(1), Bytes::from_static(b"alive")).await.unwrap();
    assert_eq!(two.recv(from(1, 1), T).await.unwrap().payload, &b"alive"[..]);
    close_all(&eps).await;
}

async fn a_dead_peer_holds_up_no_other(b: Backend) {
    // A peer dies while another reads a large window of it: the reader goes on talking
    // with the third meanwhile, for longer than any backend waits on a silent peer, and
    // neither takes the other for lost; the get ends by itself. (Over tcp the answer
    // under way went on after the drop, holding its connection open with nothing more
    // to send, and the get waited out its timeout.)
    let mut eps = b.job(3, 1);
    for (a, z) in [(0usize, 1u32), (1, 0), (1, 2), (2, 1)] {
        eps[a].send(Rank(z), Context(0), Tag(1), Bytes::from_static(b"hello")).await.unwrap();
        assert_eq!(eps[z as usize].recv(from(a as u32, 1), T).await.unwrap().payload, &b"hello"[..]);
    }
    let n = 64 << 20;
    let window = eps[0].expose(body(n, 4)).unwrap();
    let dead = eps.remove(0);
    let reader = eps[0].clone();
    let get = tokio::spawn(async move { reader.get(Rank(0), window, 0, n as u64, T).await });
    tokio::time::sleep(Duration::from_millis(2)).await;
    drop(dead);
    let (one, two) = (&eps[0], &eps[1]);
    let until = std::time::Instant::now() + Duration::from_secs(7);
    let mut k = 100;
    while std::time::Instant::now() < until {
        let m = Bytes::from(format!("ping {k}"));
        one.send(Rank(2), Context(0), Tag(k), m.clone()).await.unwrap();
        assert_eq!(two.recv(from(1, k), T).await.unwrap_or_else(|e| panic!("message {k}: {e}")).payload, m);
        two.send(Rank(1), Context(0), Tag(k), m.clone()).await.unwrap();
        assert_eq!(one.recv(from(2, k), T).await.unwrap_or_else(|e| panic!("answer {k}: {e}")).payload, m);
        tokio::time::sleep(Duration::from_millis(50)).await;
        k += 1;
    }
    // The get ends: whole if it finished before the peer died, or in an error naming it.
    match get.await.unwrap() {
        Ok(got) => check(&got, n, 4),
        Err(e) => assert!(e.to_string().contains("rank 0") && !matches!(e, TransportError::Timeout { .. }), "{e}"),
    }
    close_all(&eps).await;
}

async fn flushed_messages_outlive_their_sender(b: Backend) {
    // A sender flushes, then dies (dropped without a goodbye) before its peers read a
    // byte: everything it sent still arrives. A send alone completes once the backend
    // has the bytes, which may still be in the sender's process (tcp's queue, quinn's
    // buffers, fabric's rendezvous payloads).
    let mut eps = b.job(3, 1);
    let sizes = [8usize, 100_000, 4 << 20, 16 << 20, 16 << 20];
    for r in 1..3u32 {
        for (k, &n) in sizes.iter().enumerate() {
            eps[0].send(Rank(r), Context(0), Tag(k as u32), body(n, 10 * r + k as u32)).await.unwrap();
        }
    }
    eps[0].flush(T).await.unwrap();
    drop(eps.remove(0));
    for r in 1..3u32 {
        for (k, &n) in sizes.iter().enumerate() {
            let e = eps[r as usize - 1].recv(from(0, k as u32), T).await.unwrap();
            check(&e.payload, n, 10 * r + k as u32);
        }
    }
    // Nothing sent since: a flush has nothing to wait for.
    let started = std::time::Instant::now();
    eps[0].flush(T).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
    close_all(&eps).await;
}

async fn gets_read_exact_ranges_of_exposed_windows(b: Backend) {
    let eps = b.job(3, 1);
    assert!(eps[0].transport().capabilities().one_sided);
    let n = 4 << 20;
    let region = body(n, 11);
    let w = eps[1].expose(region).unwrap();
    let empty = eps[1].expose(Bytes::new()).unwrap();
    for (offset, len) in [(0usize, n), (0, 0), (1, 7), (n - 1, 1), (12_345, 1 << 20), (n, 0)] {
        for reader in [0usize, 2, 1] {
            let got = eps[reader].get(Rank(1), w, offset as u64, len as u64, T).await.unwrap();
            assert_eq!(got.len(), len);
            let want = body(n, 11);
            assert!(got[..] == want[offset..offset + len], "get {offset}+{len} by {reader}");
        }
    }
    assert_eq!(eps[0].get(Rank(1), empty, 0, 0, T).await.unwrap().len(), 0);
    // Many gets in flight at once, from two readers, each completed with its own bytes.
    let mut handles = Vec::new();
    for reader in [0usize, 2] {
        for k in 0..16u64 {
            let ep = eps[reader].clone();
            handles.push(tokio::spawn(async move { (k, ep.get(Rank(1), w, k * 4096, 4096, T).await) }));
        }
    }
    let want = body(n, 11);
    for h in handles {
        let (k, got) = h.await.unwrap();
        let k = k as usize;
        assert!(got.unwrap()[..] == want[k * 4096..(k + 1) * 4096]);
    }
    close_all(&eps).await;
}

async fn gets_land_in_place(b: Backend) {
    let eps = b.job(3, 1);
    let n = 3 << 20;
    let w = eps[1].expose(body(n, 5)).unwrap();
    let want = body(n, 5);
    // Reads of every size, from a peer and from the owner itself, into one landing laid
    // out as the window; 1 MiB goes past the TCP reader's small-frame buffer.
    let ranges = [0..7, 7..7, 7..4096, 4096..(1 << 20) + 4096, (1 << 20) + 4096..2 << 20, (2 << 20)..n];
    for reader in [0usize, 1] {
        let landing = Landing::new(vec![0; n / 8], n).unwrap();
        let gets: Vec<_> = ranges
            .iter()
            .map(|r| {
                let (part, ep) = (landing.part(r.clone()).unwrap(), eps[reader].clone());
                tokio::spawn(async move { ep.get_into(Rank(1), w, part.range().start as u64, part, T).await })
            })
            .collect();
        for get in gets {
            let part = get.await.unwrap().unwrap();
            assert!(part.as_slice() == &want[part.range()], "{:?} read by {reader}", part.range());
        }
        let words = Landing::into_words(landing).unwrap_or_else(|_| panic!("a part is still out"));
        let got: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        assert!(got == want[..], "the whole landing read by {reader}");
    }
    // A refused get gives its part's range back.
    let landing = Landing::new(vec![0; 2], 16).unwrap();
    let err = eps[0].get_into(Rank(1), w, n as u64 - 8, landing.part(0..16).unwrap(), T).await.unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
    let part = eps[2].get_into(Rank(1), w, 100, landing.part(0..16).unwrap(), T).await.unwrap();
    assert_eq!(part.as_slice(), &want[100..116]);
    close_all(&eps).await;
}

async fn receives_land_in_place(b: Backend) {
    let eps = b.job(2, 1);
    let n = 1 << 20;
    let landing = Landing::new(vec![0; 3 * n / 8], 3 * n).unwrap();
    let part = |r: std::ops::Range<usize>| landing.part(r).unwrap();
    // Posted before the messages arrive (read in place by the backends that can), in
    // order with an ordinary receive of another tag.
    let first = eps[1].post_into(from(0, 4), part(0..n)).unwrap();
    let second = eps[1].post_into(from(0, 4), part(n..2 * n)).unwrap();
    let plain = eps[1].post(from(0, 5)).unwrap();
    eps[0].send(Rank(1), Context(0), Tag(4), body(n, 1)).await.unwrap();
    eps[0].send(Rank(1), Context(0), Tag(5), body(10, 9)).await.unwrap();
    eps[0].send(Rank(1), Context(0), Tag(4), body(n, 2)).await.unwrap();
    check(first.await.unwrap().part.as_slice(), n, 1);
    check(second.await.unwrap().part.as_slice(), n, 2);
    check(&plain.await.unwrap().payload, 10, 9);
    // A message queued before its receive is copied in.
    eps[0].send(Rank(1), Context(0), Tag(6), body(100, 3)).await.unwrap();
    let got = eps[1].recv_into(from(0, 6), part(2 * n..2 * n + 100), T).await.unwrap();
    check(got.part.as_slice(), 100, 3);
    drop(got);
    // So is a large one (quic delivers it in the pieces it read); the small message
    // after it, which it cannot overtake, shows it has arrived.
    eps[0].send(Rank(1), Context(0), Tag(8), body(n, 6)).await.unwrap();
    eps[0].send(Rank(1), Context(0), Tag(9), body(10, 7)).await.unwrap();
    check(&eps[1].recv(from(0, 9), T).await.unwrap().payload, 10, 7);
    let got = eps[1].recv_into(from(0, 8), part(2 * n..3 * n), T).await.unwrap();
    check(got.part.as_slice(), n, 6);
    drop(got);
    // A message of another size fails its receive and is consumed; the next one lands.
    let wrong = eps[1].post_into(from(0, 7), part(2 * n..3 * n)).unwrap();
    eps[0].send(Rank(1), Context(0), Tag(7), body(n / 2, 4)).await.unwrap();
    let err = wrong.await.unwrap_err();
    assert!(matches!(err, TransportError::SizeMismatch { .. }), "{err}");
    eps[0].send(Rank(1), Context(0), Tag(7), body(n, 5)).await.unwrap();
    let got = eps[1].recv_into(from(0, 7), part(2 * n..3 * n), T).await.unwrap();
    check(got.part.as_slice(), n, 5);
    close_all(&eps).await;
}

async fn gets_outside_a_window_are_refused_clearly(b: Backend) {
    let eps = b.job(2, 1);
    let w = eps[1].expose(body(1000, 1)).unwrap();
    let err = eps[0].get(Rank(1), w, 999, 2, T).await.unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
    let err = eps[0].get(Rank(1), w, u64::MAX, 2, T).await.unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
    let err = eps[0].get(Rank(1), WindowId(w.0 + 100), 0, 1, T).await.unwrap_err();
    assert!(err.to_string().contains("not exposed"), "{err}");
    eps[1].withdraw(w).unwrap();
    let err = eps[0].get(Rank(1), w, 0, 1, T).await.unwrap_err();
    assert!(err.to_string().contains("not exposed"), "{err}");
    assert!(eps[1].withdraw(w).is_err());
    // The endpoint still works after the refusals.
    let w2 = eps[1].expose(body(10, 2)).unwrap();
    check(&eps[0].get(Rank(1), w2, 0, 10, T).await.unwrap(), 10, 2);
    close_all(&eps).await;
}

async fn addresses_that_do_not_parse_are_refused_naming_the_transport(b: Backend) {
    let eps = b.job(2, 1);
    let t = eps[0].transport();
    let good = [t.local_addr(), eps[1].transport().local_addr()];
    for junk in ["not an address", "300.0.0.1:1", "ofi:zz", "127.0.0.1:80#zz"] {
        let err = t.set_peers(&[good[0].clone(), EndpointAddr(junk.into())]).unwrap_err();
        assert!(matches!(err, TransportError::BadAddress { peer: Rank(1), .. }), "{} {junk}: {err}", b.name);
        assert!(err.to_string().starts_with(b.name), "{} {junk}: {err}", b.name);
    }
    // The table in place is kept: messages still reach rank 1.
    t.set_peers(&good).unwrap();
    eps[0].send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"still")).await.unwrap();
    assert_eq!(eps[1].recv(from(0, 1), T).await.unwrap().payload, &b"still"[..]);
    close_all(&eps).await;
}

async fn close_all(eps: &[Endpoint]) {
    for e in eps {
        e.transport().close().await;
    }
}

macro_rules! conformance {
    ($backend:ident, $name:expr, $provider:expr) => {
        mod $backend {
            use super::Backend;

            fn backend() -> Backend {
                Backend { name: $name, provider: $provider }
            }

            macro_rules! case {
                ($test:ident) => {
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $test() {
                        super::$test(backend()).await;
                    }
                };
            }

            case!(sizes_from_zero_to_256_mib_arrive_intact);
            case!(large_messages_fanning_out_to_several_peers_arrive_intact);
            case!(order_holds_per_source_and_tag);
            case!(wildcards_contexts_and_self_sends_match);
            case!(a_timeout_names_the_peer_and_loses_nothing);
            case!(a_wrong_key_delivers_nothing);
            case!(goodbye_fails_waiting_receives_at_once);
            case!(a_dead_peer_is_an_error_not_a_hang);
            case!(a_dead_peer_holds_up_no_other);
            case!(flushed_messages_outlive_their_sender);
            case!(gets_read_exact_ranges_of_exposed_windows);
            case!(gets_land_in_place);
            case!(receives_land_in_place);
            case!(gets_outside_a_window_are_refused_clearly);
            case!(addresses_that_do_not_parse_are_refused_naming_the_transport);
        }
    };
}

conformance!(tcp, "tcp", None);
#[cfg(feature = "quic")]
conformance!(quic, "quic", None);
#[cfg(feature = "fabric")]
conformance!(fabric_tcp, "fabric", Some("tcp;ofi_rxm"));
#[cfg(feature = "fabric")]
conformance!(fabric_shm, "fabric", Some("shm"));
