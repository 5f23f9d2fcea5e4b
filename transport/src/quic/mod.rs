//! The QUIC backend (being written).
