//! Forking a plugin session: a new session whose plugin state is the original's at the
//! fork, and which goes its own way from then on (issue 67's tree rollouts give each
//! branch one).
//!
//! The fork replays: it opens a fresh instance of the same plugin with the same
//! arguments and seed, and makes every call the original made on its live instance
//! again, in order. That is exact because everything a plugin sees from outside is the
//! host's and per instance: its random numbers are seeded, its clocks are virtual
//! ([`super::clock`]), and wasm computes the same on the same inputs. Each replayed call
//! must answer what it answered the first time (the log keeps a digest of each answer);
//! one that does not means the plugin reads something the host does not supply, and the
//! fork is refused rather than handed on in another state.
//!
//! Two inputs come from outside the host's making: HTTP answers (the network answers as
//! it likes) and `model.generate` answers (the model changes between updates, and samples
//! with the trajectory's seed). Each instance records them on its tape ([`super::tape`]),
//! and the replay is served the recorded answers, each checked against the request that
//! asked for it the first time.
//!
//! A replay costs the open plus the guest time of every earlier call, which grows with
//! the session; copying the instance's memory instead costs the same whatever its history,
//! and needs a patch to wasmtime (`docs/design/plugin-fork.md`).
//!
//! So a fork can also be **deferred** ([`Session::fork_deferred`]): it copies the log and
//! the tape (a few microseconds) and opens nothing; its first call replays them, then
//! runs. What it replays is fixed at the fork, so it gives the same state whenever that
//! is; a branch that never calls the plugin again (a tree's branch after a tool's output
//! often just answers) never pays for an instance. A replay that fails then is that
//! call's fault (kind `fork`) rather than the fork's error.

use super::fault::Fault;
use super::session::{Kind, Session};
use super::tape::Recorded;
use super::types::Transcript;
use std::fmt;
use std::hash::{DefaultHasher, Hasher};

/// One call a session made on its instance, as a replay makes it again.
#[derive(Debug, Clone, PartialEq)]
pub enum GuestCall {
    /// `trigger.fire` on the text so far.
    Fire(String),
    /// `environment.step` on the assistant's turn.
    Step(String),
    /// `dataset.get` of an index.
    Get(u64),
    /// `reward.score` of a trajectory.
    Score(Transcript),
    /// `tools.call` of a function with its arguments.
    Invoke { name: String, arguments: String },
}

impl GuestCall {
    /// The call's name, as faults name it.
    pub fn name(&self) -> &'static str {
        match self {
            GuestCall::Fire(_) => "trigger.fire",
            GuestCall::Step(_) => "environment.step",
            GuestCall::Get(_) => "dataset.get",
            GuestCall::Score(_) => "reward.score",
            GuestCall::Invoke { .. } => "tools.call",
        }
    }
}

/// A call in a session's log, with the digest of what the guest answered.
#[derive(Debug, Clone)]
pub struct Logged {
    pub call: GuestCall,
    pub answer: u64,
}

/// The digest of a guest's answer: a hash of its `Debug` text, which shows every field.
/// Compared only within one process, so the std hasher (fixed keys) does.
pub fn digest(answer: &impl fmt::Debug) -> u64 {
    struct Feed(DefaultHasher);
    impl fmt::Write for Feed {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            self.0.write(s.as_bytes());
            Ok(())
        }
    }
    let mut feed = Feed(DefaultHasher::new());
    fmt::write(&mut feed, format_args!("{answer:?}")).expect("hashing cannot fail");
    feed.0.finish()
}

/// What a deferred fork replays when it is first called: its original's calls and the
/// outside answers they got, as they stood at the fork. A fork of a deferred fork clones
/// it: the HTTP exchanges are settled ([`super::tape::Tape::snapshot`]), and a replay
/// only reads them.
#[derive(Clone)]
pub(super) struct Pending {
    pub(super) log: Vec<Logged>,
    pub(super) answers: Vec<Recorded>,
}

/// Why a session could not be forked.
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    /// The plugin reads something a replay cannot give it again ([`Plugin::forkable`]).
    #[error("{0}")]
    Refused(String),
    /// Opening the fork's instance, or a replayed call, faulted.
    #[error("forking a session: {0}")]
    Fault(#[from] Fault),
    /// The replay asked the network or the model for other answers than the session
    /// received (or the session had a request still open).
    #[error("plugin `{plugin}` cannot be forked: {why}")]
    Answers { plugin: String, why: String },
    /// An episode served from elsewhere (an OpenEnv server's, `by` as its faults name
    /// it: `openenv:<url>`) that could not be forked, and why.
    #[error("{why}")]
    Elsewhere { by: String, why: String },
    /// A replayed call answered otherwise than the first time.
    #[error(
        "plugin `{plugin}` cannot be forked: replaying call {index} of the session (`{call}`) answered otherwise than the first time, so the plugin reads something the host does not supply (a file that changed?)"
    )]
    Diverged {
        plugin: String,
        index: usize,
        call: &'static str,
    },
}

impl<K: Kind> Session<K> {
    /// A new session whose plugin state is this one's now; the two are independent from
    /// then on, and answer the same calls alike (their random numbers and clocks go on
    /// from the same point). The replay is made here, so a fork that cannot be made is
    /// this call's error. A session whose instance faulted has nothing to copy: its fork,
    /// like it, opens a fresh instance at its next call. (`&mut`, though nothing in it
    /// changes: a session is not `Sync`, so only a unique borrow can be held across the
    /// replay on the worker pool.)
    pub async fn fork(&mut self) -> Result<Session<K>, ForkError> {
        let mut fork = self.fork_deferred()?;
        fork.replay_pending().await?;
        Ok(fork)
    }

    /// [`Self::fork`], the replay deferred to the fork's first call: the log and the
    /// outside answers are copied now, and nothing is opened. Refused here as `fork` is
    /// for a role that does not fork or a request still open; a replay that fails later
    /// is its first call's fault.
    pub fn fork_deferred(&self) -> Result<Session<K>, ForkError> {
        if !K::FORKS {
            return Err(ForkError::Refused(format!(
                "a {} session cannot be forked: it keeps no log of its calls",
                K::ROLE
            )));
        }
        let pending = match (self.pending(), self.tape()) {
            (Some(pending), _) => Some(pending.clone()),
            (None, Some(tape)) => Some(Pending {
                log: self.log().to_vec(),
                answers: tape.snapshot().map_err(|why| ForkError::Answers {
                    plugin: self.plugin().name().to_string(),
                    why,
                })?,
            }),
            (None, None) => None,
        };
        Ok(self.unopened(pending))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_digest_sees_every_field() {
        let a: Result<Option<String>, String> = Ok(Some("<result>4</result>".into()));
        let b: Result<Option<String>, String> = Ok(Some("<result>5</result>".into()));
        let c: Result<Option<String>, String> = Err("<result>4</result>".into());
        assert_eq!(digest(&a), digest(&a.clone()));
        assert_ne!(digest(&a), digest(&b));
        assert_ne!(digest(&a), digest(&c));
    }

    #[test]
    fn calls_are_named_as_faults_name_them() {
        let invoke = GuestCall::Invoke {
            name: "convert".into(),
            arguments: "{}".into(),
        };
        assert_eq!(invoke.name(), "tools.call");
        assert_eq!(GuestCall::Fire(String::new()).name(), "trigger.fire");
        assert_eq!(GuestCall::Get(3).name(), "dataset.get");
    }
}
