//! The libfabric backend (being written).
