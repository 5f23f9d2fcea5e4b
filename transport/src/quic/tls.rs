//! Certificates, pinning, address text and the quinn settings of the QUIC backend.
//!
//! Each endpoint generates a self-signed certificate when it binds and publishes the
//! SHA-256 fingerprint of its DER encoding in its address text
//! (`IP:PORT#<64 hex digits>`). A dialer accepts exactly the certificate pinned for the
//! rank it dials ([`PinnedServer`]); no certificate authority is involved, since the
//! addresses travel through the launcher's authenticated bootstrap.

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};
use sha2::{Digest, Sha256};
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// The name every endpoint's certificate is issued for and every dialer asks for; the
/// pinned fingerprint, not the name, identifies the peer.
pub(super) const SERVER_NAME: &str = "ductile";
/// The ALPN protocol both sides require.
const ALPN: &[u8] = b"ductile/1";

/// How long a connection may stay silent before it is declared dead.
pub(super) const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often an otherwise idle connection sends a keep-alive.
const KEEP_ALIVE: Duration = Duration::from_secs(1);
/// Unread bytes one stream may have in flight towards us: as many as the whole
/// connection ([`CONNECTION_WINDOW`]), so a peer's stream of messages is held back only
/// by what the connection may buffer. A 4 MiB stream over loopback, alternating jobs of
/// 2000 messages (GiB/s, 8 rounds): 16 MiB 2.86-3.17 (median 2.91), 32 MiB 2.94-3.10
/// (3.00), 64 MiB 2.98-3.13 (3.07, faster in 7 of 8 rounds); into one buffer, 5 rounds:
/// 2.86-2.97 against 2.98-3.12. A 128 MiB window with a 512 MiB connection window
/// collapsed one job in five to 0.46 GiB/s (docs/BENCHMARKS.md, forty-first session).
const STREAM_WINDOW: u32 = 64 << 20;
/// Unread bytes all streams of one connection may have in flight towards us.
const CONNECTION_WINDOW: u32 = 64 << 20;
/// Unacknowledged bytes we buffer for sending on one connection.
const SEND_WINDOW: u64 = 64 << 20;
/// Gets one peer may have in flight towards us (one bidirectional stream each).
const MAX_GETS: u32 = 1024;
/// The round-trip time assumed before the first measurement: cluster networks and
/// loopback are far faster than the internet-wide default of 333 ms, which would hold a
/// connection that never got a measurement (a refused dial) for 3 s when it closes.
const INITIAL_RTT: Duration = Duration::from_millis(20);

/// The SHA-256 of an endpoint's DER certificate.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct Fingerprint(pub(super) [u8; 32]);

impl Fingerprint {
    /// The fingerprint of a DER certificate.
    pub(super) fn of(der: &[u8]) -> Self {
        Self(Sha256::digest(der).into())
    }

    fn parse(hex: &str) -> Option<Self> {
        let digits = hex.as_bytes();
        if digits.len() != 64 {
            return None;
        }
        let nibble = |c: u8| char::from(c).to_digit(16).and_then(|d| u8::try_from(d).ok());
        let mut out = [0u8; 32];
        for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
            *byte = (nibble(pair[0])? << 4) | nibble(pair[1])?;
        }
        Some(Self(out))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

/// A peer's socket address and the fingerprint of the certificate it must present.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PeerAddr {
    /// Where it listens.
    pub(super) addr: SocketAddr,
    /// Its certificate's fingerprint.
    pub(super) fingerprint: Fingerprint,
}

impl PeerAddr {
    /// Parses `IP:PORT#<64 hex digits>`; `None` if it is anything else.
    pub(super) fn parse(text: &str) -> Option<Self> {
        let (addr, hex) = text.split_once('#')?;
        Some(Self { addr: addr.parse().ok()?, fingerprint: Fingerprint::parse(hex)? })
    }
}

impl fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.addr, self.fingerprint)
    }
}

/// A fresh self-signed certificate and its key.
pub(super) struct Certificate {
    der: CertificateDer<'static>,
    key: PrivatePkcs8KeyDer<'static>,
}

impl Certificate {
    /// Generates a certificate for [`SERVER_NAME`] with a new ECDSA P-256 key.
    pub(super) fn generate() -> Result<Self, rcgen::Error> {
        let made = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()])?;
        Ok(Self { der: made.cert.der().clone(), key: PrivatePkcs8KeyDer::from(made.signing_key.serialize_der()) })
    }

    /// The certificate's fingerprint.
    pub(super) fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of(&self.der)
    }
}

/// ring's provider with aws-lc-rs's TLS 1.3 cipher suites, AES-128-GCM first.
///
/// - **Suites from aws-lc-rs.** Encryption and decryption were a third of a streaming
///   rank's CPU time with ring's AES-GCM, which uses 256-bit vectors (VAES/AVX2);
///   aws-lc's uses AVX-512 where the processor has it: 26 against 11.7 GB/s sealing
///   64 KiB packets on one core here, and quic's 4 MiB stream went from 4.4 to 5.4 GiB/s
///   (medians of 8 alternating jobs).
/// - **Everything else from ring** (random numbers, key exchange, signatures): aws-lc's
///   random generator seeds itself by CPU-jitter sampling, which took about 40 % of a
///   4-rank quic job's start-up CPU (10 ms per process); nothing here asks aws-lc for
///   random bytes.
/// - **AES-128-GCM first** (every provider lists AES-256-GCM first): both sides are
///   ours, and a rustls server follows the client's order, so every connection uses
///   TLS 1.3's mandatory suite (RFC 8446, 9.1), the one QUIC protects its first packets
///   with, whose 10 AES rounds instead of 14 make bulk encryption cheaper (2.41 against
///   2.61 GiB/s, then 2.42 against 2.50, with ring; medians of 5 and 6 jobs).
fn provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites = rustls::crypto::aws_lc_rs::default_provider().cipher_suites;
    p.cipher_suites.sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(p)
}

/// A rustls or quinn setup error, as text.
pub(super) type SetupError = String;

/// Routes whose MTU is at least this large (loopback's 65536, IPoIB's 65520) carry one
/// large datagram per system call. On smaller routes datagrams stay small and are batched
/// with segmentation offload (GSO). Measured on loopback, 4 MiB messages, waiting
/// threads not spinning: 60 KB datagrams 3.2 GiB/s, 16 KB without GSO 2.5, 6.5 KB with
/// GSO 2.2, the default 1452-byte ones with GSO 1.3.
const LARGE_ROUTE_MTU: u32 = 16 << 10;
/// The largest datagram looked for on a batched route: quinn hands the kernel at most 10
/// segments in one GSO send, and the whole send must fit in 64 KiB.
const LARGEST_SEGMENT: u16 = 6500;
/// The largest UDP payload quinn accepts (IPv6's; an IPv4 datagram carries at most
/// 65 507 bytes, and the route's MTU bounds what is sent).
pub(super) const LARGEST_DATAGRAM: u16 = 65_527;
/// IPv6 and UDP headers, the larger family's, taken off a route's MTU.
const HEADERS: u32 = 48;

/// The quinn transport settings of a connection over a route whose MTU is `route_mtu`
/// (None: unknown): windows sized for bulk traffic, keep-alives with a short idle timeout
/// so a dead peer is noticed within seconds, and datagrams sized for the route (MTU
/// discovery still confirms that the path carries them).
pub(super) fn transport_config(route_mtu: Option<u32>) -> Result<Arc<quinn::TransportConfig>, SetupError> {
    let mut t = quinn::TransportConfig::default();
    t.max_idle_timeout(Some(IDLE_TIMEOUT.try_into().map_err(|e| format!("idle timeout: {e}"))?))
        .keep_alive_interval(Some(KEEP_ALIVE))
        .stream_receive_window(STREAM_WINDOW.into())
        .receive_window(CONNECTION_WINDOW.into())
        .send_window(SEND_WINDOW)
        .max_concurrent_bidi_streams(MAX_GETS.into())
        .max_concurrent_uni_streams(0u32.into())
        .initial_rtt(INITIAL_RTT)
        .datagram_receive_buffer_size(None);
    if let Some(mtu) = route_mtu {
        let payload = u16::try_from(mtu.saturating_sub(HEADERS)).unwrap_or(u16::MAX);
        let large = mtu >= LARGE_ROUTE_MTU;
        let upper = if large { payload.min(LARGEST_DATAGRAM) } else { payload.min(LARGEST_SEGMENT) };
        let mut discovery = quinn::MtuDiscoveryConfig::default();
        // Below quinn's default bound of 1452 the route is unusual; leave it to quinn.
        if upper > 1452 {
            discovery.upper_bound(upper);
        }
        t.mtu_discovery_config(Some(discovery)).enable_segmentation_offload(!large);
    }
    Ok(Arc::new(t))
}

/// The server side: TLS 1.3 only, our certificate, no client certificates (dialers
/// prove themselves with the job key on the first stream).
pub(super) fn server_config(
    cert: &Certificate,
    transport: Arc<quinn::TransportConfig>,
) -> Result<quinn::ServerConfig, SetupError> {
    let key = PrivateKeyDer::Pkcs8(cert.key.clone_key());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(vec![cert.der.clone()], key)
        .map_err(|e| e.to_string())?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = QuicServerConfig::try_from(tls).map_err(|e| e.to_string())?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server.transport_config(transport).migration(false);
    Ok(server)
}

/// The client side of a connection to a peer whose certificate must be `pinned`.
pub(super) fn client_config(
    pinned: Fingerprint,
    transport: Arc<quinn::TransportConfig>,
) -> Result<quinn::ClientConfig, SetupError> {
    let provider = provider();
    let verifier = PinnedServer { pinned, algorithms: provider.signature_verification_algorithms };
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = QuicClientConfig::try_from(tls).map_err(|e| e.to_string())?;
    let mut client = quinn::ClientConfig::new(Arc::new(crypto));
    client.transport_config(transport);
    Ok(client)
}

/// The certificate presented is not the one pinned for the rank dialed.
#[derive(thiserror::Error)]
#[error("certificate fingerprint {found} does not match the pinned {pinned}")]
struct Mismatch {
    found: Fingerprint,
    pinned: Fingerprint,
}

impl fmt::Debug for Mismatch {
    // rustls shows the reason with `Debug` inside its own error text: keep it readable.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Accepts exactly the server certificate whose fingerprint is pinned, and checks the
/// handshake signature made with its key.
#[derive(Debug)]
pub(super) struct PinnedServer {
    pinned: Fingerprint,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for PinnedServer {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let found = Fingerprint::of(end_entity);
        if found == self.pinned {
            Ok(ServerCertVerified::assertion())
        } else {
            let why = rustls::OtherError(Arc::new(Mismatch { found, pinned: self.pinned }));
            Err(rustls::Error::InvalidCertificate(CertificateError::Other(why)))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_and_reject_bad_text() {
        let cert = Certificate::generate().unwrap();
        let a = PeerAddr { addr: "127.0.0.1:4000".parse().unwrap(), fingerprint: cert.fingerprint() };
        let text = a.to_string();
        assert_eq!(text.len(), "127.0.0.1:4000#".len() + 64);
        assert_eq!(PeerAddr::parse(&text), Some(a));
        assert_eq!(PeerAddr::parse(&text.to_uppercase()), Some(a));
        let v6 = format!("[::1]:9#{}", a.fingerprint);
        assert_eq!(PeerAddr::parse(&v6).map(|p| p.addr), Some("[::1]:9".parse().unwrap()));
        for bad in [
            "127.0.0.1:4000".to_string(),
            format!("127.0.0.1#{}", a.fingerprint),
            format!("127.0.0.1:4000#{}", &text[text.len() - 63..]),
            format!("127.0.0.1:4000#{}0", a.fingerprint),
            format!("127.0.0.1:4000#{}", "g".repeat(64)),
            format!("127.0.0.1:4000#{}", "é".repeat(32)),
            String::new(),
            "#".to_string(),
        ] {
            assert_eq!(PeerAddr::parse(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn aes_128_gcm_is_offered_first_and_the_others_remain() {
        let p = provider();
        let suites: Vec<_> = p.cipher_suites.iter().map(rustls::SupportedCipherSuite::suite).collect();
        assert_eq!(suites[0], rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
        let all = rustls::crypto::aws_lc_rs::default_provider();
        assert_eq!(suites.len(), all.cipher_suites.len(), "no suite dropped: {suites:?}");
    }

    #[test]
    fn certificates_differ_and_configs_build() {
        let a = Certificate::generate().unwrap();
        let b = Certificate::generate().unwrap();
        assert_ne!(a.fingerprint(), b.fingerprint());
        let t = transport_config(None).unwrap();
        server_config(&a, t.clone()).unwrap();
        client_config(b.fingerprint(), t).unwrap();
    }

    #[test]
    fn only_the_pinned_certificate_verifies() {
        let a = Certificate::generate().unwrap();
        let b = Certificate::generate().unwrap();
        let v = PinnedServer { pinned: a.fingerprint(), algorithms: provider().signature_verification_algorithms };
        let name = ServerName::try_from(SERVER_NAME).unwrap();
        assert!(v.verify_server_cert(&a.der, &[], &name, &[], UnixTime::now()).is_ok());
        let err = v.verify_server_cert(&b.der, &[], &name, &[], UnixTime::now()).unwrap_err();
        assert!(err.to_string().contains("does not match"), "{err}");
    }
}
