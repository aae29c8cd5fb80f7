//! What answered a trigger's firing or a finished turn ([`Reply`]): what to insert, how
//! each call went, the faults, the reward, the time, and what becomes of the episode
//! ([`Then`]). Every kind of environment answers with one, so the engine's bookkeeping of
//! calls and faults is written once.

use crate::plugin::{Fault, StepResult};
use crate::task::Message;
use std::time::Duration;

/// What a turn is answered with, and what becomes of the episode.
pub enum Then {
    /// A trigger's output, inserted as it is (`None`: the firing inserts nothing).
    Output(Option<String>),
    /// The turn's calls answered, one `tool` message each.
    Answers(Vec<Message>),
    /// The environment's next turn (a text episode).
    Turn(Vec<Message>),
    /// The episode is over.
    Done,
    /// The episode failed (the fault is in [`Reply::faults`]): the trajectory ends.
    Failed,
}

/// What answered a firing or a turn.
pub struct Reply {
    pub then: Then,
    /// How each function call of the turn went, in order (`ok`, `tool_error`, a malformed
    /// call's kind, `fault`); each counts as a tool call.
    pub kinds: Vec<&'static str>,
    pub faults: Vec<Fault>,
    /// The environment's reward for the turn, summed over its steps.
    pub reward: Option<f64>,
    /// The time the answer took.
    pub took: Duration,
}

impl Reply {
    pub(super) fn new(then: Then) -> Reply {
        Reply {
            then,
            kinds: Vec::new(),
            faults: Vec::new(),
            reward: None,
            took: Duration::ZERO,
        }
    }

    /// An episode's step: its messages (or its end), or its fault. `kinds` are the
    /// turn's calls when the step sent calls (a fault then counts as one more call, the
    /// one it failed on); none when the turn itself was the action.
    pub(super) fn stepped(
        result: Result<(StepResult, Vec<&'static str>), Fault>,
        calls: bool,
    ) -> Reply {
        match result {
            Ok((step, kinds)) => Reply {
                then: match (step.done, calls) {
                    (true, _) => Then::Done,
                    (false, true) => Then::Answers(step.messages),
                    (false, false) => Then::Turn(step.messages),
                },
                kinds,
                reward: step.reward,
                ..Reply::new(Then::Done)
            },
            Err(fault) => Reply {
                kinds: if calls { vec!["fault"] } else { Vec::new() },
                faults: vec![fault],
                ..Reply::new(Then::Failed)
            },
        }
    }
}
