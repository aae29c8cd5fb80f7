//! What the trainer trains on for a group sampled as a tree (`[rollout.tree]`): each
//! trajectory's advantage, per token where its segments differ, and where its training
//! starts when a shared segment is trained once.
//!
//! The group's trajectories name their places ([`TreePlace`]); their paths' prefixes are
//! the tree's nodes (a segment each), the trajectories its leaves. The advantages are
//! [`algorithms`]' pure functions over that [`RolloutTree`]:
//! - `treerl`: each segment's own advantage, A(n) = (V(n) − V(root)) + (V(n) − V(parent)),
//!   trained per path with the 1/√|L(n)| reweighting TreeRL uses there (a segment |L(n)|
//!   paths share would otherwise weigh |L(n)| times), once without it;
//! - `leaf_grpo`: GRPO over the tree's leaves; per path each trajectory's tokens take its
//!   leaf's advantage (GRPO's own rule), once a shared segment takes the mean of its
//!   leaves';
//! - `tree_grpo`: Tree-GRPO's intra-tree (within each chain's tree) plus inter-tree (over
//!   the prompt's leaves) scores, applied as `leaf_grpo`'s.
//!
//! A segment trained once is trained in the first trajectory through it, in the group's
//! order (by path): the others start training where they leave the trajectories before
//! them (`trained_from`), so under token-mean aggregation each shared token counts once,
//! where per path it counts once for each trajectory through it.

use super::algorithms::{
    RolloutTree, leaf_grpo_advantages, per_segment_from_leaves, tree_grpo_advantages,
    treerl_advantages,
};
use crate::rollout::trajectory::{Group, Trajectory};
use crate::rollout::tree::{SharedPrefix, TreeAdvantage, TreePlace};
use std::collections::{BTreeMap, BTreeSet};

/// How a tree group is trained (the run's `[rollout.tree]`, as the plan holds it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TreeTraining {
    pub advantage: TreeAdvantage,
    pub shared_prefix: SharedPrefix,
    /// Added to a std before dividing by it (`train.adv_eps`).
    pub eps: f64,
}

/// One trajectory's training terms.
#[derive(Debug, Clone, PartialEq)]
pub struct TreeRow {
    /// The same for every token (a leaf's GRPO score per path), else 0.
    pub advantage: f64,
    /// Per target (`tokens − 1` long, as the update's rows): each segment's advantage on
    /// its tokens; empty when `advantage` says it all.
    pub token_advantages: Vec<f32>,
    /// Completion tokens before it are trained in an earlier trajectory.
    pub trained_from: usize,
}

impl TreeRow {
    /// A flat group's trajectory: one advantage for all its tokens.
    pub fn flat(advantage: f64) -> TreeRow {
        TreeRow {
            advantage,
            token_advantages: Vec::new(),
            trained_from: 0,
        }
    }
}

/// A group's tree: its nodes (paths, parents first, the root `[]` at 0) and each
/// trajectory's leaf.
struct Shape {
    nodes: Vec<Vec<u32>>,
    tree: RolloutTree,
    leaf_of: Vec<usize>,
}

fn place(t: &Trajectory) -> Result<&TreePlace, String> {
    t.tree.as_ref().ok_or_else(|| {
        format!(
            "trajectory {} of sample {} has no place in a tree while others of its group do",
            t.index, t.sample_id
        )
    })
}

/// The tree of `trajectories` whose paths all start with `under` (the root's children
/// are the nodes one step below it).
fn shape(trajectories: &[&Trajectory], under: &[u32]) -> Result<Shape, String> {
    let mut paths: BTreeSet<(usize, Vec<u32>)> = BTreeSet::new();
    for t in trajectories {
        let path = &place(t)?.path;
        for len in under.len() + 1..=path.len() {
            paths.insert((len, path[..len].to_vec()));
        }
    }
    let mut nodes: Vec<Vec<u32>> = vec![under.to_vec()];
    nodes.extend(paths.into_iter().map(|(_, p)| p));
    let index: BTreeMap<&[u32], usize> = nodes
        .iter()
        .enumerate()
        .map(|(i, p)| (p.as_slice(), i))
        .collect();
    let parents = nodes
        .iter()
        .enumerate()
        .map(|(i, p)| (i > 0).then(|| index[&p[..p.len() - 1]]))
        .collect();
    let mut rewards = vec![None; nodes.len()];
    let mut leaf_of = Vec::with_capacity(trajectories.len());
    for t in trajectories {
        let leaf = index[place(t)?.path.as_slice()];
        if rewards[leaf].replace(t.reward).is_some() {
            return Err(format!(
                "two trajectories are at tree node {}",
                TreePlace::id_of(&nodes[leaf])
            ));
        }
        leaf_of.push(leaf);
    }
    let tree = RolloutTree::new(parents, rewards).map_err(|e| format!("the group's tree: {e}"))?;
    Ok(Shape {
        nodes,
        tree,
        leaf_of,
    })
}

/// Each node's advantage (per segment) or each trajectory's (per leaf), for one group.
enum Scores {
    Segments(Vec<f64>),
    Leaves(Vec<f64>),
}

/// The training terms of each trajectory of `group` (in its order), whose trajectories
/// all have places.
pub fn tree_rows(group: &Group, how: &TreeTraining) -> Result<Vec<TreeRow>, String> {
    let trajectories: Vec<&Trajectory> = group.trajectories.iter().collect();
    let whole = shape(&trajectories, &[])?;
    let once = how.shared_prefix == SharedPrefix::Once;
    // Each leaf's advantage in `whole`'s leaf order, or each node's.
    let advantages = match how.advantage {
        TreeAdvantage::Treerl => Scores::Segments(treerl_advantages(&whole.tree, !once)),
        TreeAdvantage::LeafGrpo => Scores::Leaves(by_trajectory(
            &whole,
            &leaf_grpo_advantages(&whole.tree, how.eps),
        )),
        TreeAdvantage::TreeGrpo => {
            // One tree per chain: the trajectories under each first segment.
            let mut chains: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
            for (i, t) in trajectories.iter().enumerate() {
                chains.entry(place(t)?.path[0]).or_default().push(i);
            }
            let mut shapes = Vec::with_capacity(chains.len());
            for members in chains.values() {
                let ts: Vec<&Trajectory> = members.iter().map(|&i| trajectories[i]).collect();
                shapes.push(shape(&ts, &[])?);
            }
            let trees: Vec<RolloutTree> = shapes.iter().map(|s| s.tree.clone()).collect();
            let mut per_trajectory = vec![0.0; trajectories.len()];
            for ((members, s), leaf_adv) in chains
                .values()
                .zip(&shapes)
                .zip(tree_grpo_advantages(&trees, how.eps))
            {
                for (&i, a) in members.iter().zip(by_trajectory(s, &leaf_adv)) {
                    per_trajectory[i] = a;
                }
            }
            Scores::Leaves(per_trajectory)
        }
    };
    let advantages = match (advantages, once) {
        (Scores::Leaves(per_trajectory), true) => {
            // The leaves' advantages in node order, for the mean over each segment's.
            let mut by_leaf = vec![0.0; whole.tree.len()];
            for (i, &leaf) in whole.leaf_of.iter().enumerate() {
                by_leaf[leaf] = per_trajectory[i];
            }
            let leaves: Vec<f64> = whole.tree.leaves().iter().map(|&n| by_leaf[n]).collect();
            Scores::Segments(per_segment_from_leaves(&whole.tree, &leaves))
        }
        (a, _) => a,
    };
    let index: BTreeMap<&[u32], usize> = whole
        .nodes
        .iter()
        .enumerate()
        .map(|(i, p)| (p.as_slice(), i))
        .collect();
    let mut trained: BTreeSet<usize> = BTreeSet::new();
    let mut rows = Vec::with_capacity(trajectories.len());
    for (i, t) in trajectories.iter().enumerate() {
        let place = place(t)?;
        let completion = t.tokens.len() - t.prompt_len;
        let segments = place.segments(completion);
        let path_nodes: Vec<usize> = (1..=place.path.len())
            .map(|len| index[&place.path[..len]])
            .collect();
        let trained_from = if once {
            let first_new = path_nodes.iter().position(|n| !trained.contains(n));
            trained.extend(&path_nodes);
            first_new.map_or(completion, |s| segments[s].0)
        } else {
            0
        };
        rows.push(match &advantages {
            Scores::Leaves(per_trajectory) => TreeRow {
                advantage: per_trajectory[i],
                token_advantages: Vec::new(),
                trained_from,
            },
            Scores::Segments(per_node) => {
                let mut token_advantages = vec![0f32; t.tokens.len().saturating_sub(1)];
                for (&(start, end), &n) in segments.iter().zip(&path_nodes) {
                    for c in start..end {
                        token_advantages[t.prompt_len + c - 1] = per_node[n] as f32;
                    }
                }
                TreeRow {
                    advantage: 0.0,
                    token_advantages,
                    trained_from,
                }
            }
        });
    }
    Ok(rows)
}

/// Leaf advantages (in the tree's leaf order) as each trajectory's, in the shape's order.
fn by_trajectory(s: &Shape, leaf_advantages: &[f64]) -> Vec<f64> {
    let leaves = s.tree.leaves();
    s.leaf_of
        .iter()
        .map(|leaf| {
            let k = leaves
                .iter()
                .position(|n| n == leaf)
                .expect("a trajectory is a leaf");
            leaf_advantages[k]
        })
        .collect()
}

/// Whether `group` was sampled as a tree.
pub fn is_tree(group: &Group) -> bool {
    group.trajectories.iter().any(|t| t.tree.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trajectory of `completion` tokens after a 2-token prompt, at `place`, with
    /// `reward`.
    fn traj(place: TreePlace, completion: usize, reward: f64) -> Trajectory {
        let tokens = vec![7u32; 2 + completion];
        let logps = vec![Some(-1.0f32); completion];
        Trajectory {
            reward,
            tree: Some(place),
            ..Trajectory::sampled(tokens, 2, logps)
        }
    }

    /// Chain 0 branches at token 3 into 0.0 (reward 1) and 0.1 (reward 0); chain 1 never
    /// branches (reward 1). V(root) = 2/3, V(0) = 1/2, V(0.0) = 1, V(0.1) = 0, V(1) = 1.
    fn group() -> Group {
        let c0 = TreePlace::chain(0);
        Group {
            sample_id: 0,
            trajectories: vec![
                traj(c0.branched(0, 3), 5, 1.0),
                traj(c0.branched(1, 3), 6, 0.0),
                traj(TreePlace::chain(1), 4, 1.0),
            ],
        }
    }

    #[test]
    fn treerl_gives_each_segment_its_own_advantage_on_its_tokens() {
        let how = TreeTraining {
            advantage: TreeAdvantage::Treerl,
            shared_prefix: SharedPrefix::Once,
            eps: 0.0,
        };
        let rows = tree_rows(&group(), &how).unwrap();
        // A(0) = (1/2 − 2/3) + (1/2 − 2/3) = −1/3; A(0.0) = (1 − 2/3) + (1 − 1/2) = 5/6;
        // A(0.1) = (0 − 2/3) + (0 − 1/2) = −7/6; A(1) = 2·(1 − 2/3) = 2/3.
        let (a0, a00, a01, a1) = (-1.0 / 3.0, 5.0 / 6.0, -7.0 / 6.0, 2.0 / 3.0);
        let close = |x: f32, y: f64| (x as f64 - y).abs() < 1e-6;
        // Completion token c is target 2 + c − 1.
        let first = &rows[0].token_advantages;
        assert_eq!(first.len(), 6);
        assert!(
            close(first[0], 0.0),
            "the prompt's first target is not trained"
        );
        assert!((1..4).all(|k| close(first[k], a0)) && (4..6).all(|k| close(first[k], a00)));
        let second = &rows[1].token_advantages;
        assert!((4..7).all(|k| close(second[k], a01)));
        assert!(rows[2].token_advantages[1..].iter().all(|&x| close(x, a1)));
        // Trained once: the second path starts where it leaves the first.
        assert_eq!(
            rows.iter().map(|r| r.trained_from).collect::<Vec<_>>(),
            vec![0, 3, 0]
        );
        // Per path, TreeRL's reweighting: the shared segment (2 leaves) by 1/√2.
        let per_path = TreeTraining {
            shared_prefix: SharedPrefix::PerPath,
            ..how
        };
        let rows = tree_rows(&group(), &per_path).unwrap();
        assert!(close(rows[1].token_advantages[1], a0 / 2f64.sqrt()));
        assert_eq!(rows[1].trained_from, 0);
    }

    #[test]
    fn leaf_grpo_per_path_is_grpo_over_the_leaves_and_once_the_mean_of_a_segment() {
        let per_path = TreeTraining {
            advantage: TreeAdvantage::LeafGrpo,
            shared_prefix: SharedPrefix::PerPath,
            eps: 0.0,
        };
        let rows = tree_rows(&group(), &per_path).unwrap();
        // Rewards 1, 0, 1: mean 2/3, unbiased std 1/√3.
        let sd = (1.0f64 / 3.0).sqrt();
        let want = [
            (1.0 - 2.0 / 3.0) / sd,
            (0.0 - 2.0 / 3.0) / sd,
            (1.0 - 2.0 / 3.0) / sd,
        ];
        for (r, w) in rows.iter().zip(want) {
            assert!((r.advantage - w).abs() < 1e-9 && r.token_advantages.is_empty());
        }
        let once = TreeTraining {
            shared_prefix: SharedPrefix::Once,
            ..per_path
        };
        let rows = tree_rows(&group(), &once).unwrap();
        // Segment 0 is shared by the first two: the mean of their scores.
        let shared = (want[0] + want[1]) / 2.0;
        assert!((rows[0].token_advantages[1] as f64 - shared).abs() < 1e-6);
        assert!((rows[0].token_advantages[4] as f64 - want[0]).abs() < 1e-6);
    }

    #[test]
    fn tree_grpo_adds_the_chain_score_to_the_prompt_score() {
        let how = TreeTraining {
            advantage: TreeAdvantage::TreeGrpo,
            shared_prefix: SharedPrefix::PerPath,
            eps: 0.0,
        };
        let rows = tree_rows(&group(), &how).unwrap();
        let sd = (1.0f64 / 3.0).sqrt();
        let inter = [
            (1.0 - 2.0 / 3.0) / sd,
            (0.0 - 2.0 / 3.0) / sd,
            (1.0 - 2.0 / 3.0) / sd,
        ];
        // Chain 0: rewards 1 and 0, mean 1/2, std 1/√2; chain 1 alone: 0.
        let sd0 = 0.5f64.sqrt();
        let intra = [0.5 / sd0, -0.5 / sd0, 0.0];
        for ((r, a), b) in rows.iter().zip(inter).zip(intra) {
            assert!((r.advantage - (a + b)).abs() < 1e-9, "{r:?}");
        }
    }

    #[test]
    fn a_group_mixing_trees_and_chains_is_refused() {
        let mut g = group();
        g.trajectories[2].tree = None;
        let how = TreeTraining {
            advantage: TreeAdvantage::Treerl,
            shared_prefix: SharedPrefix::PerPath,
            eps: 0.0,
        };
        let e = tree_rows(&g, &how).unwrap_err();
        assert!(e.contains("has no place in a tree"), "{e}");
    }
}
