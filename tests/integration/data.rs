//! The dataset module with a real dataset plugin: countdown's generated puzzles through
//! `Dataset::open`, split and ordered by the run's seed.

use super::load;
use rlhost::data::{Cursor, DataConfig, Dataset};
use std::collections::BTreeSet;
use std::path::Path;

fn countdown(size: u64, eval_size: usize) -> DataConfig {
    let cfg: DataConfig = toml::from_str(&format!(
        "plugin = \"countdown\"\nplugin_config = {{ size = {size} }}\neval_size = {eval_size}\nsystem_prompt = \"Use the calculator.\""
    ))
    .expect("a valid [data] section");
    cfg
}

async fn first_epoch(dataset: &Dataset) -> Vec<(u64, rlhost::plugin::Sample)> {
    let mut cursor = Cursor::default();
    let batch = dataset
        .next_batch(&mut cursor, dataset.train_len() as usize)
        .await
        .unwrap();
    assert_eq!(
        cursor,
        Cursor {
            epoch: 0,
            position: dataset.train_len()
        }
    );
    batch
}

#[tokio::test]
async fn countdown_dataset_splits_and_orders_by_seed() {
    let plugin = load("countdown").await;
    let cfg = countdown(40, 8);
    let dataset = Dataset::open(&cfg, Path::new("."), Some(&plugin), 42)
        .await
        .unwrap();
    assert_eq!((dataset.train_len(), dataset.eval_len()), (32, 8));
    let eval = dataset.eval_samples().await.unwrap();
    let eval_ids: BTreeSet<u64> = eval.iter().map(|(id, _)| *id).collect();
    assert_eq!(eval_ids.len(), 8);
    let train = first_epoch(&dataset).await;
    let train_ids: BTreeSet<u64> = train.iter().map(|(id, _)| *id).collect();
    assert_eq!(
        train_ids.len(),
        32,
        "one epoch visits every training sample"
    );
    assert!(train_ids.is_disjoint(&eval_ids));
    assert_eq!(dataset.skipped_rows(), 0);
    for (_, sample) in train.iter().chain(&eval) {
        assert_eq!(sample.messages[0].role, "system");
        assert_eq!(sample.messages[0].content, "Use the calculator.");
        assert!(sample.metadata["target"].is_u64(), "{:?}", sample.metadata);
    }

    // The same seed gives the same samples in the same order; another seed does not.
    let again = Dataset::open(&cfg, Path::new("."), Some(&plugin), 42)
        .await
        .unwrap();
    assert_eq!(first_epoch(&again).await, train);
    let other = Dataset::open(&cfg, Path::new("."), Some(&plugin), 43)
        .await
        .unwrap();
    assert_ne!(first_epoch(&other).await, train);
}

#[tokio::test]
async fn countdown_dataset_refuses_a_path_too() {
    let plugin = load("countdown").await;
    let mut cfg = countdown(40, 8);
    cfg.path = Some("train.jsonl".into());
    let err = Dataset::open(&cfg, Path::new("."), Some(&plugin), 42)
        .await
        .err()
        .expect("two sources");
    assert!(err.to_string().contains("keep one source"), "{err}");
}
