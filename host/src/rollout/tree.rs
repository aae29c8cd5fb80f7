//! Tree rollouts (issue 67): a group grown as a tree instead of G independent chains.
//!
//! Each prompt starts `chains` trajectories. At a branch point (after a tool's or the
//! environment's answer, or only where a new assistant turn starts) a trajectory whose
//! path has branched fewer than `max_depth` times splits into `branch_factor`: itself
//! (child 0) and forks (children 1..k) that share its tokens so far, its KV cache (the
//! sampler's copy-on-write fork) and a fork of its plugin sessions
//! ([`crate::plugin::fork`]), so a variable the code tool holds is in every branch. The
//! branches then sample on their own, each from its own seed.
//!
//! A trajectory's place is its path from the root ([`TreePlace`]): its chain, then the
//! child it took at each branch point, and where in its completion each segment starts.
//! The path names the node (`"1.0.1"`), so ids do not depend on the order in which
//! branches happen to be reached, and a trajectory's seeds follow from its path alone.
//! Every branch always happens (no budget is handed out first come, first served), so the
//! group is at most `chains · branch_factor^max_depth` leaves, which the config checks
//! against `rollout.group_size`; a trajectory that ends before a branch point leaves
//! fewer.

use serde::{Deserialize, Serialize};

/// Where trajectories branch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BranchAt {
    /// After every tool output or environment answer inserted (a trigger's mid-turn
    /// output too).
    Result,
    /// Only where a new assistant turn starts: after a turn's function results or the
    /// environment's answer to it.
    Turn,
    /// After a tool output or environment answer where the model is unsure what to make
    /// of it (ARPO's rule): the mean surprisal (−log p, an estimate of the entropy) of the
    /// `entropy_window` tokens it samples next reaches `entropy_threshold`. The branches
    /// start at the answer, not after the window.
    Entropy,
}

/// How a group's tree becomes advantages ([`crate::rl::algorithms`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TreeAdvantage {
    /// TreeRL: each segment's global plus local advantage from its node's mean leaf
    /// reward.
    Treerl,
    /// Each leaf normalised within its tree (GRPO over the leaves); a shared segment
    /// takes the mean of its leaves'.
    LeafGrpo,
    /// Tree-GRPO: intra-tree plus inter-tree GRPO scores over a prompt's trees (its
    /// chains).
    TreeGrpo,
}

/// What the trainer does with a segment several trajectories share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SharedPrefix {
    /// Trained in each trajectory through it, with each one's advantage for it.
    PerPath,
    /// Trained once, in the first trajectory through it, with the segment's advantage.
    Once,
}

/// The engine's tree settings (`[rollout.tree]`, checked by the config).
#[derive(Debug, Clone, PartialEq)]
pub struct TreeSettings {
    pub chains: usize,
    pub branch_at: BranchAt,
    pub branch_factor: usize,
    pub max_depth: usize,
    /// With [`BranchAt::Entropy`]: the tokens after an answer whose mean surprisal is
    /// measured, and the mean (nats) at which the trajectory branches.
    pub entropy_window: usize,
    pub entropy_threshold: f64,
}

impl TreeSettings {
    /// The most leaves one prompt's tree can have.
    pub fn max_leaves(&self) -> usize {
        let mut leaves = self.chains;
        for _ in 0..self.max_depth {
            leaves = leaves.saturating_mul(self.branch_factor);
        }
        leaves
    }
}

/// A trajectory's place in its group's tree. In `rollouts.jsonl` it is written as its
/// node, its parent and its branch points: `{"node": "1.0.2", "parent": "1.0",
/// "branch_points": [4, 7]}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "PlaceRecord", try_from = "PlaceRecord")]
pub struct TreePlace {
    /// Its chain, then the child it took at each branch point (0: the trajectory that
    /// branched went on as child 0).
    pub path: Vec<u32>,
    /// Where each segment after the first starts, in completion tokens: the branch
    /// points on its path, one for each step of `path` after the chain.
    pub branch_points: Vec<usize>,
}

impl TreePlace {
    /// Chain `chain`'s place before any branch.
    pub fn chain(chain: u32) -> TreePlace {
        TreePlace {
            path: vec![chain],
            branch_points: Vec::new(),
        }
    }

    /// Branch points on the path so far.
    pub fn depth(&self) -> usize {
        self.branch_points.len()
    }

    /// The node a prefix of `path` names: `"1.0.1"`.
    pub fn id_of(path: &[u32]) -> String {
        let parts: Vec<String> = path.iter().map(u32::to_string).collect();
        parts.join(".")
    }

    /// This trajectory's node (its last segment).
    pub fn node(&self) -> String {
        Self::id_of(&self.path)
    }

    /// The node its last segment continues (`None`: it starts at the prompt).
    pub fn parent(&self) -> Option<String> {
        (self.path.len() > 1).then(|| Self::id_of(&self.path[..self.path.len() - 1]))
    }

    /// Each segment's completion range, first to last, for a completion of `len` tokens.
    pub fn segments(&self, len: usize) -> Vec<(usize, usize)> {
        let mut starts = vec![0];
        starts.extend(&self.branch_points);
        let mut ends = self.branch_points.clone();
        ends.push(len);
        starts.into_iter().zip(ends).collect()
    }

    /// The place of child `child` of this trajectory branching at completion token `at`.
    pub fn branched(&self, child: u32, at: usize) -> TreePlace {
        let mut path = self.path.clone();
        path.push(child);
        let mut branch_points = self.branch_points.clone();
        branch_points.push(at);
        TreePlace {
            path,
            branch_points,
        }
    }
}

/// [`TreePlace`] as written.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlaceRecord {
    node: String,
    parent: Option<String>,
    branch_points: Vec<usize>,
}

impl From<TreePlace> for PlaceRecord {
    fn from(p: TreePlace) -> PlaceRecord {
        PlaceRecord {
            node: p.node(),
            parent: p.parent(),
            branch_points: p.branch_points,
        }
    }
}

impl TryFrom<PlaceRecord> for TreePlace {
    type Error = String;

    fn try_from(r: PlaceRecord) -> Result<TreePlace, String> {
        let path = r
            .node
            .split('.')
            .map(str::parse)
            .collect::<Result<Vec<u32>, _>>()
            .map_err(|_| format!("tree node {:?} is not numbers joined by `.`", r.node))?;
        let place = TreePlace {
            path,
            branch_points: r.branch_points,
        };
        if place.branch_points.len() + 1 != place.path.len() || place.parent() != r.parent {
            return Err(format!(
                "tree node {:?} needs its parent and one branch point per `.`",
                r.node
            ));
        }
        Ok(place)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_place_names_its_node_parent_and_segments() {
        let chain = TreePlace::chain(1);
        assert_eq!(
            (chain.node(), chain.parent(), chain.depth()),
            ("1".into(), None, 0)
        );
        assert_eq!(chain.segments(9), vec![(0, 9)]);
        let leaf = chain.branched(0, 4).branched(2, 7);
        assert_eq!(leaf.node(), "1.0.2");
        assert_eq!(leaf.parent().as_deref(), Some("1.0"));
        assert_eq!(leaf.depth(), 2);
        assert_eq!(leaf.segments(12), vec![(0, 4), (4, 7), (7, 12)]);
    }

    #[test]
    fn a_place_is_written_as_node_parent_and_branch_points() {
        let leaf = TreePlace::chain(1).branched(0, 4).branched(2, 7);
        let json = serde_json::to_value(&leaf).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"node": "1.0.2", "parent": "1.0", "branch_points": [4, 7]})
        );
        assert_eq!(serde_json::from_value::<TreePlace>(json).unwrap(), leaf);
        let bad = serde_json::json!({"node": "1.x", "parent": "1", "branch_points": [4]});
        assert!(serde_json::from_value::<TreePlace>(bad).is_err());
    }

    #[test]
    fn the_most_leaves_are_chains_times_the_factor_per_level() {
        let t = TreeSettings {
            chains: 2,
            branch_at: BranchAt::Result,
            branch_factor: 3,
            max_depth: 2,
            entropy_window: 8,
            entropy_threshold: 1.0,
        };
        assert_eq!(t.max_leaves(), 18);
    }
}
