//! SIGINT and SIGTERM during training: the first asks the trainer to finish (or abandon)
//! the step in flight and write a checkpoint; a second ends the process at once. `rlhost
//! serve` arms them too ([`arm_saying`]): the first stops it once the calls in flight are
//! answered.
//!
//! Until [`arm`] is called the signals keep their default action (the process ends), so
//! an interruption while the config, plugins or the built-in model are being set up is
//! immediate: there is nothing to save yet. The handler only touches atomics and calls
//! `write` and `_exit`, the async-signal-safe calls.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicUsize, Ordering};

/// Set by the first signal once armed; the trainer polls it.
static REQUESTED: AtomicBool = AtomicBool::new(false);
/// The first signal's number (for the exit code, 128 + signal, as shells report it).
static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// What the first signal says on stderr (a `&'static str`, kept as two atomics: the
/// handler may read nothing else), set by [`arm`] or [`arm_saying`].
static SAYS: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
static SAYS_LEN: AtomicUsize = AtomicUsize::new(0);

const TRAINING: &str = "\nrlhost: interrupted; finishing the step in flight and writing a checkpoint (interrupt again to exit at once)\n";

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
    let (says, len) = (SAYS.load(Ordering::SeqCst), SAYS_LEN.load(Ordering::SeqCst));
    if !says.is_null() {
        // SAFETY: `write` is async-signal-safe; the two atomics hold a `&'static str` set
        // before the handler was installed.
        unsafe {
            libc::write(2, says.cast_const().cast(), len);
        }
    }
}

/// From now on SIGINT and SIGTERM set the flag this returns instead of ending the process
/// (a training run: the first says the step in flight is finished and checkpointed).
pub fn arm() -> &'static AtomicBool {
    arm_saying(TRAINING)
}

/// [`arm`] for another kind of run: the first signal writes `says` (a line of its own) to
/// stderr.
pub fn arm_saying(says: &'static str) -> &'static AtomicBool {
    SAYS_LEN.store(says.len(), Ordering::SeqCst);
    SAYS.store(says.as_ptr().cast_mut(), Ordering::SeqCst);
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
