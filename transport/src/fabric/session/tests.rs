//! The handshake state machine, driven by hand between two or three parties.

use super::*;
use crate::ids::{JobId, JobKey};

fn me(rank: u32, key: u8) -> Identity {
    Identity { job: JobId(7), key: JobKey::from_bytes([key; 32]), rank: Rank(rank) }
}

/// Two parties that know each other: `d` (rank 1) at address 10 as `l` (rank 0) sees
/// it, `l` at 20 as `d` sees it.
fn pair(dkey: u8, lkey: u8) -> (Sessions, Sessions) {
    let (mut d, mut l) = (Sessions::new(me(1, dkey)), Sessions::new(me(0, lkey)));
    d.route(Rank(0), Some(20));
    l.route(Rank(1), Some(10));
    (d, l)
}

fn start(d: &mut Sessions, now: Instant) -> (Msg, oneshot::Receiver<DialResult>) {
    match d.dial(Rank(0), b"d-name", || now).unwrap() {
        Dial::Start(20, hello, rx) => (hello, rx),
        _ => panic!("expected a new dial to address 20"),
    }
}

#[test]
fn a_full_handshake_agrees_on_tokens_both_ways() {
    let now = Instant::now();
    let (mut d, mut l) = pair(3, 3);
    let (hello, mut rx) = start(&mut d, now);
    assert!(matches!(d.dial(Rank(0), b"d-name", || now).unwrap(), Dial::Wait(_)));
    let challenge = l.on_hello(10, false, &hello, now).unwrap();
    let (to_l, proof) = d.on_challenge(&challenge, now).expect("a proof");
    assert_eq!(to_l, 20);
    let (rank, to_d, accept) = l.on_proof(&proof, now).unwrap().unwrap();
    assert_eq!((rank, to_d), (Rank(1), 10));
    // The listener may send at once; its token is one the dialer accepts.
    let (l_to_d, head) = l.next_head(Rank(1)).unwrap();
    assert_eq!((l_to_d.fi_addr, head.seq), (10, 0));
    assert_eq!(d.heard(l_to_d.token), Some(Rank(0)));
    assert!(d.next_head(Rank(0)).is_none(), "the dialer waits for the acceptance");
    assert_eq!(d.on_accept(&accept), Some(Rank(0)));
    assert!(matches!(rx.try_recv(), Ok(Ok(()))));
    let (d_to_l, head) = d.next_head(Rank(0)).unwrap();
    assert_eq!((d_to_l.fi_addr, head.seq), (20, 0));
    assert_eq!(l.heard(d_to_l.token), Some(Rank(1)));
    assert_ne!(d_to_l.token, l_to_d.token);
    assert_eq!(l.heard(d_to_l.token ^ 1), None, "a guessed token names nobody");
    assert!(matches!(d.dial(Rank(0), b"d-name", || now).unwrap(), Dial::Ready));
}

#[test]
fn a_send_at_once_takes_a_sequence_number_only_when_it_sent() {
    let now = Instant::now();
    let (mut d, mut l) = pair(3, 3);
    assert!(!l.send_next(Rank(1), |_, _| panic!("no stream yet")));
    let (hello, _rx) = start(&mut d, now);
    let challenge = l.on_hello(10, false, &hello, now).unwrap();
    let (_, proof) = d.on_challenge(&challenge, now).expect("a proof");
    l.on_proof(&proof, now).unwrap().unwrap();
    let mut seen = Vec::new();
    assert!(!l.send_next(Rank(1), |to, head| {
        seen.push((to.fi_addr, head.seq));
        false
    }));
    assert!(l.send_next(Rank(1), |to, head| {
        seen.push((to.fi_addr, head.seq));
        true
    }));
    assert_eq!(seen, [(10, 0), (10, 0)], "a declined head is offered again");
    assert_eq!(l.next_head(Rank(1)).unwrap().1.seq, 1);
}

#[test]
fn a_wrong_key_fails_on_both_sides() {
    let now = Instant::now();
    let (mut d, mut l) = pair(3, 4);
    let (hello, mut rx) = start(&mut d, now);
    let challenge = l.on_hello(10, true, &hello, now).unwrap();
    assert!(d.on_challenge(&challenge, now).is_none());
    assert!(matches!(rx.try_recv(), Ok(Err(TransportError::Auth { source: AuthError::BadProof, .. }))));
    // A proof made with another key is refused; the inserted address is handed back.
    let Msg::Challenge { dialer_nonce, listener_nonce, .. } = challenge else { panic!() };
    let mac = dialer_mac(&JobKey::from_bytes([3; 32]), JobId(7), &listener_nonce, &dialer_nonce, Rank(1), Rank(0));
    assert_eq!(l.on_proof(&Msg::Proof { dialer_nonce, mac }, now), Some(Err((Rank(1), 10, true))));
    assert!(l.next_head(Rank(1)).is_none());
}

#[test]
fn replayed_or_unknown_handshake_messages_do_nothing() {
    let now = Instant::now();
    let (mut d, mut l) = pair(3, 3);
    let (hello, _rx) = start(&mut d, now);
    let challenge = l.on_hello(10, false, &hello, now).unwrap();
    let (_, proof) = d.on_challenge(&challenge, now).unwrap();
    assert!(d.on_challenge(&challenge, now).is_none(), "a replayed challenge");
    assert!(l.on_proof(&proof, now).unwrap().is_ok());
    assert!(l.on_proof(&proof, now).is_none(), "a replayed proof");
    assert!(d.on_accept(&Msg::Accept { dialer_nonce: [9; 32] }).is_none(), "an unknown acceptance");
}

#[test]
fn hellos_of_other_jobs_and_bad_ranks_are_refused_and_joiners_learnt() {
    let now = Instant::now();
    let mut l = Sessions::new(me(0, 3));
    let hello = |job, rank| Msg::Hello { job: JobId(job), rank: Rank(rank), nonce: [1; 32], name: vec![] };
    assert_eq!(l.on_hello(1, true, &hello(8, 1), now).err(), Some(AuthError::WrongJob(8)));
    assert_eq!(l.on_hello(1, true, &hello(7, 0), now).err(), Some(AuthError::UnknownRank(Rank(0))));
    let too_big = Rank::MAX_ID + 1;
    assert_eq!(l.on_hello(1, true, &hello(7, too_big), now).err(), Some(AuthError::UnknownRank(Rank(too_big))));
    // A joiner (no route yet) that proves the key gets a route and a stream.
    let mut j = Sessions::new(me(5, 3));
    j.route(Rank(0), Some(20));
    let Dial::Start(_, hello, _) = j.dial(Rank(0), b"joiner", || now).unwrap() else { panic!() };
    let challenge = l.on_hello(55, true, &hello, now).unwrap();
    let (_, proof) = j.on_challenge(&challenge, now).unwrap();
    assert_eq!(l.on_proof(&proof, now).unwrap().unwrap().0, Rank(5));
    assert_eq!(l.to(Rank(5)).map(|t| t.fi_addr), Some(55));
    assert!(l.in_use(55));
}

#[test]
fn silence_leads_to_pings_then_loss_and_stale_handshakes_expire() {
    let t0 = Instant::now();
    let (mut d, mut l) = pair(3, 3);
    let (hello, _rx) = start(&mut d, t0);
    // The listener answers at an address it had to insert (77), not the dialer's route.
    let challenge = l.on_hello(77, true, &hello, t0).unwrap();
    let (_, proof) = d.on_challenge(&challenge, t0).unwrap();
    let (_, _, accept) = l.on_proof(&proof, t0).unwrap().unwrap();
    d.on_accept(&accept).unwrap();
    let later = |ms| t0 + Duration::from_millis(ms);
    let tick = d.tick(later(PING_AFTER.as_millis() as u64 + 1), Duration::from_secs(60));
    assert_eq!(tick.ping.len(), 1);
    assert_eq!(tick.ping[0].0, Rank(0));
    let again = d.tick(later(PING_AFTER.as_millis() as u64 + 2), Duration::from_secs(60));
    assert!(again.ping.is_empty(), "one ping per interval");
    // A message heard before a tick counts as heard at that tick: loss is deferred.
    let token = l.to(Rank(1)).expect("the listener has a stream to the dialer").token;
    assert_eq!(d.heard(token), Some(Rank(0)));
    let heard_at = PING_AFTER.as_millis() as u64 + 3;
    assert!(d.tick(later(heard_at), Duration::from_secs(60)).ping.is_empty());
    let not_yet = d.tick(later(LOST_AFTER.as_millis() as u64 + 1), Duration::from_secs(60));
    assert!(not_yet.lost.is_empty(), "heard {heard_at} ms after the start");
    let lost = d.tick(later(heard_at + LOST_AFTER.as_millis() as u64 + 1), Duration::from_secs(60));
    assert_eq!(lost.lost, vec![Rank(0)]);
    d.forget(Rank(0));
    assert!(d.to(Rank(0)).is_none());
    // A handshake that never completes gives its inserted address back.
    let (mut d2, mut l2) = pair(3, 3);
    let (hello, _rx) = start(&mut d2, t0);
    l2.on_hello(77, true, &hello, t0).unwrap();
    let expired = l2.tick(later(2000), Duration::from_secs(1));
    assert_eq!(expired.unused, vec![77]);
    let expired = d2.tick(later(2000), Duration::from_secs(1));
    assert!(expired.unused.is_empty());
    assert!(matches!(d2.dial(Rank(0), b"d-name", || later(2000)).unwrap(), Dial::Start(..)), "the stale dial is gone");
}

#[test]
fn a_remembered_sender_keeps_its_peer_alive_until_the_tokens_change() {
    let t0 = Instant::now();
    let (mut d, mut l) = pair(3, 3);
    let generation = d.generation();
    let (hello, _rx) = start(&mut d, t0);
    let challenge = l.on_hello(10, false, &hello, t0).unwrap();
    let before = generation.load(Ordering::Acquire);
    // The dialer accepts the listener's token once the listener's MAC verifies.
    let (_, proof) = d.on_challenge(&challenge, t0).unwrap();
    let accepted = generation.load(Ordering::Acquire);
    assert_ne!(before, accepted, "accepting a token moves the generation");
    let (_, _, accept) = l.on_proof(&proof, t0).unwrap().unwrap();
    d.on_accept(&accept).unwrap();
    let token = l.to(Rank(1)).unwrap().token;
    let heard = d.hear(token).unwrap();
    assert_eq!((heard.rank, heard.generation), (Rank(0), accepted));
    assert!(d.hear(token ^ 1).is_none(), "a guessed token names nobody");
    // Hearing through the remembered flag, without the sessions, defers the ping and
    // the loss as a looked-up message does.
    let later = |ms: u128| t0 + Duration::from_millis(ms as u64);
    heard.fresh.store(false, Ordering::Relaxed);
    mark(&heard.fresh);
    let at = PING_AFTER.as_millis() + 1;
    assert!(d.tick(later(at), Duration::from_secs(60)).ping.is_empty(), "heard before this tick");
    assert!(!heard.fresh.load(Ordering::Relaxed), "the tick took the mark");
    assert_eq!(d.tick(later(2 * at), Duration::from_secs(60)).ping.len(), 1, "silent since");
    mark(&heard.fresh);
    assert!(d.tick(later(LOST_AFTER.as_millis() + at), Duration::from_secs(60)).lost.is_empty());
    // Forgetting the peer moves the generation: the remembered answer no longer holds.
    d.forget(Rank(0));
    assert_ne!(generation.load(Ordering::Acquire), heard.generation);
    assert!(d.hear(token).is_none());
}

#[test]
fn a_failed_send_to_a_peer_fails_only_its_dial_at_a_shared_address() {
    // Ranks 0 and 2 at one address index (2 got the index rank 0's address had before it
    // left): a failed data send to rank 0 must not fail the dial to rank 2.
    let now = Instant::now();
    let mut d = Sessions::new(me(1, 3));
    d.route(Rank(0), Some(20));
    d.route(Rank(2), Some(20));
    let (_, mut to_0) = start(&mut d, now);
    let Dial::Start(20, _, mut to_2) = d.dial(Rank(2), b"d-name", || now).unwrap() else {
        panic!("expected a new dial to address 20");
    };
    let lost = |r| TransportError::PeerLost(r);
    d.fail_dials_to(20, Some(Rank(0)), lost);
    assert!(matches!(to_0.try_recv(), Ok(Err(TransportError::PeerLost(Rank(0))))));
    assert!(to_2.try_recv().is_err(), "rank 2's dial was failed too");
    // A handshake message names no peer: every dial to the address fails.
    d.fail_dials_to(20, None, lost);
    assert!(matches!(to_2.try_recv(), Ok(Err(TransportError::PeerLost(Rank(2))))));
}
