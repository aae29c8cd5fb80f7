//! The bounded queue between the rollout side and the trainer (the seeds' rollout manager
//! and trainer manager).
//!
//! The producer samples batch `b` only once the trainer has published adapter version
//! `v >= b - max_staleness` (batch `b` is the one the trainer consumes to make version
//! `b + 1`). So `max_staleness = 0` is strictly on-policy: batch `b` is sampled with the
//! adapter that batch `b - 1` produced. Larger values let rollouts run that many versions
//! ahead; each trajectory records the version it was sampled with (and its per-token
//! sampling log-probs), from which the trainer corrects with truncated importance
//! sampling. At most `capacity` finished batches wait in the queue, which bounds memory.
//!
//! The sampler and the trainer share one model in process: a published version is the
//! adapter the sampler uses from its next batch on, with no disk round trip.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};

/// Why the queue refuses: it was closed (the run ended) or the other side failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QueueError {
    #[error("the rollout queue is closed")]
    Closed,
    #[error("rollouts failed: {0}")]
    Failed(String),
    /// The producer gave its batch up because the run is being interrupted
    /// ([`crate::rollout::engine::Abandoned`]): an interruption, not a failure.
    #[error("{}", crate::rollout::engine::Abandoned)]
    Abandoned,
}

struct State<T> {
    items: VecDeque<T>,
    version: u64,
    closed: bool,
    /// Why the producer stopped: [`QueueError::Failed`] or [`QueueError::Abandoned`].
    error: Option<QueueError>,
}

pub struct RolloutQueue<T> {
    state: Mutex<State<T>>,
    changed: Condvar,
    capacity: usize,
    max_staleness: u64,
}

impl<T> RolloutQueue<T> {
    /// A queue holding at most `capacity` (>= 1) batches, starting at adapter `version`.
    pub fn new(capacity: usize, max_staleness: u64, version: u64) -> RolloutQueue<T> {
        RolloutQueue {
            state: Mutex::new(State {
                items: VecDeque::new(),
                version,
                closed: false,
                error: None,
            }),
            changed: Condvar::new(),
            capacity: capacity.max(1),
            max_staleness,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<T>> {
        // A panic elsewhere poisons the lock; the state itself stays consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check(state: &State<T>) -> Result<(), QueueError> {
        match (&state.error, state.closed) {
            (Some(e), _) => Err(e.clone()),
            (None, true) => Err(QueueError::Closed),
            (None, false) => Ok(()),
        }
    }

    /// Producer: blocks until batch `batch` may be sampled; returns the adapter version
    /// to sample it with.
    pub fn wait_to_start(&self, batch: u64) -> Result<u64, QueueError> {
        let need = batch.saturating_sub(self.max_staleness);
        let mut state = self.lock();
        loop {
            Self::check(&state)?;
            if state.version >= need {
                return Ok(state.version);
            }
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Producer: adds a finished batch, blocking while the queue is full.
    pub fn push(&self, item: T) -> Result<(), QueueError> {
        let mut state = self.lock();
        loop {
            Self::check(&state)?;
            if state.items.len() < self.capacity {
                state.items.push_back(item);
                self.changed.notify_all();
                return Ok(());
            }
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Trainer: the next batch, blocking until there is one. Batches queued before a
    /// `close` are still handed out; a failure is reported at once.
    pub fn pop(&self) -> Result<T, QueueError> {
        loop {
            if let Some(item) = self.pop_timeout(std::time::Duration::from_secs(3600))? {
                return Ok(item);
            }
        }
    }

    /// Trainer: [`RolloutQueue::pop`] that gives up after `timeout` with `None` (so the
    /// trainer can look at an interruption while it waits).
    pub fn pop_timeout(&self, timeout: std::time::Duration) -> Result<Option<T>, QueueError> {
        let deadline = std::time::Instant::now() + timeout;
        let mut state = self.lock();
        loop {
            if let Some(e) = &state.error {
                return Err(e.clone());
            }
            if let Some(item) = state.items.pop_front() {
                self.changed.notify_all();
                return Ok(Some(item));
            }
            if state.closed {
                return Err(QueueError::Closed);
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            state = self
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Trainer: a new adapter version is in place; rollouts may use it from now on.
    pub fn publish(&self, version: u64) {
        let mut state = self.lock();
        state.version = state.version.max(version);
        self.changed.notify_all();
    }

    pub fn version(&self) -> u64 {
        self.lock().version
    }

    /// Batches waiting.
    pub fn len(&self) -> usize {
        self.lock().items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the run has ended (a producer waiting on something else looks here).
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Ends the run: waiting producers and consumers return `Closed`.
    pub fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }

    /// The producer failed: the trainer's next `pop` returns the error.
    pub fn fail(&self, error: String) {
        self.stop(QueueError::Failed(error));
    }

    /// Producer: gives the batch up because the run is being interrupted.
    pub fn abandon(&self) {
        self.stop(QueueError::Abandoned);
    }

    fn stop(&self, why: QueueError) {
        let mut state = self.lock();
        state.error.get_or_insert(why);
        self.changed.notify_all();
    }

    /// Runs a producer from batch `first` on: waits for its turn, samples with `make(batch,
    /// version)`, queues the result; until the queue closes or `make` fails (then the
    /// trainer sees the error).
    pub fn produce(
        &self,
        first: u64,
        mut make: impl FnMut(u64, u64) -> anyhow::Result<T>,
    ) -> Result<(), QueueError> {
        let mut batch = first;
        loop {
            let version = self.wait_to_start(batch)?;
            match make(batch, version) {
                Ok(item) => self.push(item)?,
                Err(e)
                    if e.chain()
                        .any(|c| c.is::<crate::rollout::engine::Abandoned>()) =>
                {
                    self.abandon();
                    return Err(QueueError::Abandoned);
                }
                Err(e) => {
                    let e = format!("{e:#}");
                    self.fail(e.clone());
                    return Err(QueueError::Failed(e));
                }
            }
            batch += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Runs a producer against a trainer that takes `batches` batches, publishing version
    /// b + 1 after batch b; returns (batch, version sampled with) per batch.
    fn run(max_staleness: u64, capacity: usize, batches: u64) -> Vec<(u64, u64)> {
        let q = Arc::new(RolloutQueue::new(capacity, max_staleness, 0));
        let producer = {
            let q = q.clone();
            std::thread::spawn(move || {
                let _ = q.produce(0, |b, v| {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                    Ok((b, v))
                });
            })
        };
        let mut seen = Vec::new();
        for b in 0..batches {
            let item = q.pop().unwrap();
            assert_eq!(item.0, b, "batches arrive in order");
            assert!(q.len() <= capacity);
            seen.push(item);
            // The "update".
            std::thread::sleep(std::time::Duration::from_millis(5));
            q.publish(b + 1);
        }
        q.close();
        producer.join().unwrap();
        seen
    }

    #[test]
    fn staleness_zero_is_strictly_on_policy() {
        for (b, v) in run(0, 4, 6) {
            assert_eq!(
                v, b,
                "batch {b} must be sampled with the version batch {b}-1 made"
            );
        }
    }

    #[test]
    fn rollouts_run_ahead_at_most_max_staleness_versions() {
        let seen = run(2, 8, 10);
        assert!(seen.iter().all(|&(b, v)| b - v <= 2 && v <= b), "{seen:?}");
        // With a fast producer and a slow trainer the bound is reached.
        assert!(seen.iter().any(|&(b, v)| b - v == 2), "{seen:?}");
    }

    #[test]
    fn a_full_queue_blocks_the_producer() {
        let seen = run(100, 1, 5);
        assert!(
            seen.iter().all(|&(b, v)| b - v <= 2),
            "capacity 1 bounds run-ahead: {seen:?}"
        );
    }

    #[test]
    fn a_producer_failure_reaches_the_trainer() {
        let q = RolloutQueue::<u64>::new(2, 0, 0);
        let r = q.produce(0, |_, _| anyhow::bail!("model exploded"));
        assert!(matches!(r, Err(QueueError::Failed(_))));
        assert_eq!(q.pop(), Err(QueueError::Failed("model exploded".into())));
    }
}
