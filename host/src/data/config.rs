//! The run config's `[data]` section: where the prompts come from, how they are split into
//! training and held-out samples, and what to do with rows that do not parse.
//!
//! This is the raw section as the user wrote it; [`DataConfig::validate`] checks the
//! combinations serde cannot (exactly one source, at most one way to choose the eval set),
//! and [`super::Dataset::open`] resolves it into working sources.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::{Path, PathBuf};

/// The `[data]` section.
///
/// ```toml
/// [data]
/// path = "data/train.jsonl"      # or: plugin = "countdown", plugin_config = { size = 500 }
/// eval_size = 32                 # or eval_fraction = 0.05, or eval_path = "data/test.jsonl"
/// system_prompt = "You are a careful calculator user."
/// on_bad_row = "skip"
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// A `.jsonl`, `.json` (an array of rows), `.csv`, `.parquet` or `.arrow` file (or a
    /// folder `datasets`' `save_to_disk` wrote), relative to the
    /// config file's folder.
    #[serde(default)]
    #[schemars(example = &"data/train.jsonl")]
    pub path: Option<PathBuf>,
    /// Overrides the format the extension of `path` (and `eval_path`) implies.
    #[serde(default)]
    #[schemars(example = &"parquet")]
    pub format: Option<Format>,
    /// The name of a dataset plugin; the caller resolves it to a loaded plugin.
    #[serde(default)]
    #[schemars(example = &"countdown")]
    pub plugin: Option<String>,
    /// The plugin's configuration, any TOML value; it crosses into the plugin as JSON.
    #[serde(default = "empty_object")]
    pub plugin_config: serde_json::Value,
    /// A separate held-out file.
    #[serde(default)]
    #[schemars(example = &"data/test.jsonl")]
    pub eval_path: Option<PathBuf>,
    /// How many samples to hold out of the training source for evaluation.
    #[serde(default)]
    #[schemars(example = 64)]
    pub eval_size: Option<usize>,
    /// The share of the training source to hold out, in `[0, 1)`.
    #[serde(default)]
    #[schemars(example = 0.05)]
    pub eval_fraction: Option<f64>,
    /// Visit the training samples in a new seeded order each epoch.
    #[serde(default = "yes")]
    pub shuffle: bool,
    /// A row that does not make a sample: `error` stops with the file, row and field;
    /// `skip` counts it and warns once.
    #[serde(default)]
    pub on_bad_row: OnBadRow,
    /// Prepended as a system message to every sample that has none.
    #[serde(default)]
    #[schemars(example = &"You are a careful assistant.")]
    pub system_prompt: Option<String>,
    /// The column holding a plain-text prompt (it becomes one user message).
    #[serde(default = "prompt_key")]
    pub prompt_key: String,
    /// The column holding a chat, a list of `{role, content}`.
    #[serde(default = "messages_key")]
    pub messages_key: String,
    /// The user message built from each row's columns, e.g. `"{question}\nPut your final
    /// answer within \\boxed{}."` (only `{name}` of letters, digits and `_` is replaced;
    /// `{{` and `}}` are literal braces). Replaces `prompt_key`/`messages_key`.
    #[serde(default)]
    #[schemars(example = &"{question}\nPut your final answer within \\boxed{}.")]
    pub prompt_template: Option<String>,
    /// The column that holds the answer: copied to each sample's metadata as `answer`,
    /// where the reward plugins look (GSM8K's and MATH's `answer`/`solution`, ...).
    #[serde(default)]
    #[schemars(example = &"answer")]
    pub answer_key: Option<String>,
    /// The column that holds the tests: copied to each sample's metadata as `tests`, where
    /// the code-tests reward looks (MBPP's `test_list`, HumanEval's `test`, APPS'
    /// `input_output`, CodeContests' `public_tests`). JSON text is parsed first.
    #[serde(default)]
    #[schemars(example = &"test_list")]
    pub tests_key: Option<String>,
    /// Use only the first N good samples of the source (before the eval split): for quick runs.
    #[serde(default)]
    #[schemars(example = 256)]
    pub max_samples: Option<usize>,
}

/// The default held-out set when none of `eval_path`, `eval_size` and `eval_fraction` is
/// set: 10% of the source, at most this many. Enough to see a trend without spending much
/// of a small dataset; sources of fewer than 10 samples hold out nothing.
pub const DEFAULT_EVAL_MAX: usize = 64;

/// The file formats rows can be read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// One JSON object per line (`.jsonl`, `.ndjson`).
    Jsonl,
    /// One JSON array of objects (`.json`).
    Json,
    /// A header row, then one row per sample (`.csv`).
    Csv,
    /// Apache Parquet (`.parquet`), as pandas, pyarrow, polars or `datasets` write it.
    Parquet,
    /// Apache Arrow IPC, stream or file (`.arrow`, `.feather`, `.ipc`): `datasets`' cache
    /// files, a folder `save_to_disk` wrote (with its `state.json`), Feather v2.
    Arrow,
}

/// What to do with a row that does not make a sample.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum OnBadRow {
    /// Stop with an error naming the file, the row and the field.
    #[default]
    Error,
    /// Skip it, count it, and warn once with the first error.
    Skip,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            path: None,
            format: None,
            plugin: None,
            plugin_config: empty_object(),
            eval_path: None,
            eval_size: None,
            eval_fraction: None,
            shuffle: true,
            on_bad_row: OnBadRow::Error,
            system_prompt: None,
            prompt_key: prompt_key(),
            messages_key: messages_key(),
            prompt_template: None,
            answer_key: None,
            tests_key: None,
            max_samples: None,
        }
    }
}

impl DataConfig {
    /// Checks what serde cannot: one source, one way to choose the eval set, sane numbers.
    pub fn validate(&self) -> Result<()> {
        match (&self.path, &self.plugin) {
            (Some(_), Some(_)) => {
                bail!("data.path and data.plugin are both set: keep one source of samples")
            }
            (None, None) => bail!(
                "data has no source: set data.path to a .jsonl/.json/.csv/.parquet/.arrow file, or data.plugin to a dataset plugin"
            ),
            _ => {}
        }
        if self.format.is_some() && self.path.is_none() && self.eval_path.is_none() {
            bail!("data.format applies to data.path and data.eval_path, and neither is set");
        }
        let eval_keys = [
            self.eval_path.is_some().then_some("eval_path"),
            self.eval_size.is_some().then_some("eval_size"),
            self.eval_fraction.is_some().then_some("eval_fraction"),
        ];
        let set: Vec<&str> = eval_keys.into_iter().flatten().collect();
        if set.len() > 1 {
            bail!(
                "data.{} are all set: choose the held-out samples one way",
                set.join(" and data.")
            );
        }
        if let Some(fraction) = self.eval_fraction
            && !(0.0..1.0).contains(&fraction)
        {
            bail!("data.eval_fraction is {fraction}; expected a number in [0, 1), e.g. 0.05");
        }
        if self.max_samples == Some(0) {
            bail!("data.max_samples is 0; leave it out to use every sample");
        }
        if self.prompt_key == self.messages_key {
            bail!(
                "data.prompt_key and data.messages_key are both `{}`; they name different columns",
                self.prompt_key
            );
        }
        if !self.plugin_config.is_object() {
            bail!("data.plugin_config must be a table, e.g. plugin_config = {{ size = 500 }}");
        }
        Ok(())
    }

    /// The plugin's configuration as the JSON text the plugin receives.
    pub fn plugin_config_json(&self) -> String {
        self.plugin_config.to_string()
    }

    /// How many of `len` source samples to hold out when there is no `eval_path`.
    pub fn eval_count(&self, len: usize) -> usize {
        match (self.eval_size, self.eval_fraction) {
            (Some(size), _) => size,
            // Rounded down, so a fraction never takes a sample the user did not ask for.
            (None, Some(fraction)) => (len as f64 * fraction) as usize,
            (None, None) => (len / 10).min(DEFAULT_EVAL_MAX),
        }
    }
}

impl Format {
    /// The format a file's extension implies, unless `overridden`.
    pub fn of(path: &Path, overridden: Option<Format>) -> Result<Format> {
        if let Some(format) = overridden {
            return Ok(format);
        }
        // A folder `datasets`' `save_to_disk` wrote: its shards are Arrow IPC streams.
        if path.is_dir() && path.join("state.json").is_file() {
            return Ok(Format::Arrow);
        }
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        Ok(match ext.as_deref() {
            Some("jsonl" | "ndjson") => Format::Jsonl,
            Some("json") => Format::Json,
            Some("csv") => Format::Csv,
            Some("parquet" | "pq") => Format::Parquet,
            Some("arrow" | "arrows" | "feather" | "ipc") => Format::Arrow,
            _ => bail!(
                "cannot tell the format of {} from its extension: set data.format to jsonl, json, csv, parquet or arrow",
                path.display()
            ),
        })
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::Jsonl => "jsonl",
            Format::Json => "json",
            Format::Csv => "csv",
            Format::Parquet => "parquet",
            Format::Arrow => "arrow",
        })
    }
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

fn yes() -> bool {
    true
}

fn prompt_key() -> String {
    "prompt".into()
}

fn messages_key() -> String {
    "messages".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<DataConfig, toml::de::Error> {
        toml::from_str(text)
    }

    #[test]
    fn defaults_and_plugin_config_as_json() {
        let cfg =
            parse("plugin = \"countdown\"\nplugin_config = { size = 50, ops = [\"+\"] }").unwrap();
        cfg.validate().unwrap();
        assert!(cfg.shuffle);
        assert_eq!(cfg.on_bad_row, OnBadRow::Error);
        assert_eq!(cfg.prompt_key, "prompt");
        assert_eq!(cfg.messages_key, "messages");
        // toml hands tables over with their keys sorted.
        assert_eq!(cfg.plugin_config_json(), r#"{"ops":["+"],"size":50}"#);
        let cfg = parse("path = \"a.jsonl\"").unwrap();
        assert_eq!(cfg.plugin_config_json(), "{}");
        assert_eq!(cfg.eval_count(5), 0);
        assert_eq!(cfg.eval_count(200), 20);
        assert_eq!(cfg.eval_count(100_000), DEFAULT_EVAL_MAX);
    }

    #[test]
    fn unknown_key_is_named() {
        let err = parse("path = \"a.jsonl\"\nshufle = false").unwrap_err();
        assert!(err.to_string().contains("shufle"), "{err}");
        let err = parse("path = \"a.jsonl\"\non_bad_row = \"ignore\"").unwrap_err();
        assert!(err.to_string().contains("ignore"), "{err}");
    }

    #[test]
    fn combinations_are_checked() {
        let check = |text: &str| parse(text).unwrap().validate().unwrap_err().to_string();
        assert!(check("path = \"a.csv\"\nplugin = \"p\"").contains("keep one source"));
        assert!(check("shuffle = false").contains("no source"));
        let both = check("path = \"a.csv\"\neval_size = 3\neval_fraction = 0.1");
        assert!(
            both.contains("data.eval_size and data.eval_fraction"),
            "{both}"
        );
        assert!(check("path = \"a.csv\"\neval_fraction = 1.0").contains("[0, 1)"));
        assert!(check("path = \"a.csv\"\nmax_samples = 0").contains("max_samples"));
        assert!(check("plugin = \"p\"\nplugin_config = 3").contains("table"));
        assert!(check("plugin = \"p\"\nformat = \"csv\"").contains("data.format"));
    }

    #[test]
    fn format_from_extension() {
        assert_eq!(
            Format::of(Path::new("d/x.JSONL"), None).unwrap(),
            Format::Jsonl
        );
        assert_eq!(
            Format::of(Path::new("x.parquet"), None).unwrap(),
            Format::Parquet
        );
        assert_eq!(
            Format::of(Path::new("x.txt"), Some(Format::Csv)).unwrap(),
            Format::Csv
        );
        let err = Format::of(Path::new("x.txt"), None).unwrap_err();
        assert!(err.to_string().contains("data.format"), "{err}");
    }
}
