//! `rlhost plugin new`, `inspect`, `call` and `test`: the plugin author's quick loop.

use crate::model::LanguageModel;
use crate::model::placement::Placement;
use crate::plugin::cache;
use crate::plugin::conformance::{self, Verdict};
use crate::plugin::model::GenerateGrant;
use crate::plugin::scaffold::{self, Lang};
use crate::plugin::{
    DirGrant, Grants, Limits, Plugin, PluginRuntime, PluginSpec, Role, RuntimeOptions, Sample,
    Transcript,
};
use crate::rollout::live::new_match;
use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use std::path::{Path, PathBuf};

#[derive(Debug, Subcommand)]
pub enum PluginCommand {
    /// Make a plugin project that builds at once and passes `rlhost plugin test`.
    New(NewArgs),
    /// Show a plugin's WIT version, roles, imports, size and sha256.
    Inspect {
        /// The plugin component (.wasm); a bare name is looked for where installed plugins are.
        #[arg(value_parser = crate::config::builtin::plugin_file)]
        file: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        sandbox: SandboxArgs,
    },
    /// Call one role of a plugin and show the result or the typed fault.
    Call(CallArgs),
    /// Check that a plugin keeps the contract, role by role: a pass/fail table; exits
    /// non-zero when a check fails.
    Test(TestArgs),
}

#[derive(Debug, Args)]
pub struct NewArgs {
    /// The plugin's name (lowercase letters, digits, `_`): its folder, package and name.
    name: String,
    /// rust, python, js or c.
    #[arg(long)]
    lang: Lang,
    /// trigger, environment, dataset, reward or tools.
    #[arg(long)]
    role: Role,
    /// The folder to make the project in.
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// Rust: the `sdk` folder of an rlhost checkout (default: the one this binary was
    /// built from).
    #[arg(long)]
    sdk: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct TestArgs {
    /// The plugin component (.wasm); a bare name is looked for where installed plugins are.
    #[arg(value_parser = crate::config::builtin::plugin_file)]
    file: PathBuf,
    /// A configuration the plugin accepts, as JSON, for the checks that need an opened
    /// role (the checks of `{}` and of a malformed config run anyway).
    #[arg(long, default_value = "{}")]
    config: String,
    /// A JSON file with one sample, or a JSONL file with one per line, to open triggers
    /// and environments with and to build reward trajectories from (default: the plugin's
    /// own dataset when it exports one, else a plain prompt).
    #[arg(long)]
    sample: Option<PathBuf>,
    /// How many random inputs each role gets.
    #[arg(long, default_value_t = 200)]
    inputs: usize,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    sandbox: SandboxArgs,
}

#[derive(Debug, Args)]
pub struct CallArgs {
    /// The plugin component (.wasm); a bare name is looked for where installed plugins are.
    #[arg(value_parser = crate::config::builtin::plugin_file)]
    file: PathBuf,
    /// The role to call: trigger, environment, dataset, reward or tools.
    role: Role,
    /// The plugin's configuration, as JSON.
    #[arg(long, default_value = "{}")]
    config: String,
    /// trigger: the generated text to fire on; environment: an assistant turn. Repeat it
    /// to call several times on the same session.
    #[arg(long)]
    text: Vec<String>,
    /// tools: a call, `NAME:ARGUMENTS` with the arguments as a JSON object; repeat it to
    /// call several times on the same session. Without it, the functions are listed.
    #[arg(long = "call", value_name = "NAME:JSON")]
    calls: Vec<String>,
    /// The user prompt of the sample (trigger, environment, reward, tools).
    #[arg(long, conflicts_with = "sample")]
    prompt: Option<String>,
    /// A JSON file with the sample: {"messages": [...], "metadata": {...}}.
    #[arg(long)]
    sample: Option<PathBuf>,
    /// reward: a JSON file with the trajectory to score. Without it, the trajectory is
    /// the sample followed by --text as the assistant's answer.
    #[arg(long)]
    trajectory: Option<PathBuf>,
    /// dataset: which sample to show (default: the first).
    #[arg(long)]
    index: Option<u64>,
    /// reward: score the trajectory this many times on one open scorer and print the
    /// time per score (the component already loaded and instantiated): a plugin's own
    /// cost, without the process and the load.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
    /// Seed for the plugin's randomness and the dataset.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    sandbox: SandboxArgs,
}

/// Sandbox limits and grants; each overrides the default.
#[derive(Debug, Args)]
pub struct SandboxArgs {
    /// Memory cap per instance, in MiB.
    #[arg(long)]
    memory_mib: Option<u64>,
    /// Deadline per call, in milliseconds.
    #[arg(long)]
    timeout_ms: Option<u64>,
    /// Fuel budget per call (turns on fuel metering).
    #[arg(long)]
    fuel: Option<u64>,
    /// Most bytes one call may return.
    #[arg(long)]
    max_output_bytes: Option<usize>,
    /// Mount a host directory read-only: HOST_DIR[:GUEST_PATH] (default guest path /data).
    #[arg(long = "grant-dir")]
    grant_dirs: Vec<DirGrant>,
    /// Allow outbound HTTP to scheme://host[:port] (Spin's allowed_outbound_hosts shape:
    /// `*.suffix`, an IP address or `*` as the host; a port, `lo..hi` or `*`); repeatable.
    #[arg(long = "allow-http", value_name = "DESTINATION")]
    allow_http: Vec<String>,
    /// Cap on each HTTP request and response body, in bytes (default 1 MiB).
    #[arg(long)]
    max_http_bytes: Option<u64>,
    /// HTTP requests in flight at once (default 4).
    #[arg(long)]
    max_http_in_flight: Option<usize>,
    /// Grant `model.generate`, as a JSON object with the run config's keys
    /// (max_calls_per_trajectory, max_new_tokens, max_prompt_tokens, temperature_max,
    /// weights, max_wait_ms); alone: the defaults. Needs --model.
    #[arg(long, value_name = "GRANT", num_args = 0..=1, default_missing_value = "{}")]
    generate: Option<String>,
    /// The model directory that answers the plugin's `model.generate` calls (on the CPU,
    /// no adapter: `policy` and `base` are the same weights here).
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Compile without reading or writing the compile cache.
    #[arg(long)]
    no_cache: bool,
}

impl SandboxArgs {
    /// The `model.generate` grant of `--generate`, checked.
    fn generate(&self) -> Result<Option<GenerateGrant>> {
        let Some(json) = &self.generate else {
            if self.model.is_some() {
                bail!(
                    "--model answers the plugin's model.generate calls: grant them with --generate too"
                );
            }
            return Ok(None);
        };
        let grant: GenerateGrant =
            serde_json::from_str(json).map_err(|e| anyhow::anyhow!("--generate {json}: {e}"))?;
        grant
            .check()
            .map_err(|e| anyhow::anyhow!("--generate {json}: {e}"))?;
        if self.model.is_none() {
            bail!("--generate needs --model DIR: the model that answers the plugin's calls");
        }
        Ok(Some(grant))
    }

    fn spec(&self, path: &Path) -> PluginSpec {
        let mut limits = Limits::default();
        if let Some(v) = self.memory_mib {
            limits.memory_mib = v;
        }
        if let Some(v) = self.timeout_ms {
            limits.timeout_ms = v;
        }
        limits.fuel = self.fuel;
        if let Some(v) = self.max_output_bytes {
            limits.max_output_bytes = v;
        }
        PluginSpec {
            path: path.to_path_buf(),
            limits,
            grants: Grants {
                read_only_dirs: self.grant_dirs.clone(),
                ..Grants::http(
                    &self.allow_http,
                    self.max_http_bytes,
                    self.max_http_in_flight,
                )
            },
        }
    }

    pub(super) async fn load(&self, path: &Path) -> Result<Plugin> {
        let generate = self.generate()?;
        let plugin = self.load_plugin(path, generate.clone()).await?;
        if let (Some(_), Some(dir)) = (&generate, &self.model) {
            let lm = LanguageModel::open(dir, &Placement::CPU)
                .with_context(|| format!("--model {}", dir.display()))?;
            plugin.serve_model(crate::rollout::asks::standalone(lm));
        }
        Ok(plugin)
    }

    async fn load_plugin(&self, path: &Path, generate: Option<GenerateGrant>) -> Result<Plugin> {
        let runtime = PluginRuntime::new(&RuntimeOptions {
            fuel: self.fuel.is_some(),
            cache_dir: if self.no_cache {
                None
            } else {
                cache::default_dir()
            },
            ..RuntimeOptions::default()
        })?;
        let mut spec = self.spec(path);
        spec.grants.generate = generate;
        runtime.load(spec).await
    }
}

pub async fn run(command: PluginCommand) -> Result<()> {
    match command {
        PluginCommand::Inspect {
            file,
            json,
            sandbox,
        } => inspect(&file, json, &sandbox).await,
        PluginCommand::Call(args) => call(args).await,
        PluginCommand::Test(args) => test(args).await,
        PluginCommand::New(args) => new(args),
    }
}

fn new(args: NewArgs) -> Result<()> {
    let made = scaffold::create(&scaffold::Spec {
        name: args.name.clone(),
        lang: args.lang,
        role: args.role,
        parent: args.dir,
        sdk: args.sdk,
    })?;
    println!(
        "made the {} {} plugin `{}` in {}",
        args.lang,
        args.role,
        args.name,
        made.dir.display()
    );
    println!("build it: cd {} && {}", made.dir.display(), made.build);
    println!("test it:  rlhost plugin test {}", made.component);
    Ok(())
}

async fn test(args: TestArgs) -> Result<()> {
    if let Err(e) = serde_json::from_str::<serde_json::Value>(&args.config) {
        bail!("--config is not valid JSON ({e}); pass an object such as '{{}}'");
    }
    if args.inputs == 0 {
        bail!("--inputs must be at least 1");
    }
    let samples = match &args.sample {
        Some(path) => read_samples(path)?,
        None => Vec::new(),
    };
    let plugin = args.sandbox.load(&args.file).await?;
    let options = conformance::Options {
        config: args.config.clone(),
        samples,
        inputs: args.inputs,
        seed: args.seed,
        // Each check on stderr as it completes (a slow plugin shows where it is); the
        // table follows on stdout.
        progress: !args.json,
    };
    let report = conformance::run(&plugin, &options).await;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&args.file, &plugin, &report);
    }
    if !report.passed() {
        bail!(
            "plugin `{}`: {} of {} checks failed and {} could not run",
            report.plugin,
            report.count(Verdict::Fail),
            report.checks.len(),
            report.count(Verdict::Skip)
        );
    }
    Ok(())
}

/// One sample (a JSON object) or several (JSONL).
fn read_samples(path: &Path) -> Result<Vec<Sample>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read sample file {}", path.display()))?;
    if let Ok(sample) = serde_json::from_str::<Sample>(&text) {
        return Ok(vec![sample]);
    }
    let mut samples = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let sample = serde_json::from_str(line).with_context(|| {
            format!(
                "{} line {}: not a sample {{\"messages\": [...], \"metadata\": {{...}}}}",
                path.display(),
                i + 1
            )
        })?;
        samples.push(sample);
    }
    if samples.is_empty() {
        bail!("{} holds no sample", path.display());
    }
    Ok(samples)
}

fn print_report(file: &Path, plugin: &Plugin, report: &conformance::Report) {
    let info = plugin.info();
    println!(
        "plugin test: {} {} ({})",
        info.name,
        info.version,
        file.display()
    );
    let role = |c: &conformance::Check| c.role.map_or("-".to_string(), |r| r.to_string());
    let width = report
        .checks
        .iter()
        .map(|c| c.name.chars().count())
        .max()
        .unwrap_or(0);
    println!(
        "  {:<11} {:<width$}  {:<6} detail",
        "role", "check", "result"
    );
    for c in &report.checks {
        let outcome = match c.outcome {
            Verdict::Pass => "pass",
            Verdict::Warn => "warn",
            Verdict::Fail => "FAIL",
            Verdict::Skip => "skip",
        };
        println!(
            "  {:<11} {:<width$}  {outcome:<6} {}",
            role(c),
            c.name,
            c.detail
        );
    }
    println!("time per call:");
    for t in &report.timings {
        println!(
            "  {:<18} {:>5} calls  median {:.3} ms  max {:.3} ms",
            t.call, t.calls, t.median_ms, t.max_ms
        );
    }
    println!(
        "{} passed, {} failed, {} warnings, {} skipped",
        report.count(Verdict::Pass),
        report.count(Verdict::Fail),
        report.count(Verdict::Warn),
        report.count(Verdict::Skip)
    );
}

async fn inspect(file: &Path, json: bool, sandbox: &SandboxArgs) -> Result<()> {
    let plugin = sandbox.load(file).await?;
    let info = plugin.info();
    if json {
        let value = serde_json::json!({
            "file": file,
            "name": info.name,
            "version": info.version,
            "description": info.description,
            "wit": format!("rlhost:plugin@{}", plugin.wit_version()),
            "roles": plugin.roles(),
            "imports": plugin.imports(),
            "exports": plugin.exports(),
            "size": plugin.size(),
            "sha256": plugin.sha256(),
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    println!("file:        {}", file.display());
    println!("plugin:      {} {}", info.name, info.version);
    if !info.description.is_empty() {
        println!("description: {}", info.description);
    }
    println!("wit:         rlhost:plugin@{}", plugin.wit_version());
    println!(
        "roles:       {}",
        crate::plugin::inspect::role_list(plugin.roles())
    );
    println!("imports:");
    for import in plugin.imports() {
        println!("  {import}");
    }
    println!(
        "size:        {} bytes ({:.1} MiB)",
        plugin.size(),
        plugin.size() as f64 / (1 << 20) as f64
    );
    println!("sha256:      {}", plugin.sha256());
    Ok(())
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path, what: &str) -> Result<T> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read {what} file {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not a valid {what}", path.display()))
}

impl CallArgs {
    fn sample(&self) -> Result<Sample> {
        if let Some(path) = &self.sample {
            return read_json(path, "sample");
        }
        Ok(Sample::from_prompt(self.prompt.as_deref().unwrap_or("")))
    }
}

async fn call(args: CallArgs) -> Result<()> {
    if let Err(e) = serde_json::from_str::<serde_json::Value>(&args.config) {
        bail!("--config is not valid JSON ({e}); pass an object such as '{{}}'");
    }
    let plugin = args.sandbox.load(&args.file).await?;
    let mut out = serde_json::Map::new();
    out.insert("plugin".into(), plugin.id().into());
    match args.role {
        Role::Trigger => {
            if args.text.is_empty() {
                bail!("`plugin call ... trigger` needs --text: the generated text to fire on");
            }
            let sample = args.sample()?;
            let mut session = plugin
                .open_trigger(&args.config, &sample, args.seed)
                .await?;
            let patterns = session.stop_patterns().to_vec();
            if !args.json {
                println!("stop patterns: {patterns:?}");
            }
            out.insert("stop_patterns".into(), patterns.clone().into());
            let mut outputs = Vec::new();
            // Per text: the byte the text was cut at, when an answer came before its end.
            let mut cuts: Vec<Option<usize>> = Vec::new();
            for text in &args.text {
                // As in a rollout: the host fires at the end of each stop pattern as it is
                // generated, and the first answer ends the model's text there.
                let mut from = 0;
                let mut output = None;
                let mut fired = false;
                while let Some(end) = new_match(text, from, &patterns) {
                    fired = true;
                    output = session.fire(&text[..end]).await?;
                    from = end;
                    if output.is_some() {
                        break;
                    }
                }
                if !fired {
                    eprintln!(
                        "note: the text holds no stop pattern; in a rollout the host would not fire on it (firing on the whole text anyway)"
                    );
                    output = session.fire(text).await?;
                }
                let cut = (fired && output.is_some() && from < text.len()).then_some(from);
                cuts.push(cut);
                if let Some(from) = cut {
                    let rest = &text[from..];
                    eprintln!(
                        "note: cut at byte {from}, the end of the first stop pattern the answer came at; in a rollout the {} bytes after it ({rest:?}) are never generated: the tool's answer goes there",
                        rest.len()
                    );
                }
                if !args.json {
                    match &output {
                        Some(text) => println!("append: {text}"),
                        None => println!("append: nothing (generation goes on)"),
                    }
                }
                outputs.push(output);
            }
            out.insert("outputs".into(), serde_json::to_value(outputs)?);
            out.insert("cut_at".into(), serde_json::to_value(cuts)?);
        }
        Role::Environment => {
            if args.text.is_empty() {
                bail!("`plugin call ... environment` needs --text: an assistant turn");
            }
            let sample = args.sample()?;
            let mut episode = plugin
                .open_environment(&args.config, &sample, args.seed)
                .await?;
            let mut steps = Vec::new();
            for text in &args.text {
                let step = episode.step(text).await?;
                if !args.json {
                    for m in &step.messages {
                        println!("{}: {}", m.role, m.content);
                    }
                    println!("done: {}, reward: {:?}", step.done, step.reward);
                }
                let finished = step.done;
                steps.push(step);
                if finished {
                    break;
                }
            }
            out.insert("steps".into(), serde_json::to_value(steps)?);
        }
        Role::Dataset => {
            let mut source = plugin.open_dataset(&args.config, args.seed).await?;
            let index = args.index.unwrap_or(0);
            if source.is_empty() {
                bail!("plugin `{}` opened an empty dataset", plugin.id());
            }
            let sample = source.get(index).await?;
            if !args.json {
                println!("len: {}", source.len());
                println!("sample {index}: {}", serde_json::to_string_pretty(&sample)?);
            }
            out.insert("len".into(), source.len().into());
            out.insert("index".into(), index.into());
            out.insert("sample".into(), serde_json::to_value(sample)?);
        }
        Role::Tools => {
            let sample = args.sample()?;
            let mut session = plugin.open_tools(&args.config, &sample, args.seed).await?;
            let functions: Vec<serde_json::Value> = session
                .functions()
                .iter()
                .map(|f| {
                    serde_json::json!({"name": f.name, "description": f.description,
                        "parameters": f.parameters, "stateless": f.stateless})
                })
                .collect();
            if !args.json {
                for f in session.functions() {
                    println!("function {}: {} {}", f.name, f.description, f.parameters);
                }
            }
            out.insert("functions".into(), functions.into());
            let mut results = Vec::new();
            for call in &args.calls {
                let Some((name, arguments)) = call.split_once(':') else {
                    bail!(
                        "--call {call:?}: expected NAME:ARGUMENTS, e.g. --call 'convert:{{\"value\": 3}}'"
                    );
                };
                let parsed: serde_json::Value = serde_json::from_str(arguments).map_err(|e| {
                    anyhow::anyhow!("--call {name}: the arguments are not JSON: {e}")
                })?;
                // As in a run: the host checks the call before the plugin sees it.
                let spec = session.functions().iter().find(|f| f.name == name).cloned();
                let checked = match &spec {
                    None => Err(format!("there is no function {name:?}")),
                    Some(spec) => crate::plugin::schema::validate(&spec.parameters, &parsed),
                };
                let result = match checked {
                    Err(e) => serde_json::json!({"call": name, "refused_by_host": e}),
                    Ok(()) => match session.invoke(name, arguments).await? {
                        Ok(text) => serde_json::json!({"call": name, "result": text}),
                        Err(text) => serde_json::json!({"call": name, "error": text}),
                    },
                };
                if !args.json {
                    println!("{result}");
                }
                results.push(result);
            }
            out.insert("calls".into(), results.into());
        }
        Role::Reward => {
            let trajectory = match &args.trajectory {
                Some(path) => read_json::<Transcript>(path, "trajectory")?,
                None => Transcript::single_turn(&args.sample()?, args.text.concat()),
            };
            let mut scorer = plugin.open_reward(&args.config).await?;
            let started = std::time::Instant::now();
            let components = scorer.score(&trajectory).await?;
            let mut seconds = started.elapsed().as_secs_f64();
            if args.repeat > 1 {
                // The first score is timed apart: it may touch memory for the first time.
                let started = std::time::Instant::now();
                for _ in 1..args.repeat {
                    scorer.score(&trajectory).await?;
                }
                seconds = started.elapsed().as_secs_f64() / f64::from(args.repeat - 1);
                if !args.json {
                    println!(
                        "time per score: {:.1} µs ({} scores after the first)",
                        seconds * 1e6,
                        args.repeat - 1
                    );
                }
            }
            out.insert("seconds_per_score".into(), seconds.into());
            let note = scorer.take_note();
            if !args.json {
                for c in &components {
                    println!("{}: {}", c.name, c.value);
                }
                if let Some(note) = &note {
                    println!("note: {note}");
                }
            }
            out.insert("components".into(), serde_json::to_value(components)?);
            out.insert("note".into(), note.into());
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}
