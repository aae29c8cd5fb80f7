//! The sampler weights held in memory, bounded: an RL loop saves new sampler weights every
//! step, and each is a copy of the adapter (tens of megabytes for a 7B model's rank-32
//! adapter), so what is kept is the newest few per training client of the snapshots that
//! live only in memory (`save_weights_and_get_sampling_client`), and the most recently used
//! few of those saved to disk (`save_weights_for_sampler`), which are read again when asked
//! for after being let go.

use crate::model::lora::AdapterSnapshot;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// In-memory-only snapshots kept per training client (older ones are released).
pub const KEEP_UNNAMED: usize = 4;
/// Snapshots of saved sampler weights kept in memory (others are read from disk again).
pub const KEEP_NAMED: usize = 8;

#[derive(Default)]
pub struct Snapshots {
    map: HashMap<String, Arc<AdapterSnapshot>>,
    /// Per training client, its in-memory-only snapshots, oldest first.
    unnamed: HashMap<String, VecDeque<String>>,
    /// Snapshots of checkpoints on disk, least recently used first.
    named: VecDeque<String>,
}

impl Snapshots {
    /// The snapshot under `key`, marked as just used.
    pub fn get(&mut self, key: &str) -> Option<Arc<AdapterSnapshot>> {
        let found = self.map.get(key).cloned()?;
        if let Some(at) = self.named.iter().position(|k| k == key) {
            let k = self.named.remove(at).expect("found");
            self.named.push_back(k);
        }
        Some(found)
    }

    /// Keeps the snapshot of a checkpoint on disk (`key`: its path).
    pub fn insert_named(&mut self, key: String, snapshot: Arc<AdapterSnapshot>) {
        self.named.retain(|k| *k != key);
        self.named.push_back(key.clone());
        self.map.insert(key, snapshot);
        while self.named.len() > KEEP_NAMED {
            if let Some(old) = self.named.pop_front() {
                self.map.remove(&old);
            }
        }
    }

    /// Keeps an in-memory-only snapshot of `model`'s adapter.
    pub fn insert_unnamed(&mut self, model: &str, key: String, snapshot: Arc<AdapterSnapshot>) {
        let line = self.unnamed.entry(model.to_string()).or_default();
        line.retain(|k| *k != key);
        line.push_back(key.clone());
        self.map.insert(key, snapshot);
        while line.len() > KEEP_UNNAMED {
            if let Some(old) = line.pop_front() {
                self.map.remove(&old);
            }
        }
    }

    /// Releases `model`'s in-memory-only snapshots (its session ended).
    pub fn forget(&mut self, model: &str) {
        for key in self.unnamed.remove(model).unwrap_or_default() {
            self.map.remove(&key);
        }
    }

    /// Snapshots held now.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap() -> Arc<AdapterSnapshot> {
        Arc::new(AdapterSnapshot::from_pairs(0, Vec::new()))
    }

    #[test]
    fn the_newest_unnamed_and_the_recently_used_named_are_kept() {
        let mut s = Snapshots::default();
        for i in 0..6 {
            s.insert_unnamed("m", format!("m#{i}"), snap());
        }
        s.insert_unnamed("other", "o#0".into(), snap());
        assert!(s.get("m#1").is_none() && s.get("m#2").is_some() && s.get("m#5").is_some());
        assert_eq!(s.len(), KEEP_UNNAMED + 1);
        for i in 0..KEEP_NAMED {
            s.insert_named(format!("n{i}"), snap());
        }
        // n0 used just now: n1 is the one let go when a new one comes.
        assert!(s.get("n0").is_some());
        s.insert_named("new".into(), snap());
        assert!(s.get("n1").is_none() && s.get("n0").is_some() && s.get("new").is_some());
        s.forget("m");
        assert!(s.get("m#5").is_none() && s.get("o#0").is_some());
    }
}
