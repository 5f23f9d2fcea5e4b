//! Encoding and decoding of every message kind.

use super::*;
use proptest::prelude::*;

fn samples() -> Vec<Msg> {
    let owner = crate::fabric::ofi::Owner { pid: 4321, ns: 0x4000_0836 };
    let region = Region { addr: 0x1000, raw_base: 7, key: vec![1, 2, 3, 4, 5, 6, 7, 8], owner };
    let head = Head { stream: 99, seq: 3 };
    vec![
        Msg::Hello { job: JobId(5), rank: Rank(3), nonce: [9; 32], name: vec![1, 2, 3] },
        Msg::Challenge { listener: Rank(1), dialer_nonce: [1; 32], listener_nonce: [2; 32], mac: [3; 32] },
        Msg::Proof { dialer_nonce: [4; 32], mac: [5; 32] },
        Msg::Accept { dialer_nonce: [6; 32] },
        Msg::Data { head, ctx: Context(4), tag: Tag(0x8000_0001) },
        Msg::Rts { head, ctx: Context(1), tag: Tag(2), len: 1 << 30, id: 17, region: region.clone() },
        Msg::Bulk { head, ctx: Context(1), tag: Tag(2), len: 1 << 30, id: 17, chunk: 8 << 20 },
        Msg::Bye { head },
        Msg::Fin { id: 17 },
        Msg::Query { req: 8, window: WindowId(3) },
        Msg::Desc { req: 8, size: 4096, region },
        Msg::Refusal { req: 8, why: [1; REFUSAL_LEN] },
        Msg::Ping,
        Msg::Pong,
        Msg::Release { req: 8 },
    ]
}

#[test]
fn every_kind_round_trips() {
    for m in samples() {
        let token = if m.kind().is_handshake() { 0 } else { 0x1234 };
        assert_eq!(Msg::decode(&m.encode(0x1234, &[])), Some((token, m)));
    }
    assert_eq!(Msg::decode(&[]), None);
    assert_eq!(Msg::decode(&[99]), None);
}

#[test]
fn data_keeps_its_payload_after_the_header() {
    let m = Msg::Data { head: Head { stream: 1, seq: 2 }, ctx: Context(3), tag: Tag(4) };
    let b = m.encode(9, b"payload");
    assert_eq!(&b[DATA_HEADER..], b"payload");
    assert_eq!(Msg::decode(&b), Some((9, m)));
}

#[test]
fn truncated_or_padded_bodies_are_refused() {
    for m in samples() {
        let b = m.encode(5, &[]);
        if m.kind() != Kind::Data && b.len() > 1 {
            assert_eq!(Msg::decode(&b[..b.len() - 1]), None, "{m:?}");
            let mut long = b.clone();
            long.push(0);
            assert_eq!(Msg::decode(&long), None, "{m:?}");
        }
    }
}

proptest! {
    #[test]
    fn decoding_never_panics(mut b in proptest::collection::vec(any::<u8>(), 0..400), k in 0usize..KINDS.len()) {
        let _ = Msg::decode(&b);
        b.insert(0, KINDS[k] as u8);
        let _ = Msg::decode(&b);
    }
}

#[test]
fn bulk_tags_differ_from_the_message_tag_and_from_each_other() {
    let mut seen = std::collections::HashSet::new();
    for token in [1u64, 0xdead_beef_1234_5678] {
        for id in 0..64 {
            for chunk in 0..64 {
                let t = bulk_tag(token, id, chunk);
                assert_ne!(t, TAG);
                assert_eq!(t & !BULK_HASH, BULK_PREFIX, "{t:#x}");
                assert!(seen.insert(t), "tag {t:#x} repeats (token {token:#x}, id {id}, chunk {chunk})");
            }
        }
    }
}
