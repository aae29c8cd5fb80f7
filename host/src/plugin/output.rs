//! A plugin's stdout or stderr: an in-memory buffer that keeps the first `capacity`
//! bytes and silently drops (but counts) the rest.
//!
//! wasmtime-wasi's own `MemoryOutputPipe` traps the guest once full, which would turn a
//! chatty but correct plugin into a faulty one. Dropping is the better contract: printing
//! is never a fault, and the host log says how much was dropped.

use bytes::Bytes;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

#[derive(Default)]
struct Buffer {
    kept: Vec<u8>,
    dropped: u64,
}

/// A capped, shared output buffer; clones write to the same buffer.
#[derive(Clone)]
pub struct CappedPipe {
    capacity: usize,
    buffer: Arc<Mutex<Buffer>>,
}

/// What a pipe held, taken out of it.
pub struct Taken {
    pub text: String,
    pub dropped: u64,
}

impl CappedPipe {
    pub fn new(capacity: usize) -> Self {
        CappedPipe {
            capacity,
            buffer: Arc::default(),
        }
    }

    fn push(&self, bytes: &[u8]) {
        let mut buffer = self.buffer.lock().unwrap_or_else(|e| e.into_inner());
        let room = self.capacity.saturating_sub(buffer.kept.len());
        let keep = bytes.len().min(room);
        buffer.kept.extend_from_slice(&bytes[..keep]);
        buffer.dropped += (bytes.len() - keep) as u64;
    }

    /// Empties the buffer and returns what it held, as lossy UTF-8.
    pub fn take(&self) -> Taken {
        let mut buffer = self.buffer.lock().unwrap_or_else(|e| e.into_inner());
        let taken = std::mem::take(&mut *buffer);
        Taken {
            text: String::from_utf8_lossy(&taken.kept).into_owned(),
            dropped: taken.dropped,
        }
    }
}

impl IsTerminal for CappedPipe {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for CappedPipe {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for CappedPipe {
    async fn ready(&mut self) {}
}

impl OutputStream for CappedPipe {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        // Always ready for a large write; what does not fit is dropped in `write`.
        Ok(1 << 20)
    }
}

impl tokio::io::AsyncWrite for CappedPipe {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.push(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Cuts `s` to at most `max` bytes at a character boundary, marking the cut with `…`
/// (a plugin's fault message or note, kept readable in logs and the status page).
pub(super) fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_first_bytes_and_counts_the_rest() {
        let pipe = CappedPipe::new(5);
        pipe.push(b"hello world");
        pipe.push(b"!");
        let taken = pipe.take();
        assert_eq!(taken.text, "hello");
        assert_eq!(taken.dropped, 7);
        // Taking empties it.
        assert_eq!(pipe.take().text, "");
    }
}
