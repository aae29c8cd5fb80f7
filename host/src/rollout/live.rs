//! One trajectory while it is sampled ([`Live`]): its ids and their log-probs, its
//! incrementally decoded text, its sessions, where its turn began, what was inserted,
//! and its counts; how inserted text is appended within the limits, how a stop pattern
//! is found in new text only, and the [`Trajectory`] it becomes.

use super::env::TrajectorySessions;
use super::settings::RolloutLimits;
use super::trajectory::{FaultRecord, SpanKind, StopReason, TokenSpan, Trajectory};
use super::tree::TreePlace;
use crate::model::tokenizer::{IncrementalDecoder, Tokenizer};
use crate::sampler::{Held, Ticket};
use crate::task::{Message, Sample};
use anyhow::Result;

/// A trajectory's ids: the prompt, then sampled and inserted ones, with the sampling
/// log-prob of each sampled one (`None`: inserted).
#[derive(Clone)]
pub(super) struct Ids {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub logps: Vec<Option<f32>>,
}

impl Ids {
    pub fn new(prompt: Vec<u32>) -> Ids {
        Ids {
            prompt_len: prompt.len(),
            tokens: prompt,
            logps: Vec::new(),
        }
    }

    pub fn push(&mut self, token: u32, logp: f32) {
        self.tokens.push(token);
        self.logps.push(Some(logp));
    }

    fn append(&mut self, ids: &[u32]) {
        self.tokens.extend_from_slice(ids);
        self.logps.extend(ids.iter().map(|_| None));
    }

    fn completion(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum State {
    /// Its sessions are still opening; it joins the decode once they are open, while the
    /// trajectories whose sessions are open already decode.
    Opening,
    /// Sampling: it has a request on the sampler, or gets one at the next round.
    Active,
    /// A call of its (a firing, a turn's answer) is in flight.
    Waiting,
    Done(StopReason),
}

/// A branch point under measurement (`branch_at = "entropy"`): the trajectory as it was
/// there, its cache forked, and the surprisal of the tokens it sampled since.
pub(super) struct Probe<'t> {
    /// The branch point, in completion tokens.
    pub at: usize,
    /// The trajectory at the branch point: what its branches are copies of.
    pub there: Live<'t>,
    pub tokens: usize,
    pub surprisal: f64,
}

/// One trajectory while it is being sampled.
pub(super) struct Live<'t> {
    /// Its place in the batch's trajectories (branches are added at the end).
    pub t: usize,
    pub sample: usize,
    pub index: usize,
    /// Its place in its group's tree (tree rollouts).
    pub tree: Option<TreePlace>,
    /// With `branch_at = "entropy"`: the branch point it may branch at once the tokens
    /// after it are measured.
    pub probe: Option<Box<Probe<'t>>>,
    /// Completion tokens it had when it was forked from its parent (a branch), and how
    /// many of them were sampled: counted once, in the parent's figures.
    pub inherited: usize,
    pub inherited_sampled: usize,
    pub ids: Ids,
    /// Its request on the sampler and the choice it is there (none while it waits, or
    /// between two parts), and what continues it meanwhile (its KV cache, its server).
    pub ticket: Option<(Ticket, usize)>,
    pub held: Option<Held>,
    /// Numbers its requests (0 is its group's prefill): tokens of an earlier one that
    /// are still on their way are not its.
    pub request: u64,
    pub dec: IncrementalDecoder<'t>,
    pub state: State,
    /// What answers its turns (none while they open or a call of theirs runs).
    pub env: Option<TrajectorySessions>,
    /// Its trigger's stop patterns (copied when its sessions open).
    pub patterns: Vec<String>,
    pub call_kinds: std::collections::BTreeMap<String, u32>,
    /// Byte offset in the decoded text where a stop pattern may start: the end of the
    /// last insertion (patterns inside inserted text never fire).
    pub scan_from: usize,
    /// Index in `ids.tokens` where the current assistant turn began.
    pub turn_start: usize,
    pub turn_tokens: usize,
    /// Whether the model is inside an assistant turn not yet recorded in `messages`.
    pub turn_open: bool,
    /// Length of the decoded text before the last sampled token: what was searched for
    /// stop patterns already.
    pub checked: usize,
    /// Inserted spans, in completion token indices; model spans are the gaps.
    inserted: Vec<(SpanKind, usize, usize)>,
    pub messages: Vec<Message>,
    pub turns: u32,
    pub tool_calls: u32,
    tool_truncations: u32,
    pub faults: Vec<FaultRecord>,
    pub env_reward: Option<f64>,
    /// The trajectory's seed and the sampling requests it made so far (a request to a
    /// server is seeded by both; in process it draws from its own generator throughout).
    pub seed: u64,
    pub requests: u64,
}

impl<'t> Live<'t> {
    /// Trajectory `index` of the batch's `sample`th sample, about to decode after its
    /// `prompt` (its `messages`); `opening` while its sessions open.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        tokenizer: &'t Tokenizer,
        t: usize,
        sample: usize,
        index: usize,
        seed: u64,
        prompt: Vec<u32>,
        messages: Vec<Message>,
        env: Option<TrajectorySessions>,
        fault: Option<FaultRecord>,
    ) -> Live<'t> {
        let first = prompt.len();
        Live {
            t,
            sample,
            index,
            tree: None,
            probe: None,
            inherited: 0,
            inherited_sampled: 0,
            ids: Ids::new(prompt),
            ticket: None,
            held: None,
            request: 0,
            dec: IncrementalDecoder::new(tokenizer, false),
            state: if env.is_some() {
                State::Active
            } else {
                State::Opening
            },
            patterns: env
                .as_ref()
                .map_or_else(Vec::new, |e| e.stop_patterns().to_vec()),
            env,
            call_kinds: Default::default(),
            scan_from: 0,
            turn_start: first,
            turn_tokens: 0,
            turn_open: true,
            checked: 0,
            inserted: Vec::new(),
            messages,
            turns: 0,
            tool_calls: 0,
            tool_truncations: 0,
            faults: fault.into_iter().collect(),
            env_reward: None,
            seed,
            requests: 0,
        }
    }

    /// A branch of this trajectory where it is now (a tree rollout): trajectory `t` of the
    /// batch, `index` in its group, at `place`, drawing from `seed`, with `held` (a fork
    /// of this one's cache) to continue from. Its sessions are forked apart: it waits for
    /// them ([`Self::opened`]).
    pub fn branch(
        &self,
        t: usize,
        index: usize,
        place: TreePlace,
        seed: u64,
        held: Option<Held>,
    ) -> Live<'t> {
        Live {
            t,
            sample: self.sample,
            index,
            tree: Some(place),
            probe: None,
            inherited: self.ids.logps.len(),
            inherited_sampled: self.ids.logps.iter().flatten().count(),
            ids: self.ids.clone(),
            ticket: None,
            held,
            request: 0,
            dec: self.dec.clone(),
            state: State::Opening,
            env: None,
            patterns: self.patterns.clone(),
            call_kinds: self.call_kinds.clone(),
            scan_from: self.scan_from,
            turn_start: self.turn_start,
            turn_tokens: self.turn_tokens,
            turn_open: self.turn_open,
            checked: self.checked,
            inserted: self.inserted.clone(),
            messages: self.messages.clone(),
            turns: self.turns,
            tool_calls: self.tool_calls,
            tool_truncations: self.tool_truncations,
            faults: self.faults.clone(),
            env_reward: self.env_reward,
            seed,
            requests: 0,
        }
    }

    /// Its sessions have opened (those that could): it decodes from now on.
    pub fn opened(&mut self, sessions: TrajectorySessions) {
        self.patterns = sessions.stop_patterns().to_vec();
        self.env = Some(sessions);
        if self.state == State::Opening {
            self.state = State::Active;
        }
    }

    /// Where a search for `patterns` must start so that it sees every occurrence ending
    /// in the last token's text and nothing before the last insertion: an occurrence that
    /// ended earlier was found by an earlier search. Searching only this tail keeps
    /// matching proportional to the new text, not to the turn.
    pub fn search_from(&self, patterns: &[String]) -> usize {
        let longest = patterns.iter().map(String::len).max().unwrap_or(0);
        let text = self.dec.text();
        let mut from = self
            .checked
            .saturating_sub(longest.saturating_sub(1))
            .max(self.scan_from);
        while from < text.len() && !text.is_char_boundary(from) {
            from -= 1;
        }
        from.max(self.scan_from).min(text.len())
    }

    /// A tool output's ids cut to `max_tool_output_tokens`, the truncation marker's ids
    /// last, when longer (counted on the trajectory).
    pub fn cut(
        &mut self,
        tok: &Tokenizer,
        lim: &RolloutLimits,
        mut ids: Vec<u32>,
    ) -> Result<Vec<u32>> {
        if ids.len() > lim.max_tool_output_tokens {
            let marker = tok.encode(&lim.truncation_marker)?;
            ids.truncate(lim.max_tool_output_tokens.saturating_sub(marker.len()));
            ids.extend(marker);
            self.tool_truncations += 1;
        }
        Ok(ids)
    }

    /// Appends inserted ids (not trained on), as many as fit the length limit.
    pub fn insert_ids(
        &mut self,
        lim: &RolloutLimits,
        mut ids: Vec<u32>,
        kind: SpanKind,
    ) -> Result<()> {
        let room = lim.max_total_tokens.saturating_sub(self.ids.tokens.len());
        if ids.len() >= room {
            // No room left to answer: keep what fits and end here.
            ids.truncate(room);
            self.state = State::Done(StopReason::TotalTokens);
        }
        let start = self.ids.tokens.len() - self.ids.prompt_len;
        self.ids.append(&ids);
        for &id in &ids {
            self.dec.push(id)?;
        }
        self.inserted.push((kind, start, start + ids.len()));
        self.scan_from = self.dec.text().len();
        Ok(())
    }

    /// The finished trajectory, with its sessions released.
    pub fn finish(
        &mut self,
        tok: &Tokenizer,
        (id, sample): &(u64, Sample),
        stop: StopReason,
        version: u64,
    ) -> Result<Trajectory> {
        self.env = None;
        self.dec.flush()?;
        // A turn cut off by a limit is still the model's text: it goes in the messages.
        if self.turn_open {
            self.turn_open = false;
            let content = tok.decode(&self.ids.tokens[self.turn_start..], false)?;
            self.messages.push(Message {
                role: "assistant".into(),
                content,
                ..Default::default()
            });
            self.turns += 1;
        }
        let completion = self.ids.completion().to_vec();
        let mut spans = Vec::new();
        let mut at = 0;
        let push = |kind, start: usize, end: usize, spans: &mut Vec<TokenSpan>| -> Result<()> {
            if end > start {
                spans.push(TokenSpan {
                    kind,
                    start,
                    end,
                    text: tok.decode(&completion[start..end], false)?,
                });
            }
            Ok(())
        };
        for &(kind, start, end) in &self.inserted {
            push(SpanKind::Model, at, start, &mut spans)?;
            push(kind, start, end, &mut spans)?;
            at = end;
        }
        push(SpanKind::Model, at, completion.len(), &mut spans)?;
        // Frees the KV cache now (a measured branch point's copy too), not when the batch
        // ends.
        self.held = None;
        self.probe = None;
        let ids = std::mem::replace(&mut self.ids, Ids::new(Vec::new()));
        Ok(Trajectory {
            sample_id: *id,
            index: self.index,
            version,
            prompt_len: ids.prompt_len,
            tokens: ids.tokens,
            logps: ids.logps,
            spans,
            messages: std::mem::take(&mut self.messages),
            completion: self.dec.text().to_string(),
            metadata: sample.metadata.clone(),
            turns: self.turns,
            tool_calls: self.tool_calls,
            tool_truncations: self.tool_truncations,
            call_kinds: std::mem::take(&mut self.call_kinds),
            stop,
            truncated: stop.truncated(),
            faults: std::mem::take(&mut self.faults),
            notes: Default::default(),
            rewards: Default::default(),
            reward: 0.0,
            tree: self.tree.take(),
        })
    }
}

/// The end (byte offset) of the first pattern occurrence that starts at or after `from`,
/// if any. The text before the last token was checked already, and after a match
/// `from` moves past it, so a pattern matches once. (`rlhost plugin call` cuts an
/// author's text with it, as a rollout would.)
pub fn new_match(text: &str, from: usize, patterns: &[String]) -> Option<usize> {
    let hay = text.get(from..)?;
    patterns
        .iter()
        .filter_map(|p| hay.find(p.as_str()).map(|at| from + at + p.len()))
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_patterns_match_once_and_only_in_new_text() {
        let p = vec!["</calc>".to_string()];
        assert_eq!(new_match("a</calc>b", 0, &p), Some(8));
        assert_eq!(new_match("a</calc>b", 8, &p), None);
        assert_eq!(new_match("x</calc>", 2, &p), None, "starts before `from`");
        assert_eq!(
            new_match("héllo", 2, &["l".into()]),
            None,
            "not a char boundary"
        );
    }
}
