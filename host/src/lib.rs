//! rlhost: train LLM agents with reinforcement learning, with tools, environments,
//! datasets and rewards as sandboxed WebAssembly plugins.
//!
//! The binary's `main` calls [`cli::main`], which parses the arguments, runs one command
//! and prints one error chain; everything else is this library.

pub mod builtin;
pub mod cli;
pub mod config;
pub mod data;
pub mod front;
pub mod gateway;
pub mod model;
pub mod openenv;
pub mod plugin;
pub mod progress;
pub mod rl;
pub mod rng;
pub mod rollout;
pub mod sampler;
pub mod status;
pub mod step;
pub mod task;
pub mod tinker;

#[cfg(test)]
mod import_rules;
