//! Training: supervised warm start ([`sft`]); the RL math and the trainer loop join it.

pub mod algorithms;
pub mod checkpoint;
pub mod optim;
pub mod sft;
pub mod trainer;
pub mod update;
