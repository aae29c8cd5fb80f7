//! A session's token-exact recording (issue 46, point 3): each call's prompt, rendered by
//! the model's chat template, either extends the session's current row exactly (the row's
//! prompt, then every completion and inserted turn so far, is a prefix of it) and the new
//! ids are inserted, masked from the loss; or it does not (the agent edited history,
//! dropped a turn, or a re-rendering tokenized differently), and a new row starts, the
//! drift counted where it happened: Agent Lightning's rule (verl notes that re-rendered
//! history keeps PPO from converging). Sampled ids and their log-probs are the engine's,
//! never re-tokenized.
//!
//! A call with `n` choices leaves them pending on its row: the row takes the choice the
//! next call's prompt continues (an agent may go on with any of them), or choice 0 when
//! none does or the session ends. The choices not taken are not trained on: the session's
//! reward is for the path the agent followed.

/// One row of a session: a trajectory grown call by call.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize)]
pub struct SessionRow {
    /// Prompt, then completions and inserted turns, exactly as the model saw them.
    pub tokens: Vec<u32>,
    /// The first call's prompt length: the row's prompt.
    pub prompt_len: usize,
    /// Per token after the prompt: the sampling log-prob of a sampled token, `None` for
    /// an inserted one.
    pub logps: Vec<Option<f32>>,
    /// The policy version each call of the row was answered by, in order.
    pub versions: Vec<u64>,
}

impl SessionRow {
    /// Tokens sampled by the model in this row.
    pub fn sampled(&self) -> usize {
        self.logps.iter().filter(|l| l.is_some()).count()
    }
}

/// Where a call's prompt left its session's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Drift {
    /// The row it left.
    pub row: usize,
    /// The first token index at which the prompt and the row differ (the prompt's length
    /// when it is a proper prefix of the row: the agent dropped the end).
    pub at: usize,
}

/// What [`Recording::begin_call`] did with a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    /// The session's first call: row 0 starts with the prompt.
    First,
    /// The prompt extends the current row; `inserted` new ids were added (masked).
    Extended { inserted: usize },
    /// The prompt does not extend the current row: a new row starts with it.
    Drifted(Drift),
}

/// A sampled choice of the last call, waiting for the row to take it or not.
#[derive(Debug, Clone, PartialEq)]
struct Choice {
    ids: Vec<u32>,
    logps: Vec<f32>,
    version: u64,
}

/// A session's rows and the drifts between them.
#[derive(Debug, Clone, Default)]
pub struct Recording {
    pub rows: Vec<SessionRow>,
    pub drifts: Vec<Drift>,
    /// A call begun and not yet finished (its prompt placed, its choices not all sampled).
    open: bool,
    /// The last call's choices by index (`None`: not sampled), pending on the last row.
    choices: Vec<Option<Choice>>,
}

impl Recording {
    /// Places a call's rendered prompt: extends the current row or starts a new one.
    /// Calls of a session are sequential (an agent waits for each answer): a call begun
    /// while another is open is refused, naming why.
    pub fn begin_call(&mut self, prompt: &[u32], n: usize) -> Result<Placed, &'static str> {
        if self.open {
            return Err("a session answers one call at a time: wait for the last answer");
        }
        if prompt.is_empty() {
            return Err("the rendered prompt is empty");
        }
        if n == 0 {
            return Err("a call samples at least one choice");
        }
        self.settle(Some(prompt));
        let placed = match self.rows.last_mut() {
            None => {
                self.rows.push(SessionRow::fresh(prompt));
                Placed::First
            }
            Some(row) if prompt.len() >= row.tokens.len() && prompt.starts_with(&row.tokens) => {
                let new = &prompt[row.tokens.len()..];
                row.tokens.extend_from_slice(new);
                row.logps.extend(std::iter::repeat_n(None, new.len()));
                Placed::Extended {
                    inserted: new.len(),
                }
            }
            Some(row) => {
                let at = row
                    .tokens
                    .iter()
                    .zip(prompt)
                    .position(|(a, b)| a != b)
                    .unwrap_or(prompt.len().min(row.tokens.len()));
                let drift = Drift {
                    row: self.rows.len() - 1,
                    at,
                };
                self.drifts.push(drift);
                self.rows.push(SessionRow::fresh(prompt));
                Placed::Drifted(drift)
            }
        };
        self.open = true;
        self.choices = vec![None; n];
        Ok(placed)
    }

    /// Keeps choice `choice` of the open call (its sampled ids and their log-probs, one
    /// each); the call is finished once every choice is in.
    pub fn finish_call(
        &mut self,
        choice: usize,
        ids: &[u32],
        logps: &[f32],
        version: u64,
    ) -> Result<(), &'static str> {
        if !self.open {
            return Err("no call is open in this session");
        }
        if ids.len() != logps.len() {
            return Err("a sampled id without its log-prob");
        }
        let Some(slot) = self.choices.get_mut(choice) else {
            return Err("no such choice in the open call");
        };
        *slot = Some(Choice {
            ids: ids.to_vec(),
            logps: logps.to_vec(),
            version,
        });
        self.open = self.choices.iter().any(Option::is_none);
        Ok(())
    }

    /// The last row takes the pending choice that `next` (the next call's prompt)
    /// continues, else the first sampled one (choice 0 unless it failed).
    fn settle(&mut self, next: Option<&[u32]>) {
        let choices = std::mem::take(&mut self.choices);
        let Some(row) = self.rows.last_mut() else {
            return;
        };
        let sampled = || choices.iter().flatten();
        let continued = next.and_then(|p| {
            sampled().find(|c| {
                p.len() >= row.tokens.len() + c.ids.len()
                    && p.starts_with(&row.tokens)
                    && p[row.tokens.len()..].starts_with(&c.ids)
            })
        });
        if let Some(c) = continued.or_else(|| sampled().next()) {
            row.tokens.extend_from_slice(&c.ids);
            row.logps.extend(c.logps.iter().map(|&l| Some(l)));
            row.versions.push(c.version);
        }
    }

    /// The rows as they train: the last call's pending choice taken (choice 0).
    pub fn settled(mut self) -> (Vec<SessionRow>, Vec<Drift>) {
        self.settle(None);
        (self.rows, self.drifts)
    }

    /// [`Recording::settled`] without giving the session up (for a view of it).
    pub fn settled_rows(&self) -> Vec<SessionRow> {
        self.clone().settled().0
    }

    /// Whether a call is begun and not yet finished.
    pub fn is_open(&self) -> bool {
        self.open
    }

    /// Ends an open call before all its choices are in (the client went away, the
    /// request failed): the prompt's inserted ids stay, as the next call's prompt will
    /// hold them, and so do the choices sampled so far.
    pub fn abandon_call(&mut self) {
        self.open = false;
    }
}

impl SessionRow {
    fn fresh(prompt: &[u32]) -> SessionRow {
        SessionRow {
            tokens: prompt.to_vec(),
            prompt_len: prompt.len(),
            ..SessionRow::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Prompt, answer, a tool result and a second answer: one row whose loss mask covers
    /// the two answers alone, each with its log-probs and version.
    #[test]
    fn an_agent_that_replays_history_grows_one_row() {
        let mut s = Recording::default();
        assert_eq!(s.begin_call(&[1, 2, 3], 1), Ok(Placed::First));
        s.finish_call(0, &[10, 11], &[-0.5, -0.25], 4).unwrap();
        // The next prompt: everything so far, then the tool turn [20, 21, 22].
        assert_eq!(
            s.begin_call(&[1, 2, 3, 10, 11, 20, 21, 22], 1),
            Ok(Placed::Extended { inserted: 3 })
        );
        s.finish_call(0, &[12], &[-1.0], 5).unwrap();
        let (rows, drifts) = s.settled();
        assert_eq!(rows.len(), 1);
        let row = &rows[0];
        assert_eq!(row.tokens, [1, 2, 3, 10, 11, 20, 21, 22, 12]);
        assert_eq!(row.prompt_len, 3);
        assert_eq!(
            row.logps,
            [Some(-0.5), Some(-0.25), None, None, None, Some(-1.0)]
        );
        assert_eq!((row.sampled(), row.versions.clone()), (3, vec![4, 5]));
        assert!(drifts.is_empty());
    }

    /// An edited history, a dropped ending and a re-tokenized answer each start a new
    /// row, the drift recorded where the prompt left the row.
    #[test]
    fn a_prompt_that_leaves_the_row_starts_another() {
        let mut s = Recording::default();
        s.begin_call(&[1, 2, 3], 1).unwrap();
        s.finish_call(0, &[10, 11], &[-0.1, -0.2], 0).unwrap();
        // The answer re-rendered as [10, 99]: drift at index 4.
        assert_eq!(
            s.begin_call(&[1, 2, 3, 10, 99, 7], 1),
            Ok(Placed::Drifted(Drift { row: 0, at: 4 }))
        );
        s.finish_call(0, &[5], &[-0.3], 1).unwrap();
        // A prompt that is a proper prefix of the row (the agent dropped the end).
        assert_eq!(
            s.begin_call(&[1, 2], 1),
            Ok(Placed::Drifted(Drift { row: 1, at: 2 }))
        );
        s.abandon_call();
        assert_eq!(s.rows.len(), 3);
        assert_eq!(s.rows[1].prompt_len, 6);
        assert_eq!(s.rows[1].logps, [Some(-0.3)]);
        assert_eq!(s.drifts.len(), 2);
        // The abandoned call's row keeps its prompt; the next call extends it.
        assert_eq!(
            s.begin_call(&[1, 2, 8], 1),
            Ok(Placed::Extended { inserted: 1 })
        );
    }

    /// Overlapping calls, an empty prompt, no choices, a choice out of range and
    /// mismatched log-probs are refused.
    #[test]
    fn misuse_is_refused() {
        let mut s = Recording::default();
        assert!(s.begin_call(&[], 1).is_err());
        assert!(s.begin_call(&[1], 0).is_err());
        assert!(s.finish_call(0, &[1], &[-1.0], 0).is_err());
        s.begin_call(&[1], 1).unwrap();
        assert!(s.begin_call(&[1], 1).is_err());
        assert!(s.finish_call(0, &[2, 3], &[-1.0], 0).is_err());
        assert!(s.finish_call(1, &[2], &[-1.0], 0).is_err());
        s.finish_call(0, &[2], &[-1.0], 0).unwrap();
    }

    /// A call of three choices: the next call goes on from choice 2, and the row takes
    /// it (sampled, with its log-probs), with no drift. A last call's choices, never
    /// continued, leave choice 0 on the row.
    #[test]
    fn the_row_takes_the_choice_the_agent_continues() {
        let mut s = Recording::default();
        s.begin_call(&[1, 2], 3).unwrap();
        // Choices may end in any order (streamed).
        s.finish_call(2, &[30, 31], &[-0.3, -0.31], 0).unwrap();
        assert!(s.is_open());
        s.finish_call(0, &[10], &[-0.1], 0).unwrap();
        s.finish_call(1, &[20], &[-0.2], 0).unwrap();
        assert!(!s.is_open());
        assert_eq!(
            s.begin_call(&[1, 2, 30, 31, 7], 2),
            Ok(Placed::Extended { inserted: 1 })
        );
        s.finish_call(1, &[41], &[-0.41], 1).unwrap();
        s.finish_call(0, &[40], &[-0.4], 1).unwrap();
        assert_eq!(s.settled_rows()[0].tokens, [1, 2, 30, 31, 7, 40]);
        let (rows, drifts) = s.settled();
        assert_eq!(rows.len(), 1);
        assert!(drifts.is_empty());
        assert_eq!(rows[0].logps, [Some(-0.3), Some(-0.31), None, Some(-0.4)]);
        assert_eq!(rows[0].versions, [0, 1]);
    }
}
