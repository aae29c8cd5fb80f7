//! Each training client's operations run in its `seq_id` order (1, 2, 3, … per client,
//! shared by forward/backward chunks, optimizer steps, saves and loads). The SDK submits
//! one after another, except the chunks of one large `forward_backward`, which it sends
//! at once and the first last; an operation that arrives ahead of its turn waits here
//! until the ones before it have been passed on. A gap that never fills (a client that
//! died between two submissions) holds the rest for at most [`GRACE`].

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// How long an operation waits for an earlier `seq_id` that has not come.
pub const GRACE: Duration = Duration::from_secs(10);

struct Line<W> {
    next: i64,
    held: BTreeMap<i64, (W, Instant)>,
}

pub struct Gate<W> {
    lines: HashMap<String, Line<W>>,
}

impl<W> Default for Gate<W> {
    fn default() -> Self {
        Gate {
            lines: HashMap::new(),
        }
    }
}

impl<W> Gate<W> {
    /// Starts `model`'s line: its next operation is `next`.
    pub fn open(&mut self, model: &str, next: i64) {
        self.lines.insert(
            model.to_string(),
            Line {
                next,
                held: BTreeMap::new(),
            },
        );
    }

    pub fn close(&mut self, model: &str) {
        self.lines.remove(model);
    }

    /// Takes `work` numbered `seq` (none: not ordered) for `model`; returns what may run
    /// now, in order. An operation for a model with no line, or numbered below the next
    /// expected (a client restarted from a pickle), runs at once.
    pub fn submit(&mut self, model: &str, seq: Option<i64>, work: W, now: Instant) -> Vec<W> {
        let mut out = Vec::new();
        match (self.lines.get_mut(model), seq) {
            (Some(line), Some(seq)) if seq >= line.next => {
                line.held.insert(seq, (work, now));
            }
            _ => out.push(work),
        }
        out.extend(self.release(model, now));
        out
    }

    /// What may run now for `model`: its held operations in order from the next expected,
    /// and, when the oldest held one has waited past [`GRACE`], from there on.
    pub fn release(&mut self, model: &str, now: Instant) -> Vec<W> {
        let mut out = Vec::new();
        let Some(line) = self.lines.get_mut(model) else {
            return out;
        };
        while let Some((&first, (_, since))) = line.held.iter().next() {
            if first == line.next || now.duration_since(*since) >= GRACE {
                let (work, _) = line.held.remove(&first).expect("present");
                out.push(work);
                line.next = first + 1;
            } else {
                break;
            }
        }
        out
    }

    /// Every model with held work (to release late ones on a timer).
    pub fn waiting(&self) -> Vec<String> {
        self.lines
            .iter()
            .filter(|(_, l)| !l.held.is_empty())
            .map(|(m, _)| m.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_sent_first_last_run_in_order() {
        let mut g = Gate::default();
        let t = Instant::now();
        g.open("m", 1);
        // The SDK's parallel chunks: 2 and 3 first, then 1.
        assert!(g.submit("m", Some(2), "b", t).is_empty());
        assert!(g.submit("m", Some(3), "c", t).is_empty());
        assert_eq!(g.submit("m", Some(1), "a", t), vec!["a", "b", "c"]);
        assert_eq!(g.submit("m", Some(4), "d", t), vec!["d"]);
        // Unordered work and unknown models pass straight through.
        assert_eq!(g.submit("m", None, "x", t), vec!["x"]);
        assert_eq!(g.submit("other", Some(9), "y", t), vec!["y"]);
    }

    #[test]
    fn a_gap_that_never_fills_holds_for_the_grace_period_only() {
        let mut g = Gate::default();
        let t = Instant::now();
        g.open("m", 1);
        assert!(g.submit("m", Some(3), "c", t).is_empty());
        assert!(g.release("m", t + GRACE / 2).is_empty());
        assert_eq!(g.waiting(), vec!["m".to_string()]);
        assert_eq!(g.release("m", t + GRACE), vec!["c"]);
        // The line goes on after the one released.
        assert_eq!(g.submit("m", Some(4), "d", t + GRACE), vec!["d"]);
        // A repeat of an earlier number runs at once.
        assert_eq!(g.submit("m", Some(2), "late", t + GRACE), vec!["late"]);
    }
}
