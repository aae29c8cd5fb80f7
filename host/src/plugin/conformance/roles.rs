//! The checks of each role a plugin exports, run by [`super::run`]: a dataset's samples,
//! a tools plugin's functions, a reward's components, a trigger's firings and an
//! environment's steps, each over the seeded random inputs of [`super::inputs`].

use super::inputs::{clip, random_value, trajectory};
use super::{MAX_TIMEOUTS, Streak, Tester, Verdict, as_fault, components_problem, sample_problem};
use crate::plugin::{FaultKind, Role, Sample};

impl Tester<'_> {
    pub(super) async fn dataset(&mut self) {
        let role = Some(Role::Dataset);
        let (config, seed) = (self.options.config.clone(), self.options.seed);
        let (mut a, mut b) = match (
            self.plugin.open_dataset(&config, seed).await,
            self.plugin.open_dataset(&config, seed).await,
        ) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => {
                let detail = format!("{e:#}");
                return self.check(role, "opens", Verdict::Fail, detail);
            }
        };
        let len = a.len();
        if len == 0 || b.len() != len {
            let detail = format!("len {len} then {}: must be the same and above 0", b.len());
            return self.check(role, "len", Verdict::Fail, detail);
        }
        self.check(role, "len", Verdict::Pass, format!("{len} samples"));
        let mut indices = vec![0, len - 1];
        for _ in 0..self.options.inputs.saturating_sub(2) {
            indices.push(self.rng.below(len));
        }
        let (mut faults, mut differ, mut malformed) = (Vec::new(), Vec::new(), Vec::new());
        let (mut compared, mut made, mut streak) = (0, 0, Streak::default());
        for &i in &indices {
            made += 1;
            let first = self.timed("dataset.get", async || a.get(i).await).await;
            let fault = first.as_ref().err().cloned();
            let stop = streak.push(self.saw(fault.as_ref()));
            if let Some(f) = fault {
                faults.push(f);
                if stop || self.timeouts >= MAX_TIMEOUTS {
                    break;
                }
                continue;
            }
            let again = b.get(i).await;
            self.saw(again.as_ref().err());
            match (first, again) {
                (Ok(x), Ok(y)) => {
                    compared += 1;
                    if x != y {
                        differ.push(i);
                    }
                    if let Some(problem) = sample_problem(&x) {
                        malformed.push(format!("sample {i}: {problem}"));
                    }
                }
                (Err(f), _) | (_, Err(f)) => faults.push(f),
            }
        }
        let n = indices.len();
        let stopped = streak.stopped(made, n);
        self.faults_check(Role::Dataset, "get: no fault", made, &faults, &stopped);
        let (outcome, detail) = if compared == 0 {
            (
                Verdict::Skip,
                "nothing to compare: no index gave a sample twice".to_string(),
            )
        } else if differ.is_empty() {
            (
                Verdict::Pass,
                format!("{compared} indices, opened twice with seed {seed}"),
            )
        } else {
            (
                Verdict::Fail,
                format!(
                    "{} of {compared} indices gave another sample the second time (first: {})",
                    differ.len(),
                    differ[0]
                ),
            )
        };
        self.check(role, "deterministic for a seed", outcome, detail);
        let (outcome, detail) = match malformed.first() {
            None if compared == 0 => (
                Verdict::Skip,
                "nothing to check: no sample came back".to_string(),
            ),
            None => (Verdict::Pass, format!("{compared} samples")),
            Some(first) => (
                Verdict::Fail,
                format!("{} malformed; {first}", malformed.len()),
            ),
        };
        self.check(role, "samples are well formed", outcome, detail);
    }

    /// A tools plugin: its functions are well formed (checked when a session opens: names,
    /// JSON Schema objects this host can check), calls with random arguments that fit
    /// each function's schema never fault, and arguments that do not fit get the
    /// function's own error (`err`), not a fault.
    pub(super) async fn tools(&mut self, samples: &[Sample]) {
        let role = Some(Role::Tools);
        let config = self.options.config.clone();
        let seed = self.options.seed;
        let mut session = match self.plugin.open_tools(&config, &samples[0], seed).await {
            Ok(s) => s,
            Err(e) => {
                return self.check(
                    role,
                    "functions are well formed",
                    Verdict::Fail,
                    format!("{e:#}"),
                );
            }
        };
        let specs = session.functions().to_vec();
        if specs.is_empty() {
            return self.check(
                role,
                "functions are well formed",
                Verdict::Fail,
                "it lists no function".into(),
            );
        }
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        self.check(
            role,
            "functions are well formed",
            Verdict::Pass,
            names.join(", "),
        );
        let (mut faults, mut answered, mut refused, mut made, mut streak) =
            (Vec::new(), 0, 0, 0, Streak::default());
        for i in 0..self.options.inputs {
            let spec = &specs[i % specs.len()];
            let arguments = random_value(&spec.parameters, &mut self.rng, 0);
            made += 1;
            let text = arguments.to_string();
            let result = self
                .timed("tools.call", async || {
                    session.invoke(&spec.name, &text).await
                })
                .await;
            let stop = streak.push(self.saw(result.as_ref().err()));
            match result {
                Ok(Ok(_)) => answered += 1,
                Ok(Err(_)) => refused += 1,
                Err(f) => faults.push(f),
            }
            if stop || self.timeouts >= MAX_TIMEOUTS {
                break;
            }
        }
        let extra = format!(
            ", {answered} answered, {refused} refused{}",
            streak.stopped(made, self.options.inputs)
        );
        self.faults_check(
            Role::Tools,
            "calls with fitting arguments: no fault",
            made,
            &faults,
            &extra,
        );
        // Arguments that fail the schema: the host never sends them in a run, but a
        // function must refuse them (`err`), never trap.
        let spec = &specs[0];
        let (mut bad_faults, mut bad_answered) = (Vec::new(), 0);
        for bad in ["[]", "{\"surely_not_a_parameter\": []}", "\"text\""] {
            match session.invoke(&spec.name, bad).await {
                Ok(Ok(_)) => bad_answered += 1,
                Ok(Err(_)) => {}
                Err(f) => bad_faults.push(f),
            }
        }
        let (outcome, detail) = match (bad_faults.first(), bad_answered) {
            (Some(f), _) => (
                Verdict::Fail,
                format!("`{}` faulted on arguments that do not fit: {f}", spec.name),
            ),
            (None, 0) => (Verdict::Pass, format!("`{}` refused all 3", spec.name)),
            (None, n) => (
                Verdict::Warn,
                format!(
                    "`{}` answered {n} of 3 calls whose arguments do not fit its schema",
                    spec.name
                ),
            ),
        };
        self.check(role, "arguments that do not fit: refused", outcome, detail);
    }

    pub(super) async fn reward(&mut self, samples: &[Sample]) {
        let role = Some(Role::Reward);
        let config = self.options.config.clone();
        let mut scorer = match self.plugin.open_reward(&config).await {
            Ok(s) => s,
            Err(e) => return self.check(role, "opens", Verdict::Fail, format!("{e:#}")),
        };
        let (mut faults, mut guest_errors, mut problems, mut unstable) =
            (Vec::new(), Vec::new(), Vec::new(), 0);
        let (mut scored, mut made, mut streak) = (0, 0, Streak::default());
        for i in 0..self.options.inputs {
            let sample = &samples[i % samples.len()];
            let completion = self.rng.text(&[]);
            let trajectory = trajectory(sample, completion, &mut self.rng);
            made += 1;
            let result = self
                .timed("reward.score", async || scorer.score(&trajectory).await)
                .await;
            let stop = streak.push(self.saw(result.as_ref().err()));
            match result {
                Ok(components) => {
                    scored += 1;
                    if let Some(problem) = components_problem(&components) {
                        problems.push(problem);
                    }
                    if i % 8 == 0 && scorer.score(&trajectory).await.ok() != Some(components) {
                        unstable += 1;
                    }
                }
                Err(f) if f.kind == FaultKind::GuestError => guest_errors.push(f),
                Err(f) => faults.push(f),
            }
            if stop || self.timeouts >= MAX_TIMEOUTS {
                break;
            }
        }
        let extra = format!(
            ", {} guest errors{}",
            guest_errors.len(),
            streak.stopped(made, self.options.inputs)
        );
        let n = made;
        self.faults_check(Role::Reward, "score: no fault", n, &faults, &extra);
        let (outcome, detail) = if scored == 0 {
            let first = guest_errors
                .first()
                .map_or(String::new(), |f| format!(": {}", f.message));
            (
                Verdict::Fail,
                format!(
                    "no trajectory was scored{first}; pass --sample with samples this reward can score"
                ),
            )
        } else if let Some(first) = problems.first() {
            (
                Verdict::Fail,
                format!("{} of {scored}: {first}", problems.len()),
            )
        } else {
            (Verdict::Pass, format!("{scored} scored"))
        };
        self.check(role, "finite, named, distinct components", outcome, detail);
        let (outcome, detail) = if scored == 0 {
            (Verdict::Skip, "nothing was scored".to_string())
        } else if unstable == 0 {
            (Verdict::Pass, "scored twice, the same".to_string())
        } else {
            (
                Verdict::Warn,
                format!("{unstable} trajectories got other components the second time"),
            )
        };
        self.check(role, "deterministic", outcome, detail);
    }

    pub(super) async fn trigger(&mut self, samples: &[Sample]) {
        let role = Some(Role::Trigger);
        let (config, seed) = (self.options.config.clone(), self.options.seed);
        let mut session = match self.plugin.open_trigger(&config, &samples[0], seed).await {
            Ok(s) => s,
            Err(e) => return self.check(role, "opens", Verdict::Fail, format!("{e:#}")),
        };
        let patterns = session.stop_patterns().to_vec();
        self.check(
            role,
            "stop patterns",
            Verdict::Pass,
            format!("{patterns:?}"),
        );
        if patterns.is_empty() {
            let detail = "none: a trigger the host never fires (single-turn)".to_string();
            return self.check(role, "fire", Verdict::Pass, detail);
        }
        let limit = self.plugin.spec().limits.max_output_bytes;
        let n = self.options.inputs;
        // Text that does not end with a pattern: the host never fires on it, and the
        // plugin must not answer it either (it checks what it was given).
        let (mut answered, mut faults) = (Vec::new(), Vec::new());
        let (mut silent, mut made, mut streak) = (0, 0, Streak::default());
        for _ in 0..n / 2 {
            let mut text = self.rng.text(&patterns);
            while patterns.iter().any(|p| text.ends_with(p.as_str())) {
                text.push('.');
            }
            made += 1;
            let result = self
                .timed("trigger.fire", async || session.fire(&text).await)
                .await;
            let stop = streak.push(self.saw(result.as_ref().err()));
            match result {
                Ok(Some(_)) => answered.push(text),
                Ok(None) => silent += 1,
                Err(f) => faults.push(f),
            }
            if stop || self.timeouts >= MAX_TIMEOUTS {
                break;
            }
        }
        let first_half = streak.stopped(made, n / 2);
        let (outcome, detail) = match answered.first() {
            None if silent == 0 => (
                Verdict::Skip,
                format!("nothing to check: every call faulted{first_half}"),
            ),
            None => (Verdict::Pass, format!("{silent} texts{first_half}")),
            Some(first) => (
                Verdict::Fail,
                format!(
                    "answered {} of {} texts that end with no stop pattern, e.g. {:?}",
                    answered.len(),
                    n / 2,
                    clip(first)
                ),
            ),
        };
        self.check(role, "silent without a stop pattern", outcome, detail);
        // Text that ends with a pattern: any answer, bounded (the host refuses more than
        // its limit as bad output), and no fault; a fresh session now and then.
        let mut largest = 0;
        let mut fired = 0;
        // The same streak: a trigger that hung on the texts above hangs on these too.
        let mut made2 = 0;
        for i in 0..n - n / 2 {
            if self.timeouts >= MAX_TIMEOUTS || streak.stopped_now() {
                break;
            }
            made2 += 1;
            if i % 16 == 15 {
                let plugin = self.plugin;
                match self
                    .timed("trigger.open", async || {
                        plugin
                            .open_trigger(&config, &samples[i % samples.len()], seed)
                            .await
                    })
                    .await
                {
                    Ok(s) => session = s,
                    Err(e) => {
                        let f = as_fault(e);
                        streak.push(self.saw(Some(&f)));
                        faults.push(f);
                        continue;
                    }
                }
            }
            let text = self.rng.call_text(&patterns);
            let result = self
                .timed("trigger.fire", async || session.fire(&text).await)
                .await;
            streak.push(self.saw(result.as_ref().err()));
            match result {
                Ok(Some(out)) => {
                    fired += 1;
                    largest = largest.max(out.len());
                }
                Ok(None) => {}
                Err(f) => faults.push(f),
            }
        }
        let extra = format!(
            "; {fired} answered, the largest {largest} bytes (limit {limit}){}",
            streak.stopped(made + made2, n)
        );
        self.faults_check(
            Role::Trigger,
            "fire: no fault, bounded output",
            made + made2,
            &faults,
            &extra,
        );
    }

    pub(super) async fn environment(&mut self, samples: &[Sample]) {
        let (config, seed) = (self.options.config.clone(), self.options.seed);
        let (mut faults, mut problems) = (Vec::new(), Vec::new());
        let (mut steps, mut episodes, mut answered) = (0, 0, 0);
        let mut streak = Streak::default();
        while steps < self.options.inputs && !streak.stopped_now() && self.timeouts < MAX_TIMEOUTS {
            let sample = &samples[episodes % samples.len()];
            episodes += 1;
            let plugin = self.plugin;
            let mut episode = match self
                .timed("environment.open", async || {
                    plugin.open_environment(&config, sample, seed).await
                })
                .await
            {
                Ok(e) => e,
                Err(e) => {
                    let f = as_fault(e);
                    streak.push(self.saw(Some(&f)));
                    faults.push(f);
                    steps += 1;
                    continue;
                }
            };
            for _ in 0..8 {
                steps += 1;
                let turn = self.rng.text(&[]);
                let result = self
                    .timed("environment.step", async || episode.step(&turn).await)
                    .await;
                if streak.push(self.saw(result.as_ref().err())) || self.timeouts >= MAX_TIMEOUTS {
                    if let Err(f) = result {
                        faults.push(f);
                    }
                    break;
                }
                match result {
                    Ok(step) => {
                        answered += 1;
                        if let Some(m) = step
                            .messages
                            .iter()
                            .find(|m| m.role != "tool" && m.role != "user")
                        {
                            problems.push(format!("a message with role {:?}", m.role));
                        }
                        if step.reward.is_some_and(|r| !r.is_finite()) {
                            problems.push(format!("step reward {:?}", step.reward));
                        }
                        if step.done {
                            break;
                        }
                    }
                    Err(f) if f.kind == FaultKind::GuestError => break,
                    Err(f) => {
                        faults.push(f);
                        break;
                    }
                }
            }
        }
        let extra = format!(
            " in {episodes} episodes{}",
            streak.stopped(steps, self.options.inputs)
        );
        self.faults_check(Role::Environment, "step: no fault", steps, &faults, &extra);
        let (outcome, detail) = match problems.first() {
            None if answered == 0 => (
                Verdict::Skip,
                "nothing to check: no step answered".to_string(),
            ),
            None => (
                Verdict::Pass,
                "tool or user messages, finite rewards".into(),
            ),
            Some(first) => (
                Verdict::Fail,
                format!("{} steps gave {first}", problems.len()),
            ),
        };
        self.check(
            Some(Role::Environment),
            "steps are well formed",
            outcome,
            detail,
        );
    }
}
