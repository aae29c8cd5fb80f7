//! Training: the RL math ([`algorithms`]), the update of a batch ([`update`], [`optim`]),
//! the trainer loop ([`trainer`], with its rollout producer, learner, run log and progress
//! bars, run as its resolved [`plan`] says), checkpoints ([`checkpoint`]), and the supervised warm start ([`sft`]).

pub mod adapter_set;
pub mod algorithms;
pub mod checkpoint;
pub mod distill;
pub mod dpo;
mod learn;
pub mod optim;
pub mod packing;
pub mod plan;
pub mod preference;
mod producer;
mod progress;
pub mod reward_model;
pub(crate) mod run_log;
pub mod sft;
pub mod trainer;
pub mod tree_rows;
pub mod update;
pub mod value_head;
