//! OpenEnv (Meta and Hugging Face's environment standard): rlhost's environment and tools
//! plugins served under its API, so that OpenEnv's clients, TRL's `environment_factory`
//! and anything else that speaks it can use a sandboxed plugin as an environment.
//!
//! And the other way: [`crate::rollout::env::openenv`] trains against any OpenEnv server (`[rollout.openenv]`,
//! its URL read by [`endpoint`]).
//!
//! [`wire`] holds the protocol's messages, [`episode`] one episode over a plugin (the
//! action mapping), [`server`] the HTTP and WebSocket routes. `rlhost env serve` runs it.

pub mod endpoint;
pub mod episode;
pub mod server;
pub mod settings;
pub mod wire;

use std::sync::Arc;

use anyhow::{Context, Result};

pub use episode::Served;
pub use server::ServeOptions;

/// Serves `served` on `addr` until the process ends (Ctrl-C: no episode keeps anything
/// worth saving); `ready` is told the bound address first (a port of 0 picks a free one).
pub async fn serve(
    served: Served,
    addr: &str,
    options: ServeOptions,
    ready: impl FnOnce(std::net::SocketAddr),
) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| {
        format!("cannot listen on {addr} (is the port taken? --port 0 picks a free one)")
    })?;
    ready(listener.local_addr()?);
    // The front every rlhost server stands behind: header and body timeouts, a connection
    // cap that closes idle connections first and answers /health through a full table,
    // the body cap in FastAPI's shape (a WebSocket session leaves the table once
    // upgraded; sessions have their own cap and idle timeout).
    let policy = crate::front::Policy::new(
        "OpenEnv server",
        MAX_CONNECTIONS,
        options.max_message_bytes,
        &["/health"],
        server::refusal,
    );
    let app = server::router(Arc::new(served), options);
    crate::front::serve(listener, app, policy).await;
    anyhow::bail!("the OpenEnv server stopped")
}

/// HTTP connections `env serve` holds at once (its sessions are capped by
/// `--max-sessions`).
pub const MAX_CONNECTIONS: usize = 1024;
