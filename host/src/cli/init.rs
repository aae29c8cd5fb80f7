//! `rlhost init`: a commented starter config for the user's own model directory, data file
//! and plugins, written after looking at them: the model's architecture and whether its
//! chat template renders tools, the data's columns (which hold the prompt, the answer, the
//! tests), the plugins' roles (a trigger or environment for the rollout, rewards, a
//! dataset). `rlhost train --config` runs the file as written; the comments are the
//! config reference's own words for each key.

use crate::config::builtin::plugin_file;
use crate::config::reference;
use crate::data::rows::{ReadOptions, RowKeys, read_file};
use crate::data::{Format, OnBadRow};
use crate::plugin::Role;
use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Map, Value};
use std::fmt::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct InitArgs {
    /// The Hugging Face model directory to train (config.json, *.safetensors, tokenizer).
    #[arg(long)]
    model: PathBuf,
    /// The training data file as it comes (JSONL, JSON, CSV, Parquet, Arrow, or a
    /// `save_to_disk` folder). Without it, a dataset plugin among --plugin supplies it.
    #[arg(long)]
    data: Option<PathBuf>,
    /// A plugin for the run (a trigger or environment, rewards, a dataset); a bare name is
    /// looked for where installed plugins are (repeatable).
    #[arg(long = "plugin", value_name = "FILE.wasm", value_parser = plugin_file)]
    plugins: Vec<PathBuf>,
    /// Where to write the config.
    #[arg(long, default_value = "rlhost.toml")]
    out: PathBuf,
    /// Replace the file at --out if there is one.
    #[arg(long)]
    force: bool,
}

/// Columns that usually hold the prompt, the answer and the tests, most telling first.
const PROMPT_COLUMNS: [&str; 6] = [
    "question",
    "problem",
    "prompt",
    "text",
    "instruction",
    "input",
];
const ANSWER_COLUMNS: [&str; 5] = ["answer", "solution", "final_answer", "target", "output"];
const TEST_COLUMNS: [&str; 5] = ["test_list", "test", "tests", "input_output", "public_tests"];

pub fn run(args: InitArgs, handle: &tokio::runtime::Handle) -> Result<()> {
    if args.out.exists() && !args.force {
        bail!(
            "{} exists: choose another --out, or add --force to replace it",
            args.out.display()
        );
    }
    let base = args
        .out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf();
    let model = Model::inspect(&args.model)?;
    let data = args.data.as_deref().map(Data::inspect).transpose()?;
    let plugins = handle.block_on(inspect_plugins(&args.plugins))?;
    if data.is_none() && !plugins.iter().any(|p| p.roles.contains(&Role::Dataset)) {
        bail!("a run needs data: give --data FILE, or a dataset plugin with --plugin");
    }
    let text = write_config(&model, data.as_ref(), &plugins, &base)?;
    let tmp = args.out.with_extension("toml.tmp");
    std::fs::write(&tmp, &text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &args.out).with_context(|| format!("writing {}", args.out.display()))?;
    println!("wrote {}", args.out.display());
    println!(
        "next: rlhost config show --config {0}   (every setting, defaults filled in)\n      rlhost train --config {0}",
        args.out.display()
    );
    Ok(())
}

struct Model {
    path: PathBuf,
    summary: String,
    /// Whether the chat template renders a `tools` list (for function calling).
    renders_tools: bool,
}

impl Model {
    fn inspect(dir: &Path) -> Result<Model> {
        let config = crate::model::config::ModelConfig::from_dir(dir)
            .with_context(|| format!("--model {}", dir.display()))?;
        let template = crate::model::chat::ChatTemplate::from_dir(dir)
            .with_context(|| format!("--model {}", dir.display()))?;
        let renders_tools = template.source().contains("tools");
        let summary = format!(
            "{}, {} layers, hidden size {}, vocabulary {}",
            config.arch.model_type(),
            config.num_hidden_layers,
            config.hidden_size,
            config.vocab_size
        );
        Ok(Model {
            path: dir.to_path_buf(),
            summary,
            renders_tools,
        })
    }
}

struct Data {
    path: PathBuf,
    format: Format,
    columns: Vec<String>,
    template: Option<String>,
    answer: Option<String>,
    tests: Option<String>,
    rows_seen: usize,
}

impl Data {
    fn inspect(path: &Path) -> Result<Data> {
        let format =
            Format::of(path, None).with_context(|| format!("--data {}", path.display()))?;
        // With a template, a row's sample keeps every column in its metadata: the first
        // rows, as they are.
        let options = ReadOptions {
            keys: RowKeys {
                prompt: "prompt",
                messages: "messages",
                template: Some("row"),
                answer: None,
                tests: None,
            },
            on_bad_row: OnBadRow::Skip,
            max_samples: Some(16),
        };
        let loaded = read_file(path, format, &options)
            .with_context(|| format!("--data {}", path.display()))?;
        let first: &Map<String, Value> = loaded.samples[0]
            .metadata
            .as_object()
            .context("a row is an object")?;
        let columns: Vec<String> = first.keys().cloned().collect();
        let has = |c: &str| columns.iter().any(|k| k == c);
        let has_prompt = has("messages") || has("prompt");
        let pick = |names: &[&str]| names.iter().find(|n| has(n)).map(|n| n.to_string());
        let template = if has_prompt {
            None
        } else {
            let column = pick(&PROMPT_COLUMNS).or_else(|| {
                // Else the first column of text.
                first
                    .iter()
                    .find(|(_, v)| v.is_string())
                    .map(|(k, _)| k.clone())
            });
            Some(column.map(|c| format!("{{{c}}}")).with_context(|| {
                format!(
                    "--data {}: no column holds text for a prompt; its columns: {}",
                    path.display(),
                    columns.join(", ")
                )
            })?)
        };
        let tests = pick(&TEST_COLUMNS);
        // The answer column is what a math reward compares; a code dataset's `output` or
        // `solution` is a program, not an answer.
        let answer = if tests.is_some() {
            None
        } else {
            pick(&ANSWER_COLUMNS)
        };
        Ok(Data {
            path: path.to_path_buf(),
            format,
            columns,
            template,
            answer,
            tests,
            rows_seen: loaded.samples.len(),
        })
    }
}

struct Inspected {
    name: String,
    path: PathBuf,
    roles: Vec<Role>,
}

async fn inspect_plugins(paths: &[PathBuf]) -> Result<Vec<Inspected>> {
    let plugins = crate::config::builtin::probe(paths).await?;
    Ok(plugins
        .iter()
        .zip(paths)
        .map(|(plugin, path)| Inspected {
            name: plugin.name().to_string(),
            path: path.clone(),
            roles: plugin.roles().to_vec(),
        })
        .collect())
}

/// A path as the config writes it: relative to the config's folder when it lies inside
/// it, else absolute.
fn config_path(path: &Path, base: &Path) -> Result<String> {
    let full = path
        .canonicalize()
        .with_context(|| format!("{} not found", path.display()))?;
    let base = base.canonicalize().unwrap_or_else(|_| base.to_path_buf());
    Ok(match full.strip_prefix(&base) {
        Ok(rel) => rel.display().to_string(),
        Err(_) => full.display().to_string(),
    })
}

/// The config file's text.
fn write_config(
    model: &Model,
    data: Option<&Data>,
    plugins: &[Inspected],
    base: &Path,
) -> Result<String> {
    let docs: std::collections::BTreeMap<String, String> = reference::entries()
        .into_iter()
        .map(|e| (e.key, e.doc))
        .collect();
    let mut out = String::new();
    let key = |out: &mut String, full: &str, value: String| {
        let doc = docs.get(full).map(String::as_str).unwrap_or("");
        for line in wrap(doc, 86) {
            let _ = writeln!(out, "# {line}");
        }
        let name = full.rsplit('.').next().unwrap_or(full);
        let _ = writeln!(out, "{name} = {value}\n");
    };
    let q = |s: &str| format!("{s:?}");

    let _ = writeln!(
        out,
        "# A starter run config written by `rlhost init`, from:"
    );
    let _ = writeln!(
        out,
        "#   model  {} ({})",
        model.path.display(),
        model.summary
    );
    if let Some(d) = data {
        let _ = writeln!(
            out,
            "#   data   {} ({}, columns: {})",
            d.path.display(),
            d.format,
            d.columns.join(", ")
        );
    }
    for p in plugins {
        let roles = crate::plugin::inspect::role_list(&p.roles);
        let _ = writeln!(out, "#   plugin {} ({}): {roles}", p.name, p.path.display());
    }
    let _ = writeln!(
        out,
        "# Keys not written here take their defaults: `rlhost config show --config THIS_FILE`\n\
         # prints them all, `rlhost config reference` says what each does.\n"
    );

    out.push_str("[run]\n");
    key(&mut out, "run.seed", "1".into());

    out.push_str("[model]\n");
    key(&mut out, "model.path", q(&config_path(&model.path, base)?));
    key(&mut out, "model.device", q("auto"));
    if model.renders_tools {
        out.push_str(
            "# This model's chat template renders a `tools` list: it was trained for function\n\
             # calling in its own format. Give a tools plugin (rollout.tools) and it calls its\n\
             # functions that way; triggers fire on text patterns the task teaches.\n\n",
        );
    }

    out.push_str("[data]\n");
    let dataset = plugins.iter().find(|p| p.roles.contains(&Role::Dataset));
    match data {
        Some(d) => {
            key(&mut out, "data.path", q(&config_path(&d.path, base)?));
            if let Some(t) = &d.template {
                key(&mut out, "data.prompt_template", q(t));
            }
            if let Some(a) = &d.answer {
                key(&mut out, "data.answer_key", q(a));
            }
            if let Some(t) = &d.tests {
                key(&mut out, "data.tests_key", q(t));
            }
            if d.rows_seen < 16 {
                let _ = writeln!(
                    out,
                    "# The file holds {} rows: too few to hold any out for evaluation.\neval_size = 0\n",
                    d.rows_seen
                );
            }
        }
        None => {
            let p = dataset.expect("checked by the caller");
            key(&mut out, "data.plugin", q(&p.name));
        }
    }

    out.push_str("[sampling]\n");
    key(&mut out, "sampling.max_new_tokens", "512".into());

    out.push_str("[rollout]\n");
    key(&mut out, "rollout.group_size", "8".into());
    key(&mut out, "rollout.prompts_per_step", "8".into());
    if let Some(t) = plugins.iter().find(|p| p.roles.contains(&Role::Trigger)) {
        key(&mut out, "rollout.trigger", q(&t.name));
    }
    if let Some(e) = plugins
        .iter()
        .find(|p| p.roles.contains(&Role::Environment))
    {
        key(&mut out, "rollout.environment", q(&e.name));
    }
    let tools: Vec<String> = plugins
        .iter()
        .filter(|p| p.roles.contains(&Role::Tools))
        .map(|p| q(&p.name))
        .collect();
    if !tools.is_empty() {
        key(&mut out, "rollout.tools", format!("[{}]", tools.join(", ")));
        if !model.renders_tools {
            out.push_str(
                "# This model's chat template does not render `tools`: the run will refuse it. Use\n\
                 # an instruct model trained for function calling, or add a chat_template.jinja.\n\n",
            );
        }
    }

    for p in plugins {
        let _ = writeln!(out, "[plugins.{}]", p.name);
        key(
            &mut out,
            "plugins.NAME.path",
            q(&config_path(&p.path, base)?),
        );
    }

    let rewards: Vec<&Inspected> = plugins
        .iter()
        .filter(|p| p.roles.contains(&Role::Reward))
        .collect();
    if rewards.is_empty() {
        out.push_str(
            "# No reward plugin was given, so every trajectory scores 0 and nothing is learned:\n\
             # add one (`[plugins.NAME]` and a `[[rewards]]` entry naming it), e.g. math_answer.wasm\n\
             # for an answer column or code_tests.wasm for a tests column.\n\n",
        );
    }
    for r in rewards {
        out.push_str("[[rewards]]\n");
        key(&mut out, "rewards[].plugin", q(&r.name));
        if r.name == "code_tests" && data.is_some_and(|d| d.tests.is_some()) {
            key(&mut out, "rewards[].cases", q("tests"));
        }
    }

    out.push_str("[train]\n");
    key(&mut out, "train.steps", "100".into());
    key(&mut out, "train.lr", "1e-5".into());
    Ok(out)
}

/// `text` in lines of at most `width` characters, broken at spaces.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines
}
