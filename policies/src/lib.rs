//! The sluice policy language: quantities with units today, the YAML policy
//! model and the allocation engine as the control plane grows.
//!
//! This crate is pure: data in, decisions out. It does no I/O and knows
//! nothing of gRPC or storage, which is what lets every rule be tested
//! without a server.

pub mod quantity;

pub use quantity::{ByteRate, ByteSize, OpsRate, QuantityError};
