//! Generated bindings, one module per released WIT version of `rlhost:plugin`.
//!
//! A released version is frozen. Supporting a new one means adding its folder under
//! `wit/`, a module here, and its name to [`SUPPORTED`]; older modules stay so that old
//! plugins keep loading.

pub mod v0_1_0;

/// The `rlhost:plugin` versions this host loads, newest first.
pub const SUPPORTED: &[&str] = &["0.1.0"];

/// The WIT package every plugin interface belongs to.
pub const PACKAGE: &str = "rlhost:plugin";
