//! On-policy distillation (`[distill]`): the student (the run's policy) samples as in any
//! run, a teacher reads each trajectory, and each token the student sampled gets
//!
//!   A_t = A_task + (−α · (log π_student(x_t) − log π_teacher(x_t)))
//!
//! the per-token reverse KL as a reward, added after the task's group advantage (zero
//! without `task_reward`): tinker-cookbook's on-policy distillation
//! (`incorporate_kl_penalty` with no discounting, reverse_kl = sampled_logprobs −
//! teacher_logprobs), the reverse-KL case of GKD (Agarwal et al., 2024). log π_student is
//! the sampler's log-prob as it recorded it; the teacher's is read at temperature 1, so
//! the distribution the student really samples from is pulled toward the teacher's own.
//!
//! The teacher is the run's own base with its adapter off, another adapter over the same
//! weights (no second copy of the model), or a second model with the same tokenizer on the
//! run's device.

use super::adapter_set::{AdapterSet, adapter_folder, check_base};
use super::update::{Row, UpdateConfig, token_logps};
use crate::model::{LanguageModel, Mode, Model, Placement, peft};
use anyhow::{Context, Result, bail};
use std::path::Path;

/// The model that scores the student's tokens.
pub enum Teacher {
    /// The run's base model with the adapter off (`model.path` itself, or `builtin:` of
    /// the run's own built-in model): a run kept close to where it started.
    Base,
    /// An adapter trained on the run's base, read in place of the run's own.
    Adapter(AdapterSet),
    /// Another model with the same tokenizer, on the run's device.
    Model(Box<LanguageModel>),
}

/// A step's distillation terms.
pub struct Distilled {
    /// Each row's per-token advantage terms, `tokens − 1` long, zero off sampled tokens.
    pub per_row: Vec<Vec<f32>>,
    /// The mean per-token reverse-KL estimate log π_student − log π_teacher over the
    /// sampled tokens (k1: unbiased for KL(π_student ‖ π_teacher) on the student's own
    /// samples).
    pub reverse_kl: f64,
}

/// A_t's teacher term: −α · (log π_student(x_t) − log π_teacher(x_t)).
pub fn reverse_kl_advantage(student_logp: f32, teacher_logp: f32, coef: f64) -> f32 {
    (-coef * (f64::from(student_logp) - f64::from(teacher_logp))) as f32
}

impl Teacher {
    /// The teacher `spec` (`[distill] teacher`) names, resolved to `path` (the config's
    /// base folder joined), for the student `student` loaded from `base` (`model_spec` is
    /// the config's `model.path`): a run folder (its newest checkpoint), a checkpoint or
    /// adapter folder trained on `base`, a model folder, or `base` itself (the run's own
    /// model as the config names it: a `builtin:` one is checked by `config/`).
    pub fn open(
        spec: &str,
        path: &Path,
        student: &LanguageModel,
        base: &Path,
        model_spec: &str,
        at: &Placement,
    ) -> Result<Teacher> {
        if spec == model_spec {
            return Ok(Teacher::Base);
        }
        if !path.exists() {
            bail!(
                "{} does not exist: give a run folder (its newest checkpoint teaches), a checkpoint or adapter folder, or a model folder",
                path.display()
            );
        }
        if same_folder(path, base) {
            return Ok(Teacher::Base);
        }
        let run_checkpoint = path
            .join("checkpoints")
            .is_dir()
            .then(|| super::checkpoint::resolve(path, "latest"))
            .transpose()
            .with_context(|| format!("{} is a run folder", path.display()))?;
        let folder = match run_checkpoint {
            Some(r) => {
                if let Some(w) = r.warning {
                    tracing::warn!("[distill] teacher: {w}");
                }
                Some(r.dir)
            }
            None => adapter_folder(path),
        };
        if let Some(folder) = folder {
            check_base(&folder, base, "a teacher adapter")?;
            let read = peft::read_pairs(&student.model, &folder)?;
            if read.head.is_some() {
                bail!(
                    "{}: the adapter trains the output head; a teacher adapter adapts the projections only",
                    folder.display()
                );
            }
            let set = AdapterSet::new(read);
            // Refused now rather than at the first step: the run must adapt what it adapts.
            if student.model.lora.is_some() {
                set.snapshot(&student.model)
                    .with_context(|| format!("{}", folder.display()))?;
            }
            return Ok(Teacher::Adapter(set));
        }
        if !path.join("config.json").is_file() {
            bail!(
                "{} holds no teacher: no checkpoints/, {}, adapter/ or config.json; give a run folder, a checkpoint or adapter folder, or a model folder",
                path.display(),
                peft::CONFIG_FILE
            );
        }
        let lm = LanguageModel::open(path, at)?;
        same_vocabulary(student, &lm)?;
        Ok(Teacher::Model(Box::new(lm)))
    }

    /// The teacher's own model when it has one (its tokenizer is checked against the
    /// student's renderings).
    pub fn own_model(&self) -> Option<&LanguageModel> {
        match self {
            Teacher::Model(lm) => Some(lm),
            _ => None,
        }
    }

    /// The teacher's log-prob of each row's targets, `tokens − 1` long.
    fn logps(&self, student: &Model, rows: &[Row], cfg: &UpdateConfig) -> Result<Vec<Vec<f32>>> {
        match self {
            Teacher::Base => token_logps(student, rows, Mode::BASE, 1.0, cfg),
            Teacher::Adapter(set) => {
                let snapshot = set.snapshot(student)?;
                let mode = Mode {
                    adapter: Some(&snapshot),
                    ..Mode::INFERENCE
                };
                token_logps(student, rows, mode, 1.0, cfg)
            }
            Teacher::Model(lm) => token_logps(&lm.model, rows, Mode::INFERENCE, 1.0, cfg),
        }
    }

    /// Each row's per-token teacher terms −α·(log π_student − log π_teacher) on the
    /// tokens the student sampled, and the mean reverse KL.
    pub fn distill(
        &self,
        student: &Model,
        rows: &[Row],
        cfg: &UpdateConfig,
        coef: f64,
    ) -> Result<Distilled> {
        let teacher = self
            .logps(student, rows, cfg)
            .context("[distill] teacher")?;
        let (mut sum, mut count) = (0f64, 0usize);
        let mut per_row = Vec::with_capacity(rows.len());
        for (row, t) in rows.iter().zip(&teacher) {
            let tr = row.trajectory;
            let mut adv = vec![0f32; t.len()];
            for (c, lp) in tr.logps.iter().enumerate() {
                let Some(student_lp) = lp else { continue };
                // Target k is token k + 1: the c-th sampled token sits at prompt_len + c.
                let k = tr.prompt_len + c - 1;
                if !t[k].is_finite() {
                    bail!(
                        "[distill] teacher: a non-finite log-prob ({}) of a sampled token",
                        t[k]
                    );
                }
                adv[k] = reverse_kl_advantage(*student_lp, t[k], coef);
                sum += f64::from(*student_lp) - f64::from(t[k]);
                count += 1;
            }
            per_row.push(adv);
        }
        Ok(Distilled {
            per_row,
            reverse_kl: sum / count.max(1) as f64,
        })
    }
}

fn same_folder(a: &Path, b: &Path) -> bool {
    matches!((std::fs::canonicalize(a), std::fs::canonicalize(b)), (Ok(x), Ok(y)) if x == y)
}

/// The teacher reads the student's ids as they are, so both tokenizers must map every id
/// to the same token; the first id where they differ is named.
pub fn same_vocabulary(student: &LanguageModel, teacher: &LanguageModel) -> Result<()> {
    let (s, t) = (&student.tokenizer, &teacher.tokenizer);
    if s.vocab_size() != t.vocab_size() {
        bail!(
            "its tokenizer has {} tokens and the run's has {}: the teacher must read the student's ids as the same tokens",
            t.vocab_size(),
            s.vocab_size()
        );
    }
    for id in 0..s.vocab_size() as u32 {
        let (a, b) = (s.id_to_token(id), t.id_to_token(id));
        if a != b {
            bail!(
                "its tokenizer differs from the run's at id {id}: the run's is {:?}, the teacher's {:?}",
                a.unwrap_or_default(),
                b.unwrap_or_default()
            );
        }
    }
    Ok(())
}

/// The ids of one conversation as the student's chat template and the teacher's render
/// it must be equal; the first token where they part is named, with both sides' text.
pub fn same_rendering(
    what: &str,
    student: &LanguageModel,
    ids: &[u32],
    teacher_ids: &[u32],
) -> Result<()> {
    if ids == teacher_ids {
        return Ok(());
    }
    let at = ids
        .iter()
        .zip(teacher_ids)
        .position(|(a, b)| a != b)
        .unwrap_or(ids.len().min(teacher_ids.len()));
    let show = |v: &[u32]| -> String {
        let end = (at + 4).min(v.len());
        student
            .tokenizer
            .decode(&v[at.min(end)..end], false)
            .unwrap_or_default()
    };
    bail!(
        "its chat template renders {what} differently from the run's: they part at token {at}, where the run's has {:?} and the teacher's {:?}",
        show(ids),
        show(teacher_ids)
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{LoraConfig, fixtures};
    use crate::rollout::Trajectory;

    /// The teacher term is tinker-cookbook's: advantage −α·reverse_kl with
    /// reverse_kl = sampled_logprobs − teacher_logprobs.
    #[test]
    fn the_teacher_term_is_minus_alpha_times_the_reverse_kl() {
        assert!((reverse_kl_advantage(-2.0, -0.5, 1.0) - 1.5).abs() < 1e-6);
        assert!((reverse_kl_advantage(-0.1, -3.0, 0.5) - -1.45).abs() < 1e-6);
        assert_eq!(reverse_kl_advantage(-1.0, -1.0, 2.0), 0.0);
    }

    fn trajectory(prompt: &[u32], reply: &[u32], student: &[f32]) -> Trajectory {
        let logps = student.iter().map(|&l| Some(l)).collect();
        Trajectory::sampled([prompt, reply].concat(), prompt.len(), logps)
    }

    /// The terms sit on the sampled tokens only, each −α·(student − teacher) with the
    /// teacher's log-prob of that token from a forward of the teacher alone; the base
    /// teacher is the model with its adapter off, an adapter teacher its own pairs.
    #[test]
    fn each_sampled_token_gets_the_teachers_term() {
        let base = fixtures::model_dir("qwen2");
        let mut lm = LanguageModel::open(&base, &Placement::CPU).unwrap();
        let cfg_lora = LoraConfig::default();
        lm.model.attach_lora(&cfg_lora, 3).unwrap();
        let prompt = [5u32, 6, 7, 8];
        let reply = [9u32, 10, 11];
        let student = [-1.0f32, -2.0, -0.5];
        let t = trajectory(&prompt, &reply, &student);
        let rows = [Row {
            trajectory: &t,
            advantage: 0.0,
            token_advantages: &[],
            stale: false,
            trained_from: 0,
        }];
        let cfg = crate::rl::update::tests::cfg(4096);
        let teacher_lp = token_logps(&lm.model, &rows, Mode::BASE, 1.0, &cfg).unwrap();
        let d = Teacher::Base.distill(&lm.model, &rows, &cfg, 0.5).unwrap();
        let adv = &d.per_row[0];
        assert_eq!(adv.len(), t.tokens.len() - 1);
        let mut kl = 0.0;
        for k in 0..adv.len() {
            if k + 1 < prompt.len() {
                assert_eq!(adv[k], 0.0, "prompt target {k}");
            } else {
                let c = k + 1 - prompt.len();
                let want = -0.5 * (student[c] - teacher_lp[0][k]);
                assert!((adv[k] - want).abs() < 1e-6, "{k}: {} vs {want}", adv[k]);
                kl += (student[c] - teacher_lp[0][k]) as f64;
            }
        }
        assert!((d.reverse_kl - kl / 3.0).abs() < 1e-5);
        // The fixture's adapter as a teacher reads its own pairs: not the base's log-probs.
        let set = AdapterSet::new(peft::read_pairs(&lm.model, &base.join("adapter")).unwrap());
        let with_adapter = Teacher::Adapter(set);
        let mut loaded = LanguageModel::open(&base, &Placement::CPU).unwrap();
        peft::load_adapter(&mut loaded.model, &base.join("adapter")).unwrap();
        let direct = token_logps(&loaded.model, &rows, Mode::INFERENCE, 1.0, &cfg).unwrap();
        let via_set = with_adapter.logps(&lm.model, &rows, &cfg).unwrap();
        for (a, b) in direct[0].iter().zip(&via_set[0]) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        assert!(
            direct[0]
                .iter()
                .zip(&teacher_lp[0])
                .any(|(a, b)| (a - b).abs() > 1e-4)
        );
    }

    /// A copy of the fixture model whose tokenizer swaps the ids of two tokens
    /// (`sul` is 300 and `calc` 302 in the fixture's).
    fn swapped_tokenizer(name: &str) -> std::path::PathBuf {
        let from = fixtures::model_dir("qwen2");
        let to = std::env::temp_dir().join(format!("rlhost-distill-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&to);
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(&from).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_file() {
                std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
            }
        }
        let mut t: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(to.join("tokenizer.json")).unwrap())
                .unwrap();
        let vocab = &mut t["model"]["vocab"];
        assert_eq!(
            (vocab["sul"].as_u64(), vocab["calc"].as_u64()),
            (Some(300), Some(302))
        );
        vocab["sul"] = 302.into();
        vocab["calc"] = 300.into();
        std::fs::write(to.join("tokenizer.json"), t.to_string()).unwrap();
        to
    }

    /// A teacher whose tokenizer maps an id to another token is named at that id, and a
    /// rendering that parts from the run's at the token where it does.
    #[test]
    fn a_teacher_with_another_vocabulary_is_named() {
        let qwen = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        let llama = LanguageModel::open(&fixtures::model_dir("llama"), &Placement::CPU).unwrap();
        same_vocabulary(&qwen, &llama).unwrap();
        let other = LanguageModel::open(&swapped_tokenizer("vocab"), &Placement::CPU).unwrap();
        let e = same_vocabulary(&qwen, &other).unwrap_err().to_string();
        assert!(
            e.contains("at id 300") && e.contains("\"sul\"") && e.contains("\"calc\""),
            "{e}"
        );
        let e = same_rendering("row 1", &qwen, &[1, 2, 3, 4], &[1, 2, 5, 4])
            .unwrap_err()
            .to_string();
        assert!(e.contains("part at token 2"), "{e}");
    }
}
