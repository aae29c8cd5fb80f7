//! Plugin faults: what went wrong in a plugin call, typed so that callers can branch on
//! it, and counted per plugin so that a run can report them.

use serde::Serialize;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// The kinds of plugin fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// The guest trapped: a panic, `unreachable`, a stack overflow, an invalid access.
    Trap,
    /// The call ran past its wall-clock deadline or its fuel budget.
    Timeout,
    /// The guest tried to grow its memory past the cap.
    OutOfMemory,
    /// The call returned, but with something the host refuses: too large, not finite,
    /// malformed JSON.
    BadOutput,
    /// The plugin returned an error of its own (`result::err`).
    GuestError,
    /// The component does not fit this host: another WIT version, a missing export, an
    /// import the host does not provide.
    Incompatible,
    /// A remote environment could not be reached, or closed its connection.
    Connection,
    /// A deferred fork's replay, made at its first call, did not give its original's
    /// state back: a replayed call answered otherwise, or asked the network or the model
    /// for other answers than were recorded.
    Fork,
}

impl FaultKind {
    pub const ALL: [FaultKind; 8] = [
        FaultKind::Trap,
        FaultKind::Timeout,
        FaultKind::OutOfMemory,
        FaultKind::BadOutput,
        FaultKind::GuestError,
        FaultKind::Incompatible,
        FaultKind::Connection,
        FaultKind::Fork,
    ];

    /// The kebab-case name used in logs, metrics and error texts.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Trap => "trap",
            FaultKind::Timeout => "timeout",
            FaultKind::OutOfMemory => "out-of-memory",
            FaultKind::BadOutput => "bad-output",
            FaultKind::GuestError => "guest-error",
            FaultKind::Incompatible => "incompatible",
            FaultKind::Connection => "connection",
            FaultKind::Fork => "fork",
        }
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One failed plugin call, tagged with the plugin's name and version.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("plugin `{plugin}` {kind} in {call}: {message}")]
pub struct Fault {
    /// `name@version` of the plugin.
    pub plugin: String,
    /// The call that failed, e.g. `trigger.fire`.
    pub call: &'static str,
    pub kind: FaultKind,
    pub message: String,
}

impl Fault {
    /// The text a trajectory shows the model in place of a failed tool's output.
    pub fn tool_error_text(&self) -> String {
        match self.kind {
            FaultKind::GuestError => format!("<tool-error>{}</tool-error>", self.message),
            kind => format!("<tool-error>{kind}</tool-error>"),
        }
    }
}

/// Fault counts of one plugin, by kind. Shared by all of the plugin's sessions.
#[derive(Debug, Default)]
pub struct FaultCounts([AtomicU64; FaultKind::ALL.len()]);

impl FaultCounts {
    pub fn record(&self, kind: FaultKind) {
        self.0[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, kind: FaultKind) -> u64 {
        self.0[kind as usize].load(Ordering::Relaxed)
    }

    pub fn total(&self) -> u64 {
        FaultKind::ALL.iter().map(|&kind| self.get(kind)).sum()
    }
}
