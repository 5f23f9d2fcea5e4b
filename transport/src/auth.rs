//! Mutual challenge-response authentication with the job key.
//!
//! Every connection starts with three messages, each of fixed size so that nothing is
//! allocated before the peer has proven the key:
//!
//! 1. dialer → listener `Hello`: magic `DUH1`, job id, dialer rank, dialer nonce.
//! 2. listener → dialer `Challenge`: magic `DUH2`, listener rank, listener nonce, and
//!    `HMAC-SHA256(key, "ductile-listener" | job | dialer nonce | listener nonce | ranks)`.
//! 3. dialer → listener `Proof`: magic `DUH3` and
//!    `HMAC-SHA256(key, "ductile-dialer" | job | listener nonce | dialer nonce | ranks)`.
//! 4. listener → dialer `Accept`: magic `DUOK`.
//!
//! Both sides prove the key over both fresh nonces; the two MACs carry different labels
//! so one side's proof can never be reflected back as the other's. A failure drops the
//! connection before any job data flows.

use crate::error::AuthError;
use crate::ids::{JobId, JobKey, Rank};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

type HmacSha256 = Hmac<Sha256>;

/// Length of the dialer's hello.
pub const HELLO_LEN: usize = 4 + 8 + 4 + 32;
/// Length of the listener's challenge.
pub const CHALLENGE_LEN: usize = 4 + 4 + 32 + 32;
/// Length of the dialer's proof.
pub const PROOF_LEN: usize = 4 + 32;
/// Length of the listener's acceptance.
pub const ACCEPT_LEN: usize = 4;

const HELLO_MAGIC: &[u8; 4] = b"DUH1";
const CHALLENGE_MAGIC: &[u8; 4] = b"DUH2";
const PROOF_MAGIC: &[u8; 4] = b"DUH3";
const ACCEPT_MAGIC: &[u8; 4] = b"DUOK";

/// A 32-byte fresh random value.
pub type Nonce = [u8; 32];

fn nonce() -> std::io::Result<Nonce> {
    let mut n = [0u8; 32];
    getrandom::fill(&mut n).map_err(|e| std::io::Error::other(format!("random source failed: {e}")))?;
    Ok(n)
}

fn mac(
    key: &JobKey,
    label: &[u8],
    job: JobId,
    first: &Nonce,
    second: &Nonce,
    dialer: Rank,
    listener: Rank,
) -> HmacSha256 {
    // new_from_slice accepts keys of any length for HMAC; 32 bytes always works.
    let mut m = HmacSha256::new_from_slice(key.as_bytes()).expect("HMAC takes keys of any length");
    m.update(label);
    m.update(&job.0.to_le_bytes());
    m.update(first);
    m.update(second);
    m.update(&dialer.0.to_le_bytes());
    m.update(&listener.0.to_le_bytes());
    m
}

/// The listener-side proof.
#[must_use]
pub fn listener_mac(
    key: &JobKey,
    job: JobId,
    dialer_nonce: &Nonce,
    listener_nonce: &Nonce,
    dialer: Rank,
    listener: Rank,
) -> [u8; 32] {
    mac(key, b"ductile-listener", job, dialer_nonce, listener_nonce, dialer, listener).finalize().into_bytes().into()
}

/// The dialer-side proof.
#[must_use]
pub fn dialer_mac(
    key: &JobKey,
    job: JobId,
    listener_nonce: &Nonce,
    dialer_nonce: &Nonce,
    dialer: Rank,
    listener: Rank,
) -> [u8; 32] {
    mac(key, b"ductile-dialer", job, listener_nonce, dialer_nonce, dialer, listener).finalize().into_bytes().into()
}

fn verify(expected: HmacSha256, got: &[u8]) -> Result<(), AuthError> {
    expected.verify_slice(got).map_err(|_| AuthError::BadProof)
}

/// Encodes the dialer's hello.
#[must_use]
pub fn encode_hello(job: JobId, dialer: Rank, n: &Nonce) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..4].copy_from_slice(HELLO_MAGIC);
    b[4..12].copy_from_slice(&job.0.to_le_bytes());
    b[12..16].copy_from_slice(&dialer.0.to_le_bytes());
    b[16..48].copy_from_slice(n);
    b
}

/// Decodes a hello: (job id, dialer rank, dialer nonce).
///
/// # Errors
/// A bad magic.
pub fn decode_hello(b: &[u8; HELLO_LEN]) -> Result<(JobId, Rank, Nonce), AuthError> {
    if &b[0..4] != HELLO_MAGIC {
        return Err(AuthError::BadMagic);
    }
    let mut job = [0u8; 8];
    job.copy_from_slice(&b[4..12]);
    let mut rank = [0u8; 4];
    rank.copy_from_slice(&b[12..16]);
    let mut n = [0u8; 32];
    n.copy_from_slice(&b[16..48]);
    Ok((JobId(u64::from_le_bytes(job)), Rank(u32::from_le_bytes(rank)), n))
}

/// Who we are in a handshake.
#[derive(Clone, Debug)]
pub struct Identity {
    /// The job.
    pub job: JobId,
    /// The job key.
    pub key: JobKey,
    /// Our rank.
    pub rank: Rank,
}

async fn io<T>(
    what: &str,
    timeout: Duration,
    fut: impl std::future::Future<Output = std::io::Result<T>>,
) -> std::io::Result<T> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("handshake timed out during {what}"))),
    }
}

/// The outcome of a handshake that did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The peer failed authentication.
    #[error(transparent)]
    Auth(#[from] AuthError),
    /// The connection failed or timed out.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Runs the dialer side: proves the key to the listener `expected` and checks its proof.
///
/// # Errors
/// The listener is not `expected`, fails its proof, or the connection fails or times out.
pub async fn dial<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    me: &Identity,
    expected: Rank,
    timeout: Duration,
) -> Result<(), HandshakeError> {
    let dn = nonce()?;
    io("hello", timeout, s.write_all(&encode_hello(me.job, me.rank, &dn))).await?;
    let mut c = [0u8; CHALLENGE_LEN];
    io("challenge", timeout, s.read_exact(&mut c)).await?;
    if &c[0..4] != CHALLENGE_MAGIC {
        return Err(AuthError::BadMagic.into());
    }
    let mut r = [0u8; 4];
    r.copy_from_slice(&c[4..8]);
    let listener = Rank(u32::from_le_bytes(r));
    if listener != expected {
        return Err(AuthError::WrongPeer { expected, found: listener }.into());
    }
    let mut ln = [0u8; 32];
    ln.copy_from_slice(&c[8..40]);
    verify(mac(&me.key, b"ductile-listener", me.job, &dn, &ln, me.rank, listener), &c[40..72])?;
    let mut p = [0u8; PROOF_LEN];
    p[0..4].copy_from_slice(PROOF_MAGIC);
    p[4..36].copy_from_slice(&dialer_mac(&me.key, me.job, &ln, &dn, me.rank, listener));
    io("proof", timeout, s.write_all(&p)).await?;
    let mut a = [0u8; ACCEPT_LEN];
    io("acceptance", timeout, s.read_exact(&mut a)).await?;
    if &a != ACCEPT_MAGIC {
        return Err(AuthError::BadMagic.into());
    }
    Ok(())
}

/// Runs the listener side; `is_member` says whether a claimed rank belongs to the job.
/// Returns the authenticated rank of the dialer.
///
/// # Errors
/// The dialer is of another job, claims a non-member rank, fails its proof, or the
/// connection fails or times out.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    me: &Identity,
    is_member: impl Fn(Rank) -> bool,
    timeout: Duration,
) -> Result<Rank, HandshakeError> {
    let mut h = [0u8; HELLO_LEN];
    io("hello", timeout, s.read_exact(&mut h)).await?;
    let (job, dialer, dn) = decode_hello(&h)?;
    if job != me.job {
        return Err(AuthError::WrongJob(job.0).into());
    }
    if !is_member(dialer) {
        return Err(AuthError::UnknownRank(dialer).into());
    }
    let ln = nonce()?;
    let mut c = [0u8; CHALLENGE_LEN];
    c[0..4].copy_from_slice(CHALLENGE_MAGIC);
    c[4..8].copy_from_slice(&me.rank.0.to_le_bytes());
    c[8..40].copy_from_slice(&ln);
    c[40..72].copy_from_slice(&listener_mac(&me.key, me.job, &dn, &ln, dialer, me.rank));
    io("challenge", timeout, s.write_all(&c)).await?;
    let mut p = [0u8; PROOF_LEN];
    io("proof", timeout, s.read_exact(&mut p)).await?;
    if &p[0..4] != PROOF_MAGIC {
        return Err(AuthError::BadMagic.into());
    }
    verify(mac(&me.key, b"ductile-dialer", me.job, &ln, &dn, dialer, me.rank), &p[4..36])?;
    io("acceptance", timeout, s.write_all(ACCEPT_MAGIC)).await?;
    Ok(dialer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident(rank: u32, key: u8) -> Identity {
        Identity { job: JobId(0xabc), key: JobKey::from_bytes([key; 32]), rank: Rank(rank) }
    }

    async fn pair(
        d: Identity,
        l: Identity,
        expected: Rank,
    ) -> (Result<(), HandshakeError>, Result<Rank, HandshakeError>) {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let t = Duration::from_secs(2);
        let dialer = async move {
            let r = dial(&mut a, &d, expected, t).await;
            drop(a);
            r
        };
        let listener = async move {
            let r = accept(&mut b, &l, |r| r.0 < 4, t).await;
            drop(b);
            r
        };
        tokio::join!(dialer, listener)
    }

    #[tokio::test]
    async fn same_key_authenticates_both_ways() {
        let (d, l) = pair(ident(1, 7), ident(0, 7), Rank(0)).await;
        d.unwrap();
        assert_eq!(l.unwrap(), Rank(1));
    }

    #[tokio::test]
    async fn wrong_key_is_rejected_by_both_sides() {
        let (d, l) = pair(ident(1, 7), ident(0, 8), Rank(0)).await;
        assert!(matches!(d, Err(HandshakeError::Auth(AuthError::BadProof))), "{d:?}");
        assert!(l.is_err());
    }

    #[tokio::test]
    async fn other_job_and_non_member_are_rejected() {
        let mut other = ident(1, 7);
        other.job = JobId(1);
        let (_, l) = pair(other, ident(0, 7), Rank(0)).await;
        assert!(matches!(l, Err(HandshakeError::Auth(AuthError::WrongJob(1)))));
        let (_, l) = pair(ident(9, 7), ident(0, 7), Rank(0)).await;
        assert!(matches!(l, Err(HandshakeError::Auth(AuthError::UnknownRank(Rank(9))))));
    }

    #[tokio::test]
    async fn wrong_peer_is_detected_by_dialer() {
        let (d, _) = pair(ident(1, 7), ident(0, 7), Rank(2)).await;
        assert!(matches!(d, Err(HandshakeError::Auth(AuthError::WrongPeer { .. }))));
    }

    proptest::proptest! {
        // A silent stranger that sent less than a hello makes a case wait out the
        // timeout on both sides.
        #![proptest_config(proptest::test_runner::Config::with_cases(64))]
        /// Any bytes a stranger sends either side of the handshake end it with an error
        /// (never a panic, never a hang past the timeout), and never authenticate.
        #[test]
        fn any_bytes_fail_the_handshake_on_both_sides(junk in proptest::collection::vec(proptest::num::u8::ANY, 0..300)) {
            let mut hello = [0u8; HELLO_LEN];
            let n = junk.len().min(HELLO_LEN);
            hello[..n].copy_from_slice(&junk[..n]);
            let _ = decode_hello(&hello);
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let t = Duration::from_millis(20);
            let (listener, dialer) = rt.block_on(async {
                // The stranger sends its bytes and hangs up, or stays silent.
                let (mut a, mut b) = tokio::io::duplex(1024);
                a.write_all(&junk).await.unwrap();
                let hang_up = junk.len() % 2 == 0;
                let _kept = (!hang_up).then_some(a);
                let listener = accept(&mut b, &ident(0, 7), |_| true, t).await;
                let (mut c, mut d) = tokio::io::duplex(1024);
                c.write_all(&junk).await.unwrap();
                let _kept = (!hang_up).then_some(c);
                let dialer = dial(&mut d, &ident(1, 7), Rank(0), t).await;
                (listener, dialer)
            });
            proptest::prop_assert!(listener.is_err(), "{listener:?}");
            proptest::prop_assert!(dialer.is_err(), "{dialer:?}");
        }
    }

    #[tokio::test]
    async fn garbage_and_silence_fail() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&[0x55; HELLO_LEN]).await.unwrap();
        let r = accept(&mut b, &ident(0, 7), |_| true, Duration::from_secs(1)).await;
        assert!(matches!(r, Err(HandshakeError::Auth(AuthError::BadMagic))));
        let (_a, mut b) = tokio::io::duplex(1024);
        let r = accept(&mut b, &ident(0, 7), |_| true, Duration::from_millis(50)).await;
        assert!(matches!(r, Err(HandshakeError::Io(e)) if e.kind() == std::io::ErrorKind::TimedOut));
    }

    #[test]
    fn labels_differ_so_proofs_cannot_be_reflected() {
        let k = JobKey::from_bytes([3; 32]);
        let n1 = [1; 32];
        let n2 = [2; 32];
        assert_ne!(
            listener_mac(&k, JobId(5), &n1, &n2, Rank(0), Rank(1)),
            dialer_mac(&k, JobId(5), &n1, &n2, Rank(0), Rank(1))
        );
    }
}
