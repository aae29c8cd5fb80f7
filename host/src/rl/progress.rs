//! The trainer's progress on a terminal: an indicatif bar over steps (reward, loss, ETA),
//! one counting the batch's finished rollouts (with what the trainer is doing) and one the
//! update's micro-batches; one line per step otherwise (logs and CI keep a readable
//! record).

use crate::step::StepMetrics;

pub struct Progress {
    /// Steps, the batch's rollouts, the update's micro-batches.
    bars: Option<[indicatif::ProgressBar; 3]>,
    quiet: bool,
}

impl Progress {
    pub fn new(done: u64, total: u64, quiet: bool) -> Progress {
        let bars = crate::progress::enabled(quiet).then(|| {
            let multi = indicatif::MultiProgress::new();
            let steps = multi.add(crate::progress::bar(
                total,
                "train   {bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
            ));
            steps.set_position(done);
            let rollout = multi.add(crate::progress::bar(
                0,
                "rollout {bar:30} {pos}/{len} trajectories  {msg}",
            ));
            let update = multi.add(crate::progress::bar(
                0,
                "update  {bar:30} {pos}/{len} micro-batches",
            ));
            [steps, rollout, update]
        });
        Progress { bars, quiet }
    }

    /// The bar the rollout engine advances, when there is a terminal.
    pub fn rollout_bar(&self) -> Option<indicatif::ProgressBar> {
        self.bars.as_ref().map(|[_, r, _]| r.clone())
    }

    /// The bar the update advances, when there is a terminal.
    pub fn update_bar(&self) -> Option<indicatif::ProgressBar> {
        self.bars.as_ref().map(|[_, _, u]| u.clone())
    }

    pub fn phase(&self, what: &str) {
        if let Some([_, rollout, _]) = &self.bars {
            rollout.set_message(format!("(trainer: {what})"));
        }
    }

    pub fn step(&self, m: &StepMetrics, total: u64) {
        let line = format!(
            "reward {:.3}{}  loss {:.4}  kl {:.4}{}  len {:.1}  tools {:.2}  {:.1} s/step",
            m.reward_mean,
            m.accuracy
                .map(|a| format!("  acc {a:.3}"))
                .unwrap_or_default(),
            m.loss,
            m.kl,
            m.teacher_kl
                .map(|k| format!("  teacher kl {k:.4}"))
                .unwrap_or_default(),
            m.response_tokens,
            m.tool_calls,
            m.step_s
        );
        match &self.bars {
            Some([steps, _, _]) => {
                steps.set_position(m.step);
                steps.set_message(line);
            }
            None if !self.quiet => eprintln!("step {}/{total}  {line}", m.step),
            None => {}
        }
    }

    pub fn finish(&self) {
        if let Some([steps, rollout, update]) = &self.bars {
            rollout.finish_and_clear();
            update.finish_and_clear();
            steps.finish();
        }
    }
}
