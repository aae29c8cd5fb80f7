//! A server's budget for the keys and values its sampling requests hold (issue 68): what
//! a request asks for is counted in bytes before it is admitted, so a small body cannot
//! make a server allocate without bound (256 samples of 900 tokens once took 673 MiB of
//! one server's memory, from a body of 200 bytes). A request whose choices alone pass the
//! budget is refused with the flag to raise; one that fits waits (Tinker) or is told to
//! retry (the gateway's 429) while others hold the room.

use crate::model::decoder::Model;

/// The default budget in MiB: on the CPU the cache is the process's own memory, bounded
/// as issue 68 asks (no request raises it by over 256 MiB; the process's peak is about
/// 1.4× what is counted here, measured); on a GPU it is device memory, and an RL batch of
/// the 1.5B shape (64 × 384 tokens, 28 KiB a token in bf16) takes ~0.7 GiB.
pub fn default_mib(model: &Model) -> u64 {
    if model.device().is_cpu() { 160 } else { 8192 }
}

#[derive(Debug, Clone, Copy)]
pub struct KvBudget {
    /// Bytes of keys and values a token holds, over every layer.
    pub per_token: u64,
    pub bytes: u64,
}

impl KvBudget {
    pub fn new(model: &Model, mib: u64) -> KvBudget {
        let c = &model.cfg;
        let per_token = (c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim) as u64
            * model.dtype().size_in_bytes() as u64;
        KvBudget {
            per_token,
            bytes: mib << 20,
        }
    }

    /// What `n` choices of `max_new` tokens after a `prompt` hold: the prompt once (the
    /// choices fork its cache and share it) and each choice's own tokens.
    pub fn need(&self, prompt: usize, n: usize, max_new: usize) -> u64 {
        (prompt as u64 + n as u64 * max_new as u64) * self.per_token
    }

    /// Why a request of `need` bytes can never be admitted, if it cannot: `what` names its
    /// sizes as the client sent them, `flag` how to raise the budget.
    pub fn refusal(&self, need: u64, what: &str, flag: &str) -> Option<String> {
        (need > self.bytes).then(|| {
            format!(
                "{what} asks for {:.1} MiB of keys and values ({} bytes a token), over this server's budget of {} MiB ({flag}): ask for fewer choices or fewer tokens, or raise the budget",
                need as f64 / (1u64 << 20) as f64,
                self.per_token,
                self.bytes >> 20
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures;

    #[test]
    fn a_request_is_counted_with_its_prompt_once() {
        let model = fixtures::load("qwen2");
        let b = KvBudget::new(&model, 1);
        let c = &model.cfg;
        assert_eq!(
            b.per_token,
            (c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4) as u64
        );
        assert_eq!(b.need(10, 4, 5), 30 * b.per_token);
        let over = b.need(0, 1, (b.bytes / b.per_token) as usize + 1);
        let why = b
            .refusal(over, "num_samples 1 × max_tokens N", "--kv-budget-mib")
            .unwrap();
        assert!(
            why.contains("over this server's budget of 1 MiB (--kv-budget-mib)"),
            "{why}"
        );
        assert!(b.refusal(b.bytes, "x", "y").is_none());
    }
}
