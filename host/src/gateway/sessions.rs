//! The gateway's sessions (issue 46, point 2): each is a URL prefix
//! (`/sessions/{id}/v1/...`) and equally an API key (`Authorization: Bearer {id}`), holds
//! its token-exact recording ([`record::Recording`]), the task it was opened for (with its
//! group, G sessions a task), and the reward the agent reports. An ended session leaves
//! the table as a [`Finished`] for whoever consumes them (the record file of `rlhost
//! serve`, the trainer of a gateway run).

use super::record;
use crate::task::{Message, Sample};
use serde::Serialize;
use serde_json::Value;
use std::collections::HashMap;
use std::time::Instant;

/// The task a session was opened for.
#[derive(Debug, Clone, Serialize)]
pub struct Task {
    /// The dataset's sample id (`None` for a task the agent brought itself).
    pub id: Option<u64>,
    /// The group the session belongs to: sessions of one task handed out together,
    /// whose rewards are compared with each other.
    pub group: u64,
    /// Its place in the group, and the group's size.
    pub index: usize,
    pub group_size: usize,
    pub sample: Sample,
}

/// What an agent reported of a session.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Reward {
    pub total: f64,
    /// Named parts, when reported that way (their sum is `total`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub components: Vec<(String, f64)>,
}

/// One open session.
#[derive(Debug)]
pub struct Open {
    pub task: Task,
    pub record: record::Recording,
    pub reward: Option<Reward>,
    /// The last call's messages and the answer given (choice 0), for reward plugins that
    /// score a session the agent did not reward.
    pub transcript: Vec<Message>,
    pub calls: u64,
    pub opened: Instant,
    pub last_call: Instant,
}

/// An ended session, as the trainer or the record file takes it.
#[derive(Debug, Clone, Serialize)]
pub struct Finished {
    pub session: String,
    pub task: Task,
    pub rows: Vec<record::SessionRow>,
    pub drifts: Vec<record::Drift>,
    pub reward: Option<Reward>,
    pub transcript: Vec<Message>,
    pub calls: u64,
    pub seconds: f64,
    /// Ended by the gateway: its agent was silent past the run's session timeout.
    pub timed_out: bool,
}

/// Why a session could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    #[error("no open session `{0}` (never opened, or ended)")]
    Unknown(String),
    #[error("{0}")]
    Misuse(&'static str),
}

/// The open sessions.
#[derive(Debug, Default)]
pub struct Sessions {
    open: HashMap<String, Open>,
    next_group: u64,
    /// Sessions ever opened, calls that drifted, sessions ended.
    pub opened: u64,
    pub ended: u64,
}

impl Sessions {
    /// Opens a session for `task`; returns its id (which is also its API key).
    pub fn open(&mut self, task: Task) -> String {
        let id = format!("sess_{:024x}", rand::random::<u128>() >> 32);
        let now = Instant::now();
        self.open.insert(
            id.clone(),
            Open {
                task,
                record: record::Recording::default(),
                reward: None,
                transcript: Vec::new(),
                calls: 0,
                opened: now,
                last_call: now,
            },
        );
        self.opened += 1;
        id
    }

    /// A fresh group number.
    pub fn new_group(&mut self) -> u64 {
        self.next_group += 1;
        self.next_group
    }

    pub fn get_mut(&mut self, id: &str) -> Result<&mut Open, SessionError> {
        self.open
            .get_mut(id)
            .ok_or_else(|| SessionError::Unknown(id.to_string()))
    }

    pub fn get(&self, id: &str) -> Result<&Open, SessionError> {
        self.open
            .get(id)
            .ok_or_else(|| SessionError::Unknown(id.to_string()))
    }

    pub fn len(&self) -> usize {
        self.open.len()
    }

    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// Ends a session: it leaves the table. A call still open in it is refused.
    pub fn end(&mut self, id: &str) -> Result<Finished, SessionError> {
        let open = self.get(id)?;
        if open.record.is_open() {
            return Err(SessionError::Misuse(
                "a call of this session is still being answered: end it after the answer",
            ));
        }
        let open = self.open.remove(id).expect("looked up above");
        self.ended += 1;
        Ok(finished(id, open, false))
    }

    /// Ends the sessions with no call open whose last call (or opening) is older than
    /// `timeout`: their agents went away.
    pub fn reap(&mut self, timeout: std::time::Duration) -> Vec<Finished> {
        let old: Vec<String> = self
            .open
            .iter()
            .filter(|(_, o)| !o.record.is_open() && o.last_call.elapsed() > timeout)
            .map(|(id, _)| id.clone())
            .collect();
        old.into_iter()
            .filter_map(|id| {
                let open = self.open.remove(&id)?;
                self.ended += 1;
                Some(finished(&id, open, true))
            })
            .collect()
    }
}

fn finished(id: &str, open: Open, timed_out: bool) -> Finished {
    let (rows, drifts) = open.record.settled();
    Finished {
        session: id.to_string(),
        task: open.task,
        rows,
        drifts,
        reward: open.reward,
        transcript: open.transcript,
        calls: open.calls,
        seconds: open.opened.elapsed().as_secs_f64(),
        timed_out,
    }
}

/// The largest reward magnitude taken (a total, or one part). A group's mean and variance
/// are computed from the rewards: parts of 1e308 each were finite but summed to +inf, and
/// one such session stopped a run at its first step.
pub const MAX_REWARD: f64 = 1e9;

/// Reads a reward body: `{"reward": x}` or `{"rewards": {"name": x, ...}}` (summed), each
/// number and the total within ±[`MAX_REWARD`].
pub fn read_reward(body: &Value) -> Result<Reward, String> {
    let reward = read_parts(body)?;
    // The parts are each within the bound (so finite); their sum may not be.
    if reward.total.abs() > MAX_REWARD {
        return Err(format!(
            "the rewards sum to {}; the total must be within ±{MAX_REWARD:e}",
            reward.total
        ));
    }
    Ok(reward)
}

fn read_parts(body: &Value) -> Result<Reward, String> {
    let finite = |x: &Value, what: &str| {
        x.as_f64()
            .filter(|x| x.abs() <= MAX_REWARD)
            .ok_or_else(|| format!("`{what}` must be a number within ±{MAX_REWARD:e}, got {x}"))
    };
    match (body.get("reward"), body.get("rewards")) {
        (Some(x), None) => Ok(Reward {
            total: finite(x, "reward")?,
            components: Vec::new(),
        }),
        (None, Some(Value::Object(parts))) if !parts.is_empty() => {
            let mut components = Vec::with_capacity(parts.len());
            for (name, x) in parts {
                components.push((name.clone(), finite(x, &format!("rewards.{name}"))?));
            }
            Ok(Reward {
                total: components.iter().map(|(_, x)| x).sum(),
                components,
            })
        }
        _ => Err(
            "send `{\"reward\": NUMBER}` or `{\"rewards\": {\"NAME\": NUMBER, ...}}`".to_string(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rewards_read_as_a_number_or_named_parts() {
        assert_eq!(read_reward(&json!({"reward": 0.5})).unwrap().total, 0.5);
        let r = read_reward(&json!({"rewards": {"format": 0.25, "answer": 1}})).unwrap();
        assert_eq!(r.total, 1.25);
        assert_eq!(r.components.len(), 2);
        for bad in [
            json!({}),
            json!({"reward": "1"}),
            json!({"reward": 1, "rewards": {"a": 1}}),
            json!({"rewards": {}}),
            json!({"rewards": {"a": null}}),
            // Each part is finite; their sum is not.
            json!({"rewards": {"a": 1e308, "b": 1e308}}),
            json!({"reward": 1e300}),
        ] {
            assert!(read_reward(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_ended_session_leaves_with_its_recording() {
        let mut s = Sessions::default();
        let group = s.new_group();
        let id = s.open(Task {
            id: Some(3),
            group,
            index: 0,
            group_size: 1,
            sample: Sample::from_prompt("hi"),
        });
        let open = s.get_mut(&id).unwrap();
        open.record.begin_call(&[1, 2], 1).unwrap();
        assert!(matches!(s.end(&id), Err(SessionError::Misuse(_))));
        s.get_mut(&id)
            .unwrap()
            .record
            .finish_call(0, &[3], &[-0.5], 0)
            .unwrap();
        let done = s.end(&id).unwrap();
        assert_eq!(done.rows[0].tokens, [1, 2, 3]);
        assert!(matches!(s.end(&id), Err(SessionError::Unknown(_))));
        assert!(s.is_empty());
        // A silent session is reaped; a fresh one is not.
        let silent = s.open(Task {
            id: None,
            group,
            index: 0,
            group_size: 1,
            sample: Sample::from_prompt("hi"),
        });
        assert!(s.reap(std::time::Duration::from_secs(60)).is_empty());
        std::thread::sleep(std::time::Duration::from_millis(5));
        let reaped = s.reap(std::time::Duration::from_millis(1));
        assert_eq!(reaped.len(), 1);
        assert!(reaped[0].timed_out && reaped[0].session == silent);
    }
}
