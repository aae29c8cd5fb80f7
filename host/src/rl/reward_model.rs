//! `rlhost rm`: a Bradley–Terry reward model. The LoRA adapter and a scalar score head,
//! `score.weight: [1, hidden]` without bias, read at the last token of the conversation
//! after the final norm, as transformers' `AutoModelForSequenceClassification` does
//! (`Qwen2ForSequenceClassification` and its kin read the last token that is not padding;
//! rows here carry no padding). The loss is [`super::preference::bradley_terry`], with
//! TRL's margin and centring term.
//!
//! Saved as a PEFT adapter of `task_type = "SEQ_CLS"` with `modules_to_save = ["score"]`,
//! its head under `base_model.model.score.weight` in the adapter's safetensors: what TRL's
//! `RewardTrainer` with a PEFT config writes, so that transformers + PEFT load it
//! (`AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)` then
//! `PeftModel.from_pretrained`) and give the same scores.

use super::adapter_set::{AdapterSet, adapter_folder, check_base};
use super::dpo::{
    PairMetrics, PairRows, PairSchedule, Pass, StepRecord, Tally, evaluate_with, optimizer,
    take_step,
};
use super::optim::AdamW;
use super::packing;
use super::preference::bradley_terry;
use super::sft::{SftRow, batch, sized};
use crate::model::{Mode, Model, peft};
use anyhow::{Context, Result, bail};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use std::path::Path;

/// The head's tensor name, transformers' (`score = nn.Linear(hidden, num_labels, bias=False)`).
pub const SCORE: &str = "score.weight";
/// The head's file in a checkpoint folder.
pub const FILE: &str = "score.safetensors";

/// The score head.
pub struct ScoreHead {
    pub weight: Var,
}

impl ScoreHead {
    /// A head drawn as transformers initialises a new `score` layer: normal with std 0.02
    /// (`initializer_range`), seeded.
    pub fn new(model: &Model, seed: u64) -> Result<ScoreHead> {
        use rand::{RngExt, SeedableRng};
        let h = model.cfg.hidden_size;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5c0e);
        // Box–Muller.
        let w: Vec<f32> = (0..h)
            .map(|_| {
                let (u, v): (f64, f64) = (rng.random::<f64>().max(1e-300), rng.random());
                ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * 0.02) as f32
            })
            .collect();
        Ok(ScoreHead {
            weight: Var::from_tensor(&Tensor::from_vec(w, (1, h), model.device())?)?,
        })
    }

    /// The head saved in `dir` (a checkpoint's `score.safetensors`, or an `rm` adapter's
    /// `base_model.model.score.weight`).
    pub fn load(model: &Model, dir: &Path) -> Result<ScoreHead> {
        let (path, key) = if dir.join(FILE).is_file() {
            (dir.join(FILE), SCORE.to_string())
        } else {
            (
                dir.join(peft::WEIGHTS_FILE),
                format!("{}{SCORE}", peft::KEY_PREFIX),
            )
        };
        let mut tensors = candle_core::safetensors::load(&path, model.device())
            .with_context(|| format!("cannot read {}", path.display()))?;
        let w = tensors.remove(&key).with_context(|| {
            format!(
                "{} has no `{key}`: not a reward model's score head (rlhost rm writes one)",
                path.display()
            )
        })?;
        ScoreHead::from_weight(model, w, &format!("{}: `{key}`", path.display()))
    }

    /// A head of weight `w` (`[1, hidden]`), `origin` naming where it came from.
    fn from_weight(model: &Model, w: Tensor, origin: &str) -> Result<ScoreHead> {
        let h = model.cfg.hidden_size;
        if w.dims() != [1, h] {
            bail!(
                "{origin} has shape {:?}; the model's hidden size asks for [1, {h}]",
                w.dims()
            );
        }
        Ok(ScoreHead {
            weight: Var::from_tensor(&w.to_dtype(DType::F32)?)?,
        })
    }

    /// The score of each row: the head on the final hidden state of its last token, `[N]`
    /// in f32, in forwards of up to `budget` tokens ([`packing::micro_batches`]; a
    /// training step's rows go in one, `usize::MAX`), `mode`: with the adapter's gradients
    /// or not.
    pub fn scores(
        &self,
        model: &Model,
        rows: &[SftRow],
        pack: bool,
        mode: Mode,
        budget: usize,
    ) -> Result<Tensor> {
        // A batch's inputs are each row's tokens but the last (whose next token is the
        // target); a score reads the last one, so each row goes in with one more token, a
        // target nobody reads, and its slot's last input is its own last token.
        let rows: Vec<SftRow> = rows
            .iter()
            .map(|r| SftRow {
                tokens: r.tokens.iter().copied().chain([0]).collect(),
                loss_mask: r.loss_mask.iter().copied().chain([0]).collect(),
            })
            .collect();
        // Each forward's last hidden states in its slots' order, then back in rows' order.
        let (mut parts, mut order) = (Vec::new(), Vec::with_capacity(rows.len()));
        for layout in packing::micro_batches(&sized(&rows)?, pack, budget) {
            let b = batch(&rows, &layout, model.device())?;
            let hidden = model.forward_batch(&b.input, &b.attn, &b.pos, mode)?;
            let (_, _, h) = hidden.dims3()?;
            let flat = hidden.to_dtype(DType::F32)?.reshape(((), h))?;
            let idx: Vec<u32> = layout
                .slots
                .iter()
                .map(|s| (s.lane * layout.width + s.start + s.len - 1) as u32)
                .collect();
            order.extend(layout.slots.iter().map(|s| s.row));
            let n = idx.len();
            parts.push(flat.index_select(&Tensor::from_vec(idx, n, model.device())?, 0)?);
        }
        let mut back = vec![0u32; rows.len()];
        for (k, &row) in order.iter().enumerate() {
            back[row] = k as u32;
        }
        let last = Tensor::cat(&parts, 0)?
            .index_select(&Tensor::from_vec(back, rows.len(), model.device())?, 0)?;
        Ok(last.matmul(&self.weight.as_tensor().t()?)?.squeeze(1)?)
    }
}

impl super::checkpoint::Head for ScoreHead {
    fn save(&self, dir: &Path) -> Result<()> {
        let path = dir.join(FILE);
        let t =
            std::collections::HashMap::from([(SCORE.to_string(), self.weight.as_tensor().clone())]);
        candle_core::safetensors::save(&t, &path)
            .map_err(|e| peft::innermost(&e))
            .with_context(|| format!("writing {}", path.display()))
    }
}

/// The Bradley–Terry loss of `pairs` (chosen rows first, then rejected, one forward), its
/// mean scaled by `share` (the micro-batch's part of the step), and what it adds to
/// `tally`; with `grad`, the gradients of the adapter and the head.
fn forward_pairs(
    model: &Model,
    head: &ScoreHead,
    pairs: &[&PairRows],
    center: Option<f64>,
    Pass { pack, grad, scale }: Pass,
    tally: &mut Tally,
) -> Result<Option<GradStore>> {
    let n = pairs.len();
    let rows: Vec<SftRow> = pairs
        .iter()
        .map(|p| p.chosen.clone())
        .chain(pairs.iter().map(|p| p.rejected.clone()))
        .collect();
    let mode = if grad { Mode::TRAIN } else { Mode::INFERENCE };
    let scores = head.scores(model, &rows, pack, mode, usize::MAX)?;
    let (chosen, rejected) = (scores.narrow(0, 0, n)?, scores.narrow(0, n, n)?);
    let margins: Option<Vec<f32>> = pairs.iter().map(|p| p.margin).collect();
    if margins.is_none() && pairs.iter().any(|p| p.margin.is_some()) {
        bail!("some pairs have a margin and some do not");
    }
    let margin = margins
        .map(|m| Tensor::from_vec(m, n, model.device()))
        .transpose()?;
    // The loss is a mean over the micro-batch's n pairs: times n · scale it is their share
    // of the step's mean.
    let loss = (bradley_terry(&chosen, &rejected, margin.as_ref(), center)? * (n as f64 * scale))?;
    tally.loss += loss.to_scalar::<f32>()? as f64;
    tally
        .chosen_rewards
        .extend(chosen.detach().to_vec1::<f32>()?);
    tally
        .rejected_rewards
        .extend(rejected.detach().to_vec1::<f32>()?);
    Ok(if grad { Some(loss.backward()?) } else { None })
}

/// The mean loss, accuracy (chosen scored strictly higher) and mean margin of `pairs`,
/// no gradients.
pub fn evaluate(
    model: &Model,
    head: &ScoreHead,
    pairs: &[PairRows],
    center: Option<f64>,
    schedule: &PairSchedule,
) -> Result<PairMetrics> {
    evaluate_with(pairs, schedule, |mb, pass, tally| {
        forward_pairs(model, head, mb, center, pass, tally).map(|_| ())
    })
}

/// The trainer: the model with its adapter, the head, the optimizer over both and where
/// it stands.
pub struct Rm<'a> {
    pub model: &'a Model,
    pub head: ScoreHead,
    pub opt: AdamW,
    /// TRL's `center_rewards_coefficient`.
    pub center: Option<f64>,
    pub schedule: PairSchedule,
    /// Steps done.
    pub step: u64,
}

impl<'a> Rm<'a> {
    pub fn new(
        model: &'a Model,
        head: ScoreHead,
        center: Option<f64>,
        schedule: PairSchedule,
    ) -> Result<Self> {
        let mut params = model.lora_vars();
        if params.is_empty() {
            bail!("the model has no adapter to train: attach one first");
        }
        params.push(("score.weight".into(), head.weight.clone()));
        Ok(Rm {
            model,
            opt: optimizer(params, &schedule)?,
            head,
            center,
            schedule,
            step: 0,
        })
    }

    /// Takes the next step on `pairs` and returns its record (without evaluation).
    pub fn step(&mut self, pairs: &[PairRows]) -> Result<StepRecord> {
        let (model, head, center) = (self.model, &self.head, self.center);
        let pack = self.schedule.pack_sequences;
        take_step(
            &mut self.opt,
            &mut self.step,
            &self.schedule,
            pairs,
            |mb, scale, tally| {
                let pass = Pass {
                    pack,
                    grad: true,
                    scale,
                };
                let grads = forward_pairs(model, head, mb, center, pass, tally)?;
                Ok(grads.expect("a training pass returns gradients"))
            },
        )
    }

    /// Writes the reward model to `dir`: the adapter in PEFT's format for sequence
    /// classification, the head among its tensors (see the module's header).
    pub fn save(&self, dir: &Path, base_model: Option<&str>) -> Result<()> {
        peft::save_adapter_with_head(
            self.model,
            dir,
            base_model,
            (SCORE, self.head.weight.as_tensor()),
        )
    }
}

/// A reward model `rlhost rm` trained, scoring another run's trajectories
/// (`[[rewards]] model = ...`): its adapter as a set the forward reads in place of the
/// run's own adapter, and its head. The run's model is the base the reward model was
/// trained on, so no second copy of the weights is made; each projection the run adapts
/// reads the reward model's pair, or a zero one where the reward model has none.
pub struct Scorer {
    name: String,
    adapter: AdapterSet,
    head: ScoreHead,
    /// Most tokens a forward takes (`train.micro_batch_tokens`).
    micro_batch_tokens: usize,
}

impl Scorer {
    /// The reward model in `dir` (the folder `rlhost rm` wrote, or its `adapter/`), for
    /// `model` loaded from `base`: the adapter must have been trained on that base (as its
    /// config records it) and carry a score head.
    pub fn load(
        model: &Model,
        base: &Path,
        dir: &Path,
        micro_batch_tokens: usize,
    ) -> Result<Scorer> {
        let folder = adapter_folder(dir).with_context(|| {
                format!(
                    "{} holds no reward model: neither it nor its adapter/ has {} (give the folder `rlhost rm` wrote)",
                    dir.display(),
                    peft::CONFIG_FILE
                )
            })?;
        check_base(&folder, base, "a reward model")?;
        let (read, w) = peft::read_pairs_with_saved(model, &folder, "score")?;
        let head = ScoreHead::from_weight(
            model,
            w,
            &format!("{}: `{}{SCORE}`", folder.display(), peft::KEY_PREFIX),
        )?;
        Ok(Scorer {
            name: dir.display().to_string(),
            adapter: AdapterSet::new(read),
            head,
            micro_batch_tokens: micro_batch_tokens.max(1),
        })
    }
}

impl crate::rollout::reward::ModelReward for Scorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, model: &Model, sequences: &[&[u32]]) -> Result<Vec<f64>> {
        let set = self.adapter.snapshot(model)?;
        let mode = Mode {
            adapter: Some(&set),
            ..Mode::INFERENCE
        };
        if sequences.iter().any(|s| s.is_empty()) {
            bail!("an empty trajectory has no last token to score");
        }
        let rows: Vec<SftRow> = sequences
            .iter()
            .map(|s| SftRow {
                tokens: s.to_vec(),
                loss_mask: vec![0; s.len()],
            })
            .collect();
        let scores = self
            .head
            .scores(model, &rows, true, mode, self.micro_batch_tokens)?;
        Ok(scores
            .to_vec1::<f32>()?
            .into_iter()
            .map(f64::from)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{LanguageModel, LoraConfig, Placement, fixtures};

    /// A row's score reads its own last token, whatever else is in the batch, padded or
    /// packed, and equals the head on that token's final hidden state from a forward of
    /// the row alone.
    #[test]
    fn a_score_is_the_heads_reading_of_the_rows_last_token() {
        let lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        let head = ScoreHead::new(&lm.model, 4).unwrap();
        let rows = crate::rl::dpo::tests::three_rows(&lm);
        let by_hand: Vec<f32> = rows
            .iter()
            .map(|r| {
                let n = r.tokens.len();
                let ids = Tensor::from_vec(r.tokens.clone(), (1, n), lm.model.device()).unwrap();
                let attn = Tensor::ones((1, n), DType::U32, lm.model.device()).unwrap();
                let pos = Tensor::arange(0u32, n as u32, lm.model.device())
                    .unwrap()
                    .reshape((1, n))
                    .unwrap();
                let hidden = lm
                    .model
                    .forward_batch(&ids, &attn, &pos, Mode::INFERENCE)
                    .unwrap();
                let last = hidden
                    .narrow(1, n - 1, 1)
                    .unwrap()
                    .reshape((1, ()))
                    .unwrap();
                let w = head.weight.as_tensor().t().unwrap();
                last.matmul(&w)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()[0]
            })
            .collect();
        for pack in [false, true] {
            let got = head
                .scores(&lm.model, &rows, pack, Mode::INFERENCE, usize::MAX)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            for (a, b) in by_hand.iter().zip(&got) {
                assert!((a - b).abs() < 1e-5, "pack {pack}: {a} vs {b}");
            }
        }
    }

    /// An empty folder of this test process's own.
    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("rlhost-rm-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Every adapter's `B` set to `value`, so that it changes the model's output.
    fn set_b(model: &Model, value: f64) {
        for (_, _, lin) in model.projections() {
            if let Some(l) = &lin.lora {
                let b = (Tensor::ones(l.lora_b.dims(), DType::F32, model.device()).unwrap()
                    * value)
                    .unwrap();
                l.lora_b.set(&b).unwrap();
            }
        }
    }

    /// A sequence of the fixture model's vocabulary, `n` tokens from `seed`.
    fn sequence(n: usize, seed: u32) -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i * 37 + seed * 11) % 250 + 3)
            .collect()
    }

    /// Issue 65: `[[rewards]] model` scores another run's trajectories as the reward model
    /// scored them where it was trained, whatever the run's own adapter holds (a set of its
    /// own, not the live tensors) and however the sequences split into forwards.
    #[test]
    fn a_reward_model_scores_another_runs_trajectories_as_it_was_trained_to() {
        use crate::rollout::reward::ModelReward;
        let base = fixtures::model_dir("qwen2");
        // Where the reward model was trained: two projections adapted, rank 3, scaling 1.
        let mut trained = LanguageModel::open(&base, &Placement::CPU).unwrap();
        let rm_lora = LoraConfig {
            r: 3,
            alpha: 3.0,
            target_modules: vec!["q_proj".into(), "v_proj".into()],
            ..LoraConfig::default()
        };
        trained.model.attach_lora(&rm_lora, 2).unwrap();
        set_b(&trained.model, 0.05);
        let head = ScoreHead::new(&trained.model, 3).unwrap();
        let dir = scratch("scores");
        peft::save_adapter_with_head(
            &trained.model,
            &dir.join("adapter"),
            Some(&base.display().to_string()),
            (SCORE, head.weight.as_tensor()),
        )
        .unwrap();
        let seqs: Vec<Vec<u32>> = [(9, 1), (17, 2), (4, 3), (12, 4)]
            .iter()
            .map(|&(n, s)| sequence(n, s))
            .collect();
        let rows: Vec<SftRow> = seqs
            .iter()
            .map(|t| SftRow {
                tokens: t.clone(),
                loss_mask: vec![0; t.len()],
            })
            .collect();
        let want = head
            .scores(&trained.model, &rows, false, Mode::INFERENCE, usize::MAX)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();

        // The run's own adapter: another rank, only some projections, far from zero, so a
        // forward that read it instead of the reward model's would score otherwise.
        let targets = |names: &[&str]| LoraConfig {
            r: 2,
            alpha: 4.0,
            target_modules: names.iter().map(|s| s.to_string()).collect(),
            ..LoraConfig::default()
        };
        let mut run = LanguageModel::open(&base, &Placement::CPU).unwrap();
        run.model
            .attach_lora(&targets(&crate::model::lora::TARGETS), 5)
            .unwrap();
        set_b(&run.model, 0.5);
        let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        for budget in [4096, 20] {
            let scorer = Scorer::load(&run.model, &base, &dir, budget).unwrap();
            let got = scorer.score(&run.model, &refs).unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert!((*g as f32 - w).abs() < 1e-5, "budget {budget}: {g} vs {w}");
            }
        }

        // A run that adapts fewer projections than the reward model cannot apply it.
        let mut narrow = LanguageModel::open(&base, &Placement::CPU).unwrap();
        narrow.model.attach_lora(&targets(&["q_proj"]), 5).unwrap();
        let scorer = Scorer::load(&narrow.model, &base, &dir, 4096).unwrap();
        let err = format!("{:#}", scorer.score(&narrow.model, &refs).unwrap_err());
        assert!(err.contains("target_modules"), "{err}");
    }

    /// Issue 65: a folder that is not a reward model, or one trained on another base, is
    /// refused when the run opens it, in one line that says what is wrong.
    #[test]
    fn what_is_not_a_reward_model_for_this_base_is_refused() {
        let base = fixtures::model_dir("qwen2");
        let lm = LanguageModel::open(&base, &Placement::CPU).unwrap();
        let err = |dir: &Path| {
            format!(
                "{:#}",
                Scorer::load(&lm.model, &base, dir, 4096).err().unwrap()
            )
        };
        // An adapter without a score head.
        let e = err(&base.join("adapter"));
        assert!(e.contains("no `score` head"), "{e}");
        // No adapter at all.
        let empty = scratch("empty");
        let e = err(&empty);
        assert!(e.contains("holds no reward model"), "{e}");
        // Trained on another base: the folder its config records exists and is not this one.
        let mut other = LanguageModel::open(&base, &Placement::CPU).unwrap();
        peft::load_adapter(&mut other.model, &base.join("adapter")).unwrap();
        let head = ScoreHead::new(&other.model, 3).unwrap();
        let dir = scratch("other-base");
        peft::save_adapter_with_head(
            &other.model,
            &dir,
            Some(&empty.display().to_string()),
            (SCORE, head.weight.as_tensor()),
        )
        .unwrap();
        let e = err(&dir);
        assert!(
            e.contains("reads its adapter over the base it was trained on"),
            "{e}"
        );
    }

    /// Issue 65: scores, the loss and the gradients of the adapter and the head against
    /// TRL's `RewardTrainer` on transformers' `AutoModelForSequenceClassification` of the
    /// fixture (`scripts/preference_reference.py`: the same adapter, a fixed head, margins
    /// and the centring term).
    #[test]
    fn the_reward_model_matches_trls_reward_trainer() {
        let fixtures = fixtures::model_dir("qwen2").join("../..");
        let meta: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixtures.join("preference_reference.json")).unwrap(),
        )
        .unwrap();
        let want = candle_core::safetensors::load(
            fixtures.join("preference_reference.safetensors"),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let mut lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        peft::load_adapter(&mut lm.model, &fixtures::model_dir("qwen2").join("adapter")).unwrap();
        let head = ScoreHead {
            weight: Var::from_tensor(&want["rm/score.weight.value"]).unwrap(),
        };
        let case = &meta["cases"]["rm"];
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let margins: Vec<f32> = case["margins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_f64().unwrap() as f32)
            .collect();
        let rows: Vec<PairRows> = meta["pairs"]
            .as_array()
            .unwrap()
            .iter()
            .zip(&margins)
            .map(|(p, &m)| {
                let side = |key: &str| {
                    let tokens: Vec<u32> = ids(&p["prompt_ids"])
                        .into_iter()
                        .chain(ids(&p[key]))
                        .collect();
                    SftRow {
                        loss_mask: vec![1; tokens.len()],
                        tokens,
                    }
                };
                PairRows {
                    chosen: side("chosen_ids"),
                    rejected: side("rejected_ids"),
                    margin: Some(m),
                }
            })
            .collect();
        let all: Vec<SftRow> = rows
            .iter()
            .map(|r| r.chosen.clone())
            .chain(rows.iter().map(|r| r.rejected.clone()))
            .collect();
        let scores = head
            .scores(&lm.model, &all, false, Mode::INFERENCE, usize::MAX)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for (got, want) in scores.iter().zip(case["scores"].as_array().unwrap()) {
            let want = want.as_f64().unwrap() as f32;
            assert!(
                (got - want).abs() < 1e-4,
                "score {got} vs transformers {want}"
            );
        }
        let refs: Vec<&PairRows> = rows.iter().collect();
        let mut tally = Tally::default();
        let center = case["center_rewards_coefficient"].as_f64();
        let pass = Pass {
            pack: false,
            grad: true,
            scale: 1.0 / rows.len() as f64,
        };
        let grads = forward_pairs(&lm.model, &head, &refs, center, pass, &mut tally)
            .unwrap()
            .unwrap();
        let loss = case["loss"].as_f64().unwrap();
        assert!(
            (tally.loss - loss).abs() < 1e-4,
            "loss {} vs TRL {loss}",
            tally.loss
        );
        let mut vars = lm.model.lora_vars();
        vars.push(("score.weight".into(), head.weight.clone()));
        for (name, var) in vars {
            let want = &want[&format!("rm/{name}")];
            let got = grads.get(var.as_tensor()).unwrap();
            let (diff, scale) = (fixtures::max_diff(got, want), fixtures::max_abs(want));
            assert!(
                diff <= 1e-4 * scale.max(1e-3),
                "{name}: grad off by {diff} (max {scale})"
            );
        }
    }
}
