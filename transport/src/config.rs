//! Transport configuration.

use std::net::IpAddr;
use std::time::Duration;

/// Default time allowed to open a connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time allowed for the authentication handshake.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default largest payload of one frame (1 GiB).
pub const DEFAULT_MAX_PAYLOAD: u64 = 1 << 30;
/// Default address endpoints bind to.
pub const DEFAULT_BIND_HOST: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

/// Settings shared by the backends.
#[derive(Clone, Debug)]
pub struct TransportConfig {
    connect_timeout: Duration,
    handshake_timeout: Duration,
    max_payload: u64,
    bind_host: IpAddr,
    fabric_provider: Option<String>,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            max_payload: DEFAULT_MAX_PAYLOAD,
            bind_host: DEFAULT_BIND_HOST,
            fabric_provider: None,
        }
    }
}

impl TransportConfig {
    /// Sets the connect timeout.
    #[must_use]
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    /// Sets the handshake timeout.
    #[must_use]
    pub fn handshake_timeout(mut self, t: Duration) -> Self {
        self.handshake_timeout = t;
        self
    }

    /// Sets the largest payload of one frame; larger messages are refused and larger
    /// announced frames close the connection.
    #[must_use]
    pub fn max_payload(mut self, bytes: u64) -> Self {
        self.max_payload = bytes;
        self
    }

    /// Sets the address endpoints bind to.
    #[must_use]
    pub fn bind_host(mut self, host: IpAddr) -> Self {
        self.bind_host = host;
        self
    }

    /// Sets the libfabric provider the `fabric` backend asks for (`tcp;ofi_rxm`, `shm`,
    /// `verbs;ofi_rxm`, ...). Unset: the `FI_PROVIDER` environment variable, then
    /// libfabric's own choice.
    #[must_use]
    pub fn fabric_provider(mut self, provider: impl Into<String>) -> Self {
        self.fabric_provider = Some(provider.into());
        self
    }

    /// The libfabric provider asked for, if set.
    #[must_use]
    pub fn get_fabric_provider(&self) -> Option<&str> {
        self.fabric_provider.as_deref()
    }

    /// The connect timeout.
    #[must_use]
    pub fn get_connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The handshake timeout.
    #[must_use]
    pub fn get_handshake_timeout(&self) -> Duration {
        self.handshake_timeout
    }

    /// The frame payload cap.
    #[must_use]
    pub fn get_max_payload(&self) -> u64 {
        self.max_payload
    }

    /// The bind address.
    #[must_use]
    pub fn get_bind_host(&self) -> IpAddr {
        self.bind_host
    }
}
