//! What only the libfabric backend can be asked: provider selection and its errors.
//! Everything else is in `conformance.rs`.
#![cfg(feature = "fabric")]

use bytes::Bytes;
use ductile_transport::auth::Identity;
use ductile_transport::matching::{Pattern, SrcMatch, TagMatch};
use ductile_transport::{
    bind, Context, Endpoint, EndpointAddr, JobId, JobKey, Mailbox, Rank, Tag, TransportConfig, TransportError,
    TransportSetup,
};
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

fn setup(provider: &str, rank: u32) -> (TransportSetup, Arc<Mailbox>) {
    let mailbox = Arc::new(Mailbox::new());
    let setup = TransportSetup {
        identity: Identity { job: JobId(5), key: JobKey::from_bytes([3; 32]), rank: Rank(rank) },
        size: 2,
        config: TransportConfig::default().handshake_timeout(Duration::from_secs(5)).fabric_provider(provider),
        mailbox: mailbox.clone(),
    };
    (setup, mailbox)
}

fn job(provider: &str) -> Vec<Endpoint> {
    let eps: Vec<Endpoint> = (0..2)
        .map(|r| {
            let (s, m) = setup(provider, r);
            Endpoint::new(bind("fabric", s).unwrap(), m, Rank(r))
        })
        .collect();
    let table: Vec<_> = eps.iter().map(|e| e.transport().local_addr()).collect();
    for e in &eps {
        e.transport().set_peers(&table).unwrap();
    }
    eps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_provider_is_a_clear_bind_error() {
    let (s, _) = setup("no-such-provider", 0);
    let err = bind("fabric", s).err().expect("binding an unknown provider");
    let text = err.to_string();
    assert!(matches!(err, TransportError::Bind { .. }), "{text}");
    assert!(text.contains("no-such-provider"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn junk_addresses_are_refused() {
    for provider in ["tcp;ofi_rxm", "shm"] {
        let eps = job(provider);
        let t = eps[0].transport();
        for junk in ["127.0.0.1:80", "ofi:", "ofi:zz", "ofi:123"] {
            let table = [t.local_addr(), EndpointAddr(junk.into())];
            let err = t.set_peers(&table).unwrap_err();
            assert!(matches!(err, TransportError::BadAddress { .. }), "{provider} {junk}: {err}");
        }
        // A departed endpoint ("") is not an error; sending to it is.
        t.set_peers(&[t.local_addr(), EndpointAddr(String::new())]).unwrap();
        let err = eps[0].send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"x")).await.unwrap_err();
        assert!(err.to_string().contains("rank 1"), "{err}");
        for e in &eps {
            e.transport().close().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_crosses_each_provider() {
    for provider in ["tcp;ofi_rxm", "shm"] {
        let eps = job(provider);
        eps[0].send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"hello")).await.unwrap();
        let pattern = Pattern { ctx: Context(0), src: SrcMatch::Rank(Rank(0)), tag: TagMatch::Tag(Tag(1)) };
        assert_eq!(eps[1].recv(pattern, T).await.unwrap().payload, &b"hello"[..], "{provider}");
        for e in &eps {
            e.transport().close().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_not_in_the_table_is_authenticated_and_answered() {
    for provider in ["tcp;ofi_rxm", "shm"] {
        // Ranks 0 and 1 know only each other; rank 2 joins later, knowing them.
        let eps = job(provider);
        let (s, m) = setup(provider, 2);
        let joiner = Endpoint::new(bind("fabric", s).unwrap(), m, Rank(2));
        let table: Vec<_> = [&eps[0], &eps[1], &joiner].iter().map(|e| e.transport().local_addr()).collect();
        joiner.transport().set_peers(&table).unwrap();
        joiner.send(Rank(0), Context(0), Tag(3), Bytes::from_static(b"hi")).await.unwrap();
        let from_joiner = Pattern { ctx: Context(0), src: SrcMatch::Rank(Rank(2)), tag: TagMatch::Tag(Tag(3)) };
        assert_eq!(eps[0].recv(from_joiner, T).await.unwrap().payload, &b"hi"[..], "{provider}");
        // Rank 0 learnt where the joiner is from its handshake, and can answer it.
        eps[0].send(Rank(2), Context(0), Tag(4), Bytes::from_static(b"welcome")).await.unwrap();
        let from_zero = Pattern { ctx: Context(0), src: SrcMatch::Rank(Rank(0)), tag: TagMatch::Tag(Tag(4)) };
        assert_eq!(joiner.recv(from_zero, T).await.unwrap().payload, &b"welcome"[..], "{provider}");
        for e in eps.iter().chain([&joiner]) {
            e.transport().close().await;
        }
    }
}

/// Set in the child process of `a_dead_process_region_with_our_pid_is_replaced`.
const CHILD: &str = "DUCTILE_TEST_STALE_REGION_CHILD";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_process_region_with_our_pid_is_replaced() {
    // libfabric 1.17 crashed opening an shm endpoint over a region a dead process with
    // the same pid left in /dev/shm. The bind must be this process's first shm bind, so
    // the case runs in a child process of its own (this test binary, this test only).
    if std::env::var_os(CHILD).is_some() {
        // libfabric names a region `<pid>:<uid>:<endpoint>`.
        // SAFETY: getuid cannot fail.
        let stale = format!("/dev/shm/{}:{}:0", std::process::id(), unsafe { libc::getuid() });
        std::fs::write(&stale, vec![0xa5u8; 4096]).unwrap();
        let eps = job("shm");
        eps[0].send(Rank(1), Context(0), Tag(1), Bytes::from_static(b"over")).await.unwrap();
        let pattern = Pattern { ctx: Context(0), src: SrcMatch::Rank(Rank(0)), tag: TagMatch::Tag(Tag(1)) };
        assert_eq!(eps[1].recv(pattern, T).await.unwrap().payload, &b"over"[..]);
        // The stale bytes are gone: the region there now is the endpoint's own.
        let now = std::fs::read(&stale).unwrap_or_default();
        assert!(now.len() != 4096 || now.iter().any(|&b| b != 0xa5), "the stale region is still there");
        // Regions this process has mapped are never taken for stale ones.
        assert_eq!(ductile_transport::shm_regions::remove_own_stale(), 0);
        assert!(std::path::Path::new(&stale).exists());
        for e in &eps {
            e.transport().close().await;
        }
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "a_dead_process_region_with_our_pid_is_replaced", "--nocapture"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the child failed: {text}");
    assert!(text.contains("1 passed"), "{text}");
}
