//! SIGINT and SIGTERM during training: the first asks the trainer to finish (or abandon)
//! the step in flight and write a checkpoint; a second ends the process at once.
//!
//! Until [`arm`] is called the signals keep their default action (the process ends), so
//! an interruption while the config, plugins or the built-in model are being set up is
//! immediate: there is nothing to save yet. The handler only touches atomics and calls
//! `write` and `_exit`, the async-signal-safe calls.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// Set by the first signal once armed; the trainer polls it.
static REQUESTED: AtomicBool = AtomicBool::new(false);
/// The first signal's number (for the exit code, 128 + signal, as shells report it).
static SIGNAL: AtomicI32 = AtomicI32::new(0);

/// A run that ended because it was interrupted, after writing what it had. `main` exits
/// with 128 + the signal's number and prints the message without an `error:` prefix.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Interrupted {
    pub signal: i32,
    pub message: String,
}

impl Interrupted {
    pub fn exit_code(&self) -> u8 {
        u8::try_from(128 + self.signal).unwrap_or(1)
    }
}

extern "C" fn on_signal(signal: libc::c_int) {
    // The number first: whoever sees the flag set finds it.
    let _ = SIGNAL.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
    if REQUESTED.swap(true, Ordering::SeqCst) {
        // SAFETY: `_exit` is async-signal-safe; a second signal means "now".
        unsafe { libc::_exit(128 + signal) };
    }
    let msg: &[u8] = b"\nrlhost: interrupted; finishing the step in flight and writing a checkpoint (interrupt again to exit at once)\n";
    // SAFETY: `write` is async-signal-safe and the buffer outlives the call.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
    }
}

/// From now on SIGINT and SIGTERM set the flag this returns instead of ending the process.
pub fn arm() -> &'static AtomicBool {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction with our handler and an empty mask is valid; the
        // handler is an `extern "C"` function that lives as long as the process.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            // Blocking calls resume instead of failing with EINTR.
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(signal, &action, std::ptr::null_mut()) != 0 {
                tracing::warn!("cannot install a handler for signal {signal}");
            }
        }
    }
    &REQUESTED
}

/// Gives SIGINT and SIGTERM their default action back (the run is over: nothing is left
/// to save, and a Ctrl-C during `--status-linger` should end the process).
pub fn disarm() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: restoring the default disposition of a signal is always valid.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
        }
    }
}

/// The signal that set the flag (SIGINT when none was recorded).
pub fn signal() -> i32 {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => libc::SIGINT,
        s => s,
    }
}

/// `SIGINT` / `SIGTERM` for messages.
pub fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}
