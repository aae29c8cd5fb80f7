//! rlhost: train LLM agents with reinforcement learning, with tools, environments,
//! datasets and rewards as sandboxed WebAssembly plugins.
//!
//! The binary is a thin wrapper around [`cli::run`].

pub mod builtin;
pub mod cli;
pub mod config;
pub mod data;
pub mod model;
pub mod plugin;
pub mod progress;
pub mod rl;
pub mod rollout;
pub mod sample;
pub mod status;
pub mod step;
