//! The futures table: every operation the API accepts gets a request id at once and its
//! outcome later; `retrieve_future` waits on it (a long poll: the SDK re-polls at once
//! when told to try again, so the server holds each poll until the outcome is there or a
//! while has passed). Outcomes are kept for a while after they are ready, since the SDK
//! may poll again after a dropped connection and never says it has read one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How long a finished outcome stays retrievable.
pub const KEEP: Duration = Duration::from_secs(30 * 60);
/// The most bytes of finished outcomes kept; past it the oldest go first, whatever their
/// age (they were kept 30 minutes whatever their size).
pub const KEEP_BYTES: usize = 256 << 20;

/// What an operation came to.
#[derive(Debug, Clone, PartialEq)]
pub enum Settled {
    /// A JSON result.
    Json(serde_json::Value),
    /// A protobuf result (forward/backward, sampling).
    Proto(Vec<u8>),
    /// It failed; the message says why. `user`: the request cannot succeed as sent.
    Failed {
        message: String,
        category: &'static str,
    },
}

impl Settled {
    pub fn user_error(message: impl Into<String>) -> Settled {
        Settled::Failed {
            message: message.into(),
            category: "user",
        }
    }

    pub fn server_error(message: impl Into<String>) -> Settled {
        Settled::Failed {
            message: message.into(),
            category: "server",
        }
    }
}

/// Run with an operation's outcome before anyone can read it.
type OnSettle = Box<dyn FnOnce(&Settled) + Send>;

struct Slot {
    tx: watch::Sender<Option<Arc<Settled>>>,
    finished: Option<Instant>,
    /// The outcome's size, once finished.
    bytes: usize,
    /// What to do with the outcome first (see [`Futures::open_then`]).
    then: Option<OnSettle>,
}

impl Settled {
    /// About how many bytes it holds.
    fn size(&self) -> usize {
        match self {
            Settled::Json(v) => serde_json::to_vec(v).map_or(0, |b| b.len()),
            Settled::Proto(b) => b.len(),
            Settled::Failed { message, .. } => message.len(),
        }
    }
}

#[derive(Default)]
pub struct Futures {
    slots: Mutex<HashMap<String, Slot>>,
}

/// Why a wait did not give an outcome.
#[derive(Debug, PartialEq)]
pub enum Waited {
    /// Not ready within the wait.
    Pending,
    /// No such request id (never issued, or expired).
    Unknown,
}

impl Futures {
    /// A new pending request; returns its id: 96 random bits, since `retrieve_future`
    /// answers whoever holds an id (a counter let one client read, and so take over,
    /// another's model).
    pub fn open(&self) -> String {
        self.open_slot(None)
    }

    /// Like [`Futures::open`], and `then` runs with the outcome before anyone can read
    /// it: a client told that a create failed must not find the model it asked for in
    /// its next call, nor be refused for the samples it was just given (a task that
    /// awaited the outcome and then tidied up lost that race to a fast client).
    pub fn open_then(&self, then: impl FnOnce(&Settled) + Send + 'static) -> String {
        self.open_slot(Some(Box::new(then)))
    }

    fn open_slot(&self, then: Option<OnSettle>) -> String {
        let id = format!("req-{:024x}", rand::random::<u128>() >> 32);
        let (tx, _) = watch::channel(None);
        let mut slots = self.slots.lock().expect("futures lock");
        // Forget outcomes read long ago (checked here, where the table grows).
        slots.retain(|_, s| s.finished.is_none_or(|t| t.elapsed() < KEEP));
        slots.insert(
            id.clone(),
            Slot {
                tx,
                finished: None,
                bytes: 0,
                then,
            },
        );
        id
    }

    /// Settles `id` (a second outcome for the same id is ignored).
    pub fn finish(&self, id: &str, outcome: Settled) {
        // Taken out under the lock, run outside it (it takes other locks), and before the
        // outcome is published below.
        let then = {
            let mut slots = self.slots.lock().expect("futures lock");
            slots
                .get_mut(id)
                .filter(|s| s.finished.is_none())
                .and_then(|s| s.then.take())
        };
        if let Some(then) = then {
            then(&outcome);
        }
        let mut slots = self.slots.lock().expect("futures lock");
        if let Some(slot) = slots.get_mut(id)
            && slot.finished.is_none()
        {
            slot.finished = Some(Instant::now());
            slot.bytes = outcome.size();
            slot.tx.send_replace(Some(Arc::new(outcome)));
        }
        let mut kept: usize = slots.values().map(|s| s.bytes).sum();
        if kept > KEEP_BYTES {
            let mut done: Vec<(Instant, String, usize)> = slots
                .iter()
                .filter_map(|(k, s)| s.finished.map(|t| (t, k.clone(), s.bytes)))
                .collect();
            done.sort();
            for (_, k, bytes) in done {
                if kept <= KEEP_BYTES {
                    break;
                }
                slots.remove(&k);
                kept -= bytes;
            }
        }
    }

    /// Whether `id` is still running.
    pub fn pending(&self, id: &str) -> bool {
        let slots = self.slots.lock().expect("futures lock");
        slots.get(id).is_some_and(|s| s.finished.is_none())
    }

    /// The outcome of `id`, waiting up to `wait` for it.
    pub async fn wait(&self, id: &str, wait: Duration) -> Result<Arc<Settled>, Waited> {
        let mut rx = {
            let slots = self.slots.lock().expect("futures lock");
            slots.get(id).ok_or(Waited::Unknown)?.tx.subscribe()
        };
        let ready = tokio::time::timeout(wait, rx.wait_for(|o| o.is_some())).await;
        match ready {
            Ok(Ok(o)) => Ok(o.clone().expect("waited for Some")),
            Ok(Err(_)) => Err(Waited::Unknown),
            Err(_) => Err(Waited::Pending),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 68, point 14: outcomes past [`KEEP_BYTES`] are forgotten oldest first.
    #[test]
    fn kept_outcomes_are_bounded_in_bytes() {
        let f = Futures::default();
        let ids: Vec<String> = (0..5).map(|_| f.open()).collect();
        for id in &ids {
            f.finish(id, Settled::Proto(vec![0; KEEP_BYTES / 3]));
        }
        let slots = f.slots.lock().unwrap();
        assert!(!slots.contains_key(&ids[0]) && !slots.contains_key(&ids[1]));
        assert!(ids[2..].iter().all(|id| slots.contains_key(id)));
    }

    /// The hook sees the outcome once, before it can be read.
    #[test]
    fn the_hook_runs_once_before_the_outcome_is_published() {
        let f = Arc::new(Futures::default());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let id = Arc::new(Mutex::new(String::new()));
        let (f2, s2, id2) = (f.clone(), seen.clone(), id.clone());
        let opened = f.open_then(move |o| {
            // Not yet readable while the hook runs.
            assert!(f2.pending(&id2.lock().unwrap()));
            s2.lock().unwrap().push(o.clone());
        });
        *id.lock().unwrap() = opened.clone();
        f.finish(&opened, Settled::user_error("no"));
        f.finish(&opened, Settled::Json(serde_json::json!({})));
        assert!(!f.pending(&opened));
        assert_eq!(*seen.lock().unwrap(), vec![Settled::user_error("no")]);
    }

    #[tokio::test]
    async fn a_poll_waits_for_the_outcome_and_a_later_one_reads_it_again() {
        let f = Arc::new(Futures::default());
        let id = f.open();
        assert_eq!(
            f.wait(&id, Duration::from_millis(20)).await,
            Err(Waited::Pending)
        );
        let (f2, id2) = (f.clone(), id.clone());
        let waiter = tokio::spawn(async move { f2.wait(&id2, Duration::from_secs(10)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        f.finish(&id, Settled::Json(serde_json::json!({"ok": 1})));
        let got = waiter.await.unwrap().unwrap();
        assert_eq!(*got, Settled::Json(serde_json::json!({"ok": 1})));
        // Read again (a retried poll), and a second outcome does not replace the first.
        f.finish(&id, Settled::user_error("late"));
        let again = f.wait(&id, Duration::from_millis(1)).await.unwrap();
        assert_eq!(*again, Settled::Json(serde_json::json!({"ok": 1})));
        assert_eq!(
            f.wait("req-999", Duration::from_millis(1)).await,
            Err(Waited::Unknown)
        );
    }
}
