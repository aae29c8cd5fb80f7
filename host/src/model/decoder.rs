//! The decoder shared by Qwen2, Qwen3 and Llama (they differ only in biases, the Qwen3
//! per-head q/k RMSNorm and rope scaling), with LoRA on any projection.
//!
//! Field names mirror the checkpoint (`model.layers.N.self_attn.q_proj`, ...). Two paths
//! run over the same weights:
//! - [`Model::forward_batch`]: a padded batch `[B, T]` with an attention mask and position
//!   ids, as transformers runs it. When the LoRA weights need gradients, it uses only ops
//!   with a backward (composed softmax, RMSNorm and rope) and the frozen-weight matmul;
//!   otherwise the fused kernels. Used for training and for log-probs of finished
//!   sequences.
//! - [`Model::forward_cached`]: sequences of any lengths, each with its own [`KvCache`],
//!   packed into one matrix for the projections (weight-bound work is batched), attention
//!   per sequence against its cache (no padding, no masks to get wrong). Prefill, decode,
//!   and appending inserted tokens (tool output) are all this one call. A cache can be
//!   forked: the prefix becomes a frozen segment the forks share without copying, which
//!   is how a group of samples shares its prompt's prefill. On a GPU a decode step (one
//!   token per sequence) attends for the whole batch at once instead, its caches moved
//!   into one shared buffer per layer ([`super::kv_cache`]), and a prefill of fresh
//!   sequences in one call of the flash kernels, each sequence a row.

use super::compute::{self, MASKED, rms_norm};
use super::config::{Arch, ModelConfig};
use super::frozen::Weight;
use super::joint::Joint;
use super::kv_cache::{self, KvCache, KvShape, PooledStep};
use super::lora::{AdapterSnapshot, Linear, Lora, LoraConfig, Mode, seeded};
use super::nf4::linear::Nf4Linear;
use super::ops::{rope_cos_sin, rope_inv_freq, softmax_last};
use super::placement::Placement;
use super::weights::Weights;
use anyhow::Context;
use candle_core::{DType, Device, Result, Tensor, Var, backprop::GradStore};
use rand::RngExt;
use std::path::Path;

/// Rows per chunk when computing log-probs over the vocabulary. On the CPU, as many as
/// keep one `[rows, vocab]` f32 intermediate under the allocator's heap-block limit (55
/// rows for a 151,936-token vocabulary, 256 at most); on a GPU, where each chunk is a few
/// kernel launches, chunks of up to 256 MB (441 rows of that vocabulary, 4,096 at most).
pub fn logprob_chunk_rows(vocab: usize, device: &Device) -> usize {
    if device.is_cpu() {
        (super::cpu::alloc::HEAP_BLOCK_LIMIT / 4 / vocab.max(1)).clamp(1, 256)
    } else {
        ((256 << 20) / 4 / vocab.max(1)).clamp(1, 4096)
    }
}

#[derive(Clone)]
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    /// Qwen3: RMSNorm over each head's q and k before rope.
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    /// q/k/v stored as one buffer for the sampling forward ([`Model::join_projections`]).
    qkv: Option<Joint>,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
    eps: f64,
}

#[derive(Clone)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
    /// gate/up stored as one buffer for the sampling forward.
    gate_up: Option<Joint>,
}

#[derive(Clone)]
pub struct DecoderLayer {
    pub self_attn: Attention,
    pub mlp: Mlp,
    pub input_layernorm: Tensor,
    pub post_attention_layernorm: Tensor,
}

pub struct Model {
    pub cfg: ModelConfig,
    pub embed_tokens: Tensor,
    pub layers: Vec<DecoderLayer>,
    pub norm: Tensor,
    /// The output projection; the same tensor as `embed_tokens` when tied.
    pub lm_head: Tensor,
    inv_freq: Tensor,
    /// The adapter's shape, once one is attached.
    pub lora: Option<LoraConfig>,
    /// Recompute each layer's activations in the backward instead of keeping them
    /// (`train.gradient_checkpointing`, see [`super::checkpoint`]).
    pub gradient_checkpointing: bool,
    /// Ids from here on name no token: the rows a head rounded up to a multiple of 64 or
    /// 128 has past the tokenizer's vocabulary ([`Model::limit_vocabulary`]). They are
    /// never sampled and are left out of every log-softmax, the trainer's included, so
    /// that the sampler's log-probs and the trainer's are of one distribution.
    vocab_limit: usize,
    device: Device,
}

fn linear(
    w: &Weights,
    prefix: &str,
    out_f: usize,
    in_f: usize,
    bias: bool,
) -> anyhow::Result<Linear> {
    let name = format!("{prefix}.weight");
    let bias = if bias {
        Some(w.get(&format!("{prefix}.bias"), &[out_f])?)
    } else {
        None
    };
    // A checkpoint bitsandbytes saved in 4 bits keeps its projections quantized.
    if let Some(q) = super::nf4::read_bnb(w, &name, out_f, in_f)? {
        let weight = Weight::Nf4(std::sync::Arc::new(Nf4Linear::new(q)));
        return Ok(Linear::with_weight(weight, bias));
    }
    Ok(Linear::new(w.get(&name, &[out_f, in_f])?, bias))
}

impl Model {
    /// Loads `config.json` and the safetensors of a Hugging Face model directory onto
    /// `at.device`, the weights converted to `at.dtype` (the compute dtype).
    pub fn load(dir: &Path, at: &Placement) -> anyhow::Result<Model> {
        if !dir.is_dir() {
            anyhow::bail!("model directory {} does not exist", dir.display());
        }
        let cfg = ModelConfig::from_dir(dir)?;
        let weights = Weights::from_dir(dir, at.dtype, &at.device)?;
        let mut model = Self::from_weights(cfg, &weights, &at.device)
            .with_context(|| format!("loading the model in {}", dir.display()))?;
        // On a GPU, where a decode step's products are launch-bound: q/k/v and gate/up
        // sampled as one product each, unless `RLHOST_PROJECTIONS=separate` asks for the
        // parts (the benchmark's before-row). Joined once the loaded tensors are dropped,
        // so that each group's separate weights are freed as it joins: a copy of every
        // group at once would be 1.7 GB more at load for a 1.5B model, 8.5 GB for a 7B.
        // (On the CPU joining measured no faster: 12.8k against 12.8–13.2k tokens/s for
        // the built-in model, 32 sequences with a rank-16 adapter.)
        drop(weights);
        let separate =
            std::env::var("RLHOST_PROJECTIONS").is_ok_and(|v| v.eq_ignore_ascii_case("separate"));
        if at.device.is_cuda() && !separate {
            model.join_projections()?;
        }
        Ok(model)
    }

    pub fn from_weights(cfg: ModelConfig, w: &Weights, device: &Device) -> anyhow::Result<Model> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv, inter) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.intermediate_size,
        );
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let ab = cfg.attention_bias;
            let (q_norm, k_norm) = if cfg.arch == Arch::Qwen3 {
                (
                    Some(w.get(&format!("{p}.self_attn.q_norm.weight"), &[d])?),
                    Some(w.get(&format!("{p}.self_attn.k_norm.weight"), &[d])?),
                )
            } else {
                (None, None)
            };
            layers.push(DecoderLayer {
                self_attn: Attention {
                    q_proj: linear(w, &format!("{p}.self_attn.q_proj"), nh * d, h, ab)?,
                    k_proj: linear(w, &format!("{p}.self_attn.k_proj"), nkv * d, h, ab)?,
                    v_proj: linear(w, &format!("{p}.self_attn.v_proj"), nkv * d, h, ab)?,
                    // Qwen2 puts a bias on q/k/v only; Llama's `attention_bias` covers o too.
                    o_proj: linear(
                        w,
                        &format!("{p}.self_attn.o_proj"),
                        h,
                        nh * d,
                        ab && cfg.arch != Arch::Qwen2,
                    )?,
                    q_norm,
                    k_norm,
                    qkv: None,
                    n_heads: nh,
                    n_kv: nkv,
                    head_dim: d,
                    eps: cfg.rms_norm_eps,
                },
                mlp: Mlp {
                    gate_proj: linear(w, &format!("{p}.mlp.gate_proj"), inter, h, cfg.mlp_bias)?,
                    up_proj: linear(w, &format!("{p}.mlp.up_proj"), inter, h, cfg.mlp_bias)?,
                    down_proj: linear(w, &format!("{p}.mlp.down_proj"), h, inter, cfg.mlp_bias)?,
                    gate_up: None,
                },
                input_layernorm: w.get(&format!("{p}.input_layernorm.weight"), &[h])?,
                post_attention_layernorm: w
                    .get(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
            });
        }
        let embed_tokens = w.get("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            w.get("lm_head.weight", &[cfg.vocab_size, h])?
        };
        let inv_freq = rope_inv_freq(d, cfg.rope_theta, &cfg.rope_scaling, device)?;
        Ok(Model {
            norm: w.get("model.norm.weight", &[h])?,
            embed_tokens,
            lm_head,
            layers,
            inv_freq,
            lora: None,
            gradient_checkpointing: false,
            vocab_limit: cfg.vocab_size,
            device: device.clone(),
            cfg,
        })
    }

    /// Takes every layer's projections one by one again (their weights stay views of
    /// the joined buffers, which they keep alive).
    pub fn split_projections(&mut self) {
        for layer in &mut self.layers {
            layer.self_attn.qkv = None;
            layer.mlp.gate_up = None;
        }
    }

    /// Stores each layer's q/k/v, and its gate/up, as one buffer (each projection's
    /// weight and bias a view of its rows), so that the sampling forward takes each group
    /// as one product ([`Joint`]). No memory is added; groups that cannot join (NF4
    /// weights) stay as they are.
    pub fn join_projections(&mut self) -> Result<()> {
        for layer in &mut self.layers {
            let a = &mut layer.self_attn;
            a.qkv = Joint::join(&mut [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj])?;
            let m = &mut layer.mlp;
            m.gate_up = Joint::join(&mut [&mut m.gate_proj, &mut m.up_proj])?;
        }
        Ok(())
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The compute dtype: the base weights' and the activations' (LoRA stays f32).
    pub fn dtype(&self) -> DType {
        self.embed_tokens.dtype()
    }

    /// The device and compute dtype the model was loaded with.
    pub fn placement(&self) -> Placement {
        Placement {
            device: self.device.clone(),
            dtype: self.dtype(),
        }
    }

    /// Rope tables for `positions` in the compute dtype: computed in f32, then cast, as
    /// transformers does.
    fn rope(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        let (cos, sin) = rope_cos_sin(&self.inv_freq, positions)?;
        Ok((cos.to_dtype(self.dtype())?, sin.to_dtype(self.dtype())?))
    }

    /// Attaches a fresh adapter (PEFT initialisation from `seed`) to the targeted
    /// projections of every layer, replacing any adapter already there.
    pub fn attach_lora(&mut self, cfg: &LoraConfig, seed: u64) -> anyhow::Result<()> {
        cfg.validate()?;
        let mut rng = seeded(seed);
        let device = self.device.clone();
        for (name, lin) in self.projections_mut() {
            lin.lora = if cfg.targets(name) {
                Some(Lora::init(
                    lin.in_features(),
                    lin.out_features(),
                    cfg,
                    &mut rng,
                    &device,
                )?)
            } else {
                None
            };
        }
        self.lora = Some(cfg.clone());
        Ok(())
    }

    /// Quantizes every projection's frozen weight to NF4 in bitsandbytes' layout (QLoRA;
    /// double-quantized absmax values when `nested`). The embedding, norms and output head
    /// stay dense, as bitsandbytes leaves them; adapters train as before.
    pub fn quantize_nf4(&mut self, nested: bool) -> anyhow::Result<()> {
        for (_, lin) in self.projections_mut() {
            lin.quantize_nf4(nested)?;
        }
        // The joined dense buffers would keep the dense weights alive.
        self.split_projections();
        // The f32 weights just dropped are not needed again.
        super::cpu::alloc::release_freed_memory();
        Ok(())
    }

    /// Every adapter as it is now, copied (the rollout side's snapshot of version
    /// `version`).
    pub fn adapter_snapshot(&self, version: u64) -> anyhow::Result<AdapterSnapshot> {
        let mut pairs = Vec::new();
        for (_, _, lin) in self.projections() {
            if let Some(l) = &lin.lora {
                let a = l.lora_a.as_tensor();
                let copy = |t: &Tensor| t.copy().map(|c| c.detach());
                pairs.push((a.id(), copy(a)?, copy(l.lora_b.as_tensor())?));
            }
        }
        Ok(AdapterSnapshot::from_pairs(version, pairs).frozen())
    }

    /// A second, trainable adapter on the same projections, initialised as PEFT does (A
    /// Kaiming-uniform from `seed`, B zero) with the live adapter's rank and scaling: PPO's
    /// critic when it does not share the policy's adapter. Returns the set and its
    /// variables, named `<module path>.lora_A` / `.lora_B`.
    pub fn trainable_adapter(
        &self,
        seed: u64,
    ) -> anyhow::Result<(AdapterSnapshot, Vec<(String, Var)>)> {
        let cfg = self
            .lora
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("the model has no adapter to mirror"))?;
        let mut rng = seeded(seed);
        let (mut pairs, mut vars) = (Vec::new(), Vec::new());
        for (path, _, lin) in self.projections() {
            if let Some(live) = &lin.lora {
                let l = Lora::init(
                    lin.in_features(),
                    lin.out_features(),
                    cfg,
                    &mut rng,
                    self.device(),
                )?;
                let (a, b) = (l.lora_a.as_tensor().clone(), l.lora_b.as_tensor().clone());
                pairs.push((live.lora_a.as_tensor().id(), a, b));
                vars.push((format!("{path}.lora_A"), l.lora_a));
                vars.push((format!("{path}.lora_B"), l.lora_b));
            }
        }
        Ok((AdapterSnapshot::from_pairs(0, pairs), vars))
    }

    /// Every projection with its module path (`model.layers.3.mlp.up_proj`) and short name.
    pub fn projections(&self) -> Vec<(String, &'static str, &Linear)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let a = &l.self_attn;
            let m = &l.mlp;
            for (kind, name, lin) in [
                ("self_attn", "q_proj", &a.q_proj),
                ("self_attn", "k_proj", &a.k_proj),
                ("self_attn", "v_proj", &a.v_proj),
                ("self_attn", "o_proj", &a.o_proj),
                ("mlp", "gate_proj", &m.gate_proj),
                ("mlp", "up_proj", &m.up_proj),
                ("mlp", "down_proj", &m.down_proj),
            ] {
                out.push((format!("model.layers.{i}.{kind}.{name}"), name, lin));
            }
        }
        out
    }

    fn projections_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        let mut out = Vec::new();
        for l in self.layers.iter_mut() {
            let a = &mut l.self_attn;
            let m = &mut l.mlp;
            out.push(("q_proj", &mut a.q_proj));
            out.push(("k_proj", &mut a.k_proj));
            out.push(("v_proj", &mut a.v_proj));
            out.push(("o_proj", &mut a.o_proj));
            out.push(("gate_proj", &mut m.gate_proj));
            out.push(("up_proj", &mut m.up_proj));
            out.push(("down_proj", &mut m.down_proj));
        }
        out
    }

    /// Module path → projection, for loading adapters.
    pub fn projection_mut(&mut self, path: &str) -> Option<&mut Linear> {
        let rest = path.strip_prefix("model.layers.")?;
        let (idx, rest) = rest.split_once('.')?;
        let layer = self.layers.get_mut(idx.parse::<usize>().ok()?)?;
        match rest {
            "self_attn.q_proj" => Some(&mut layer.self_attn.q_proj),
            "self_attn.k_proj" => Some(&mut layer.self_attn.k_proj),
            "self_attn.v_proj" => Some(&mut layer.self_attn.v_proj),
            "self_attn.o_proj" => Some(&mut layer.self_attn.o_proj),
            "mlp.gate_proj" => Some(&mut layer.mlp.gate_proj),
            "mlp.up_proj" => Some(&mut layer.mlp.up_proj),
            "mlp.down_proj" => Some(&mut layer.mlp.down_proj),
            _ => None,
        }
    }

    /// The trainable tensors: every `lora_A` and `lora_B`, with their module paths.
    pub fn lora_vars(&self) -> Vec<(String, Var)> {
        let mut out = Vec::new();
        for (path, _, lin) in self.projections() {
            if let Some(l) = &lin.lora {
                out.push((format!("{path}.lora_A"), l.lora_a.clone()));
                out.push((format!("{path}.lora_B"), l.lora_b.clone()));
            }
        }
        out
    }

    /// Names of trainable tensors that a backward pass left without a gradient. candle
    /// silently drops gradients through ops without a backward (and AdamW then silently
    /// skips those tensors): the trainer refuses to step when this is not empty.
    pub fn missing_grads(&self, grads: &GradStore) -> Vec<String> {
        self.lora_vars()
            .into_iter()
            .filter(|(_, v)| grads.get(v.as_tensor()).is_none())
            .map(|(n, _)| n)
            .collect()
    }

    /// Every base tensor under its checkpoint name; with `merged`, projections carry their
    /// adapter folded in (`W + s·BA`). Tied models list the embedding once, as
    /// transformers saves them.
    pub fn named_tensors(&self, merged: bool) -> Result<Vec<(String, Tensor)>> {
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            self.embed_tokens.clone(),
        )];
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            out.push((
                format!("{p}.input_layernorm.weight"),
                l.input_layernorm.clone(),
            ));
            out.push((
                format!("{p}.post_attention_layernorm.weight"),
                l.post_attention_layernorm.clone(),
            ));
            if let Some(w) = &l.self_attn.q_norm {
                out.push((format!("{p}.self_attn.q_norm.weight"), w.clone()));
            }
            if let Some(w) = &l.self_attn.k_norm {
                out.push((format!("{p}.self_attn.k_norm.weight"), w.clone()));
            }
        }
        for (path, _, lin) in self.projections() {
            // An NF4 base is exported dequantized (f32).
            let w = if merged {
                lin.merged_weight(&self.device)?
            } else {
                lin.weight.to_dense(&self.device)?
            };
            out.push((format!("{path}.weight"), w));
            if let Some(b) = &lin.bias {
                out.push((format!("{path}.bias"), b.clone()));
            }
        }
        out.push(("model.norm.weight".to_string(), self.norm.clone()));
        if !self.cfg.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), self.lm_head.clone()));
        }
        Ok(out)
    }

    // ---------------------------------------------------------------- batch path

    /// Hidden states after the final norm, `[B, T, hidden]`, for a padded batch.
    /// `attention_mask` is 1 for real tokens and 0 for padding (either side), or, for
    /// rows that pack several sequences, each token's sequence id (0 still padding; see
    /// [`batch_mask`]); `position_ids` are the positions transformers would use
    /// (`cumsum(mask) - 1`), starting again at 0 with each packed sequence.
    pub fn forward_batch(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
        mode: Mode,
    ) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        let (cos, sin) = self.rope(position_ids)?;
        let ctx = BatchContext {
            mask: batch_mask(attention_mask)?,
            ids: sequence_ids(attention_mask)?,
            cos,
            sin,
            eps: self.cfg.rms_norm_eps,
        };
        let mut x = self
            .embed_tokens
            .index_select(&input_ids.flatten_all()?, 0)?
            .reshape((b, t, self.cfg.hidden_size))?;
        for layer in &self.layers {
            // LoRA dropout: each layer draws its masks from a generator of its own, seeded
            // from the run's, so that a recomputed layer can draw them again.
            let seed = match mode.dropout_rng {
                Some(r) => Some(
                    r.lock()
                        .map_err(|_| candle_core::Error::Msg("dropout rng poisoned".into()))?
                        .random::<u64>(),
                ),
                None => None,
            };
            x = if self.gradient_checkpointing {
                let (l, c) = (layer.clone(), ctx.clone());
                let block: super::checkpoint::Block =
                    Box::new(move |x, mode| l.forward_batch(x, &c, mode));
                super::checkpoint::recomputed(block, &layer.projections(), &x, mode, seed)?
            } else {
                let rng = seed.map(|s| std::sync::Mutex::new(seeded(s)));
                let mode = Mode {
                    dropout_rng: rng.as_ref(),
                    ..mode
                };
                layer.forward_batch(&x, &ctx, mode)?
            };
        }
        rms_norm(&x, &self.norm, ctx.eps)
    }

    /// Ids at and past `n` (the tokenizer's size) name no token: see `vocab_limit`. A
    /// trained head gives its padding rows real mass (Tinker's `train_unembed` did within
    /// a few steps), and a draw there is text nobody can decode.
    pub fn limit_vocabulary(&mut self, n: usize) {
        self.vocab_limit = n.clamp(1, self.cfg.vocab_size);
    }

    /// The ids that name tokens: `0..vocab()`.
    pub fn vocab(&self) -> usize {
        self.vocab_limit
    }

    /// Full logits `[.., vocab]` in f32 from hidden states (small vocabularies and tests;
    /// training uses [`Model::logprobs`]), `-inf` past [`Model::vocab`].
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.past_vocab_masked(compute::linear(hidden, &self.lm_head)?.to_dtype(DType::F32)?)
    }

    /// `logits` (f32, vocabulary last) with the ids past [`Model::vocab`] at `-inf`, so
    /// that no draw lands there and a softmax gives them no mass. The width stays the
    /// config's: a head adapter's delta and every caller's indexing keep their shapes.
    fn past_vocab_masked(&self, logits: Tensor) -> Result<Tensor> {
        let v = self.cfg.vocab_size;
        if self.vocab_limit >= v {
            return Ok(logits);
        }
        let last = logits.rank() - 1;
        let mut dims = logits.dims().to_vec();
        dims[last] = v - self.vocab_limit;
        let padding = Tensor::full(f32::NEG_INFINITY, dims, logits.device())?;
        Tensor::cat(
            &[&logits.narrow(last, 0, self.vocab_limit)?, &padding],
            last,
        )
    }

    /// Log-probs of `targets` and entropies, both `[B, T]`, from hidden states `[B, T, H]`,
    /// without materialising the whole `[B·T, vocab]` logits (chunked, own backward).
    pub fn logprobs(&self, hidden: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, t, h) = hidden.dims3()?;
        let (logp, ent) = compute::target_logprobs(
            &hidden.reshape((b * t, h))?,
            // The head's first rows: a log-softmax over them is the masked one the
            // sampler draws from (a prefix of rows stays contiguous, no copy).
            &self.lm_head.narrow(0, 0, self.vocab_limit)?,
            &targets.flatten_all()?,
            logprob_chunk_rows(self.cfg.vocab_size, &self.device),
            !self.gradient_checkpointing,
        )?;
        Ok((logp.reshape((b, t))?, ent.reshape((b, t))?))
    }

    // ---------------------------------------------------------------- cached path

    /// An empty cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.layers.len())
    }

    /// Runs `tokens[i]` through the model after what `caches[i]` already holds, appends
    /// their keys and values, and returns f32 logits: the last position of each sequence
    /// (`[B, vocab]`) or, with `all_positions`, every new position (`[Σ len, vocab]`, in
    /// order). Sequences may have any lengths, including several tokens after a decode
    /// (inserted tool output).
    pub fn forward_cached(
        &self,
        caches: &mut [&mut KvCache],
        tokens: &[&[u32]],
        mode: Mode,
        all_positions: bool,
    ) -> Result<Tensor> {
        // A decode step of a small model is a few hundred microseconds of arithmetic:
        // split across threads, waking them would cost more (see `cpu::threads`).
        let rows: usize = tokens.iter().map(|t| t.len()).sum();
        self.sized(rows, || {
            self.forward_cached_here(caches, tokens, None, mode, all_positions)
        })
    }

    /// A decode step whose tokens are still where they were drawn: `ids` (`[B]` u32 on
    /// the model's device) is one new token for each of `caches`, read there, so that the
    /// step can be queued before the host has seen them. Returns the `[B, vocab]` f32
    /// logits, as [`Self::forward_cached`] does.
    pub fn forward_cached_ids(
        &self,
        caches: &mut [&mut KvCache],
        ids: &Tensor,
        mode: Mode,
    ) -> Result<Tensor> {
        if ids.dims() != [caches.len()] {
            candle_core::bail!("{:?} token ids for {} caches", ids.dims(), caches.len());
        }
        // Each sequence's one token, its id taken from `ids`.
        let one = [0u32];
        let tokens: Vec<&[u32]> = caches.iter().map(|_| &one[..]).collect();
        self.sized(caches.len(), || {
            self.forward_cached_here(caches, &tokens, Some(ids), mode, false)
        })
    }

    /// Runs `f`, work on at most `rows` token positions at a time, on this thread alone
    /// where the model's products over that many rows are too small to split across
    /// threads, and on the compute pool otherwise ([`super::cpu::threads::sized`]).
    pub fn sized<R: Send>(&self, rows: usize, f: impl FnOnce() -> R + Send) -> R {
        let widest = self.cfg.intermediate_size.max(self.cfg.hidden_size);
        let macs = (rows as u64)
            .saturating_mul(self.cfg.hidden_size as u64)
            .saturating_mul(widest as u64);
        super::cpu::threads::sized(macs, f)
    }

    /// The forward of [`Self::forward_cached`]; with `device_ids`, the token ids are
    /// those (on the device), `tokens` giving only each sequence's count.
    fn forward_cached_here(
        &self,
        caches: &mut [&mut KvCache],
        tokens: &[&[u32]],
        device_ids: Option<&Tensor>,
        mode: Mode,
        all_positions: bool,
    ) -> Result<Tensor> {
        if caches.len() != tokens.len() {
            candle_core::bail!("{} caches for {} sequences", caches.len(), tokens.len());
        }
        if let Some(i) = tokens.iter().position(|t| t.is_empty()) {
            candle_core::bail!("sequence {i} has no new tokens");
        }
        let mode = Mode {
            grad: false,
            ..mode
        };
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut spans = Vec::with_capacity(tokens.len());
        for (cache, toks) in caches.iter().zip(tokens) {
            spans.push((ids.len(), toks.len()));
            ids.extend_from_slice(toks);
            positions.extend((0..toks.len()).map(|j| (cache.len + j) as u32));
        }
        let n = ids.len();
        let ids = match device_ids {
            Some(ids) => ids.to_dtype(DType::U32)?,
            None => Tensor::from_vec(ids, n, &self.device)?,
        };
        let positions = Tensor::from_vec(positions, n, &self.device)?;
        let (cos, sin) = self.rope(&positions.unsqueeze(1)?)?;
        let mut x = self.embed_tokens.index_select(&ids, 0)?;
        let eps = self.cfg.rms_norm_eps;
        // A decode step on a GPU: every sequence's attention at once, in a shared pool.
        let pooled = match self.layers.first() {
            Some(first) if spans.len() == n && kv_cache::pooling(&self.device) => {
                let shape = KvShape {
                    heads: first.self_attn.n_kv,
                    dim: first.self_attn.head_dim,
                    dtype: x.dtype(),
                };
                Some(PooledStep::prepare(caches, shape, &self.device)?)
            }
            _ => None,
        };
        // A prefill of fresh sequences (a batch's prompts, a group's shared one once):
        // every sequence's attention in one call where the flash kernels take it.
        let fresh = pooled.is_none() && caches.iter().all(|c| c.is_empty());
        // Each residual add and the norm after it are one pass on a GPU.
        let mut h = match self.layers.first() {
            Some(first) => rms_norm(&x, &first.input_layernorm, eps)?,
            None => x.clone(),
        };
        for (l, layer) in self.layers.iter().enumerate() {
            let a = match &pooled {
                Some(step) => layer
                    .self_attn
                    .forward_pooled(&h, &cos, &sin, step, l, mode)?,
                None => layer
                    .self_attn
                    .forward_cached(&h, &cos, &sin, caches, l, &spans, fresh, mode)?,
            };
            let (sum, normed) =
                compute::add_rms_norm(&x, &a, &layer.post_attention_layernorm, eps)?;
            let m = layer.mlp.forward(&normed, mode)?;
            match self.layers.get(l + 1) {
                Some(next) => (x, h) = compute::add_rms_norm(&sum, &m, &next.input_layernorm, eps)?,
                None => x = (sum + m)?,
            }
        }
        if let Some(step) = &pooled {
            step.finish(caches);
        }
        for (cache, toks) in caches.iter_mut().zip(tokens) {
            cache.len += toks.len();
        }
        // A decode step's rows are already one a sequence.
        if !all_positions && spans.len() != n {
            let last: Vec<u32> = spans.iter().map(|(o, l)| (o + l - 1) as u32).collect();
            let last = Tensor::from_vec(last, spans.len(), &self.device)?;
            x = x.index_select(&last, 0)?;
        }
        let x = rms_norm(&x, &self.norm, eps)?;
        let logits = compute::linear(&x, &self.lm_head)?.to_dtype(DType::F32)?;
        let logits = self.past_vocab_masked(logits)?;
        head_adapters(logits, &x, mode, &spans, all_positions)
    }
}

/// `logits` with the output head adapters of `mode` added (a set's `head`, per segment of
/// a mixed batch): rows are the packed positions (`all_positions`) or one per sequence.
fn head_adapters(
    logits: Tensor,
    x: &Tensor,
    mode: Mode,
    spans: &[(usize, usize)],
    all_positions: bool,
) -> Result<Tensor> {
    if !mode.adapters {
        return Ok(logits);
    }
    let Some(segments) = mode.segments else {
        return match mode.adapter.and_then(|s| s.head()) {
            Some((a, b, s)) => logits + compute::head_delta(x, a, b, s)?,
            None => Ok(logits),
        };
    };
    if segments
        .iter()
        .all(|s| s.adapter.and_then(|a| a.head()).is_none())
    {
        return Ok(logits);
    }
    // The segments cover packed rows; with one row per sequence, each sequence takes the
    // adapter of the segment its first row is in.
    let rows: Vec<super::lora::Segment> = if all_positions {
        segments.to_vec()
    } else {
        let mut ends = Vec::with_capacity(segments.len());
        let mut end = 0;
        for s in segments {
            end += s.rows;
            ends.push(end);
        }
        super::lora::segments(spans.iter().map(|(offset, _)| {
            let k = ends.partition_point(|&e| e <= *offset);
            (1, segments.get(k).and_then(|s| s.adapter))
        }))
    };
    let mut parts = Vec::with_capacity(rows.len());
    let mut start = 0;
    for seg in &rows {
        let l = logits.narrow(0, start, seg.rows)?;
        parts.push(match seg.adapter.and_then(|s| s.head()) {
            Some((a, b, s)) => (l + compute::head_delta(&x.narrow(0, start, seg.rows)?, a, b, s)?)?,
            None => l,
        });
        start += seg.rows;
    }
    Tensor::cat(&parts, 0)
}

/// What every layer of a batch forward shares: the attention mask (and the sequence ids
/// it was made from, for the fused GPU attention), the rope tables and the norms'
/// epsilon.
#[derive(Clone)]
pub struct BatchContext {
    mask: Tensor,
    ids: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: f64,
}

impl DecoderLayer {
    /// One layer of the batch path: `x + attn(norm(x))`, then that plus `mlp(norm(·))`.
    pub fn forward_batch(&self, x: &Tensor, ctx: &BatchContext, mode: Mode) -> Result<Tensor> {
        let h = rms_norm(x, &self.input_layernorm, ctx.eps)?;
        let a = self.self_attn.forward_batch(&h, ctx, mode)?;
        let x = (x + a)?;
        let h = rms_norm(&x, &self.post_attention_layernorm, ctx.eps)?;
        &x + self.mlp.forward(&h, mode)?
    }

    /// The layer's projections.
    pub fn projections(&self) -> [&Linear; 7] {
        let (a, m) = (&self.self_attn, &self.mlp);
        [
            &a.q_proj,
            &a.k_proj,
            &a.v_proj,
            &a.o_proj,
            &m.gate_proj,
            &m.up_proj,
            &m.down_proj,
        ]
    }
}

impl Attention {
    fn forward_batch(&self, x: &Tensor, ctx: &BatchContext, mode: Mode) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (cos, sin) = (&ctx.cos, &ctx.sin);
        let (nh, nkv, d) = (self.n_heads, self.n_kv, self.head_dim);
        let heads = |lin: &Linear, n: usize, norm: &Option<Tensor>| -> Result<Tensor> {
            let y = compute::lora_linear(lin, x, mode)?;
            match norm {
                Some(w) => rms_norm(&y.reshape((b, t, n, d))?, w, self.eps),
                None => Ok(y),
            }
        };
        // `[B, T, n·d]` → `[B, g, (n/g)·T, d]`, rotated for q and k. Queries come out with
        // the n_rep query heads of each kv head stacked as rows, the grouped-query layout
        // of `compute::attention` (no repeated k/v).
        let place = |y: Tensor, n: usize, groups: usize, rotate: bool| -> Result<Tensor> {
            compute::rope_heads(&y, n, groups, rotate.then_some((cos, sin)))
        };
        let q = place(heads(&self.q_proj, nh, &self.q_norm)?, nh, nkv, true)?;
        let k = place(heads(&self.k_proj, nkv, &self.k_norm)?, nkv, nkv, true)?;
        let v = place(heads(&self.v_proj, nkv, &None)?, nkv, nkv, false)?;
        let scale = 1.0 / (d as f64).sqrt();
        let out = compute::attention(&q, &k, &v, &ctx.mask, &ctx.ids, scale)?;
        let out = out.reshape((b, nh, t, d))?.transpose(1, 2)?;
        compute::lora_linear(&self.o_proj, &out.reshape((b, t, nh * d))?, mode)
    }

    /// Queries `[n, heads, 1, d]`, keys and values `[n, kv_heads, 1, d]` of `x: [n, hidden]`,
    /// one position per row, normed and rotated where the model does.
    fn cached_heads(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mode: Mode,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let n = x.dim(0)?;
        let d = self.head_dim;
        let parts = [&self.q_proj, &self.k_proj, &self.v_proj];
        // q/k/v as one product where they are joined, each part then its columns.
        let joined = match &self.qkv {
            Some(joint) => joint.forward(&parts, x, mode)?,
            None => None,
        };
        let mut at = 0;
        let mut project = |lin: &Linear| -> Result<Tensor> {
            match &joined {
                Some(y) => {
                    let out = lin.out_features();
                    let part = y.narrow(1, at, out)?;
                    at += out;
                    Ok(part)
                }
                None => compute::lora_linear(lin, x, mode),
            }
        };
        let (q, k, v) = (project(parts[0])?, project(parts[1])?, project(parts[2])?);
        // Every row is its own "batch" of one position for the fused rope kernel.
        let heads =
            |y: Tensor, count: usize, norm: &Option<Tensor>, rotate: bool| -> Result<Tensor> {
                if rotate && norm.is_none() {
                    // Straight from the product's columns where the kernel reads them so.
                    return compute::rope_packed(&y, count, cos, sin);
                }
                let y = y.reshape((n, count, 1, d))?;
                let y = match norm {
                    Some(w) => rms_norm(&y, w, self.eps)?,
                    None => y,
                };
                if rotate {
                    compute::rope_rows(&y, cos, sin)
                } else {
                    Ok(y)
                }
            };
        Ok((
            heads(q, self.n_heads, &self.q_norm, true)?,
            heads(k, self.n_kv, &self.k_norm, true)?,
            heads(v, self.n_kv, &None, false)?,
        ))
    }

    /// The attention of a decode step through `step`'s pool: `x: [B, hidden]`, one new
    /// token per sequence.
    fn forward_pooled(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        step: &PooledStep,
        layer: usize,
        mode: Mode,
    ) -> Result<Tensor> {
        let (q, k, v) = self.cached_heads(x, cos, sin, mode)?;
        let out = {
            let _p = super::profile::span("pooled_attention", x.device());
            step.attend(layer, &q, &k, &v, 1.0 / (self.head_dim as f64).sqrt())?
        };
        compute::lora_linear(&self.o_proj, &out, mode)
    }

    /// The attention of `spans` of new tokens, each sequence against its cache; `fresh`:
    /// every cache is empty (a prefill), which [`batches_prefill`] may run as one call.
    #[allow(clippy::too_many_arguments)]
    fn forward_cached(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        caches: &mut [&mut KvCache],
        layer: usize,
        spans: &[(usize, usize)],
        fresh: bool,
        mode: Mode,
    ) -> Result<Tensor> {
        let (nh, nkv, d) = (self.n_heads, self.n_kv, self.head_dim);
        let n_rep = nh / nkv;
        let (q, k, v) = self.cached_heads(x, cos, sin, mode)?;
        let scale = 1.0 / (d as f64).sqrt();
        if fresh && batches_prefill(&q) {
            let out = self.batched_prefill(&q, &k, &v, caches, layer, spans)?;
            return compute::lora_linear(&self.o_proj, &out, mode);
        }
        let mut outs = Vec::with_capacity(spans.len());
        let attention = super::profile::span("cached_attention", x.device());
        for (cache, &(off, len)) in caches.iter_mut().zip(spans) {
            let per_seq = |t: &Tensor, count: usize| -> Result<Tensor> {
                t.narrow(0, off, len)?
                    .reshape((len, count, d))?
                    .transpose(0, 1)?
                    .contiguous()
            };
            let kv = &mut cache.layers[layer];
            kv.append(&per_seq(&k, nkv)?, &per_seq(&v, nkv)?)?;
            let q = per_seq(&q, nh)?.reshape((nkv, n_rep * len, d))?;
            let segments = kv.segments()?;
            let mut scores = Vec::with_capacity(segments.len());
            for (sk, _) in &segments {
                scores.push(q.matmul(&sk.t()?)?);
            }
            // Scores, mask and softmax in f32 (as transformers: `softmax(dtype=float32)`),
            // the weights back in the compute dtype for the product with the values.
            let scores = (Tensor::cat(&scores, 2)?.to_dtype(DType::F32)? * scale)?;
            let total = scores.dim(2)?;
            let scores = if len > 1 {
                // Causal among the new tokens; everything cached before is visible.
                let mask: Vec<f32> = (0..len)
                    .flat_map(|i| {
                        (0..total).map(move |j| if j <= total - len + i { 0.0 } else { MASKED })
                    })
                    .collect();
                let mask = Tensor::from_vec(mask, (len, total), x.device())?;
                scores
                    .reshape((nkv, n_rep, len, total))?
                    .broadcast_add(&mask)?
                    .reshape((nkv, n_rep * len, total))?
            } else {
                scores
            };
            let w = softmax_last(&scores)?.to_dtype(x.dtype())?;
            let mut out: Option<Tensor> = None;
            let mut at = 0;
            for (_, sv) in &segments {
                let seg_len = sv.dim(1)?;
                // Contiguous where there are several segments: CUDA's matmul takes no
                // row stride wider than the row.
                let wpart = w.narrow(2, at, seg_len)?;
                let wpart = if segments.len() > 1 && !wpart.device().is_cpu() {
                    wpart.contiguous()?
                } else {
                    wpart
                };
                let part = wpart.matmul(sv)?;
                at += seg_len;
                out = Some(match out {
                    None => part,
                    Some(o) => (o + part)?,
                });
            }
            let out = out.expect("the new tokens are always a segment");
            outs.push(
                out.reshape((nh, len, d))?
                    .transpose(0, 1)?
                    .reshape((len, nh * d))?,
            );
        }
        drop(attention);
        compute::lora_linear(&self.o_proj, &Tensor::cat(&outs, 0)?, mode)
    }

    /// The attention of a prefill of fresh sequences as one call ([`prefill_rows`]), each
    /// sequence's keys and values then put in its cache: `q: [n, heads, 1, d]`, `k`, `v:
    /// [n, kv_heads, 1, d]`, the packed rows of `spans`. Returns `[n, heads·d]`.
    fn batched_prefill(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        caches: &mut [&mut KvCache],
        layer: usize,
        spans: &[(usize, usize)],
    ) -> Result<Tensor> {
        let _p = super::profile::span("batched_prefill", q.device());
        let (out, k, v) = prefill_rows(q, k, v, spans)?;
        for (i, (cache, &(_, len))) in caches.iter_mut().zip(spans).enumerate() {
            cache.layers[layer].append(
                &k.get(i)?.narrow(1, 0, len)?.contiguous()?,
                &v.get(i)?.narrow(1, 0, len)?.contiguous()?,
            )?;
        }
        Ok(out)
    }
}

/// Causal attention of the sequences `spans` (offset, length) of packed rows `q: [n,
/// heads, 1, d]`, `k`, `v: [n, kv_heads, 1, d]`, each sequence seeing its own tokens, in
/// one call: each sequence becomes a row of its own, padded on the right to the longest
/// (the flash kernels skip the tiles above the diagonal, so a sequence costs its own
/// triangle and its padding's, where one long packed row would cost every pair of
/// sequences' rectangle). Returns the attention `[n, heads·d]` and the keys and values
/// as rows, `[S, kv_heads, longest, d]`.
fn prefill_rows(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spans: &[(usize, usize)],
) -> Result<(Tensor, Tensor, Tensor)> {
    let (n, nh, _, d) = q.dims4()?;
    let nkv = k.dim(1)?;
    let s = spans.len();
    let longest = spans.iter().map(|&(_, len)| len).max().unwrap_or(0);
    let dev = q.device();
    // Row `i`, column `t` takes packed row `offset_i + t`, or row `n` (zeros) past the
    // sequence's end; the sequence ids are 1 on its tokens and 0 on the padding.
    let mut take = Vec::with_capacity(s * longest);
    let mut ids = Vec::with_capacity(s * longest);
    for &(off, len) in spans {
        take.extend((0..longest).map(|t| if t < len { (off + t) as u32 } else { n as u32 }));
        ids.extend((0..longest).map(|t| if t < len { 1f32 } else { 0.0 }));
    }
    let take = Tensor::from_vec(take, s * longest, dev)?;
    let ids = Tensor::from_vec(ids, (s, longest), dev)?;
    // `[n, count, 1, d]` → `[S, count, longest, d]`.
    let padded = |t: &Tensor, count: usize| -> Result<Tensor> {
        let t = t.reshape((n, count * d))?;
        Tensor::cat(&[&t, &t.narrow(0, 0, 1)?.zeros_like()?], 0)?
            .index_select(&take, 0)?
            .reshape((s, longest, count, d))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (k, v) = (padded(k, nkv)?, padded(v, nkv)?);
    // The grouped-query layout of `compute::attention`: the n_rep query heads of each kv
    // head stacked as rows, `[S, g, R·longest, d]`.
    let q = padded(q, nh)?.reshape((s, nkv, (nh / nkv) * longest, d))?;
    let scale = 1.0 / (d as f64).sqrt();
    let out = prefill_attention(&q, &k, &v, &ids, scale)?
        .reshape((s, nh, longest, d))?
        .transpose(1, 2)?
        .reshape((s * longest, nh * d))?;
    // Back to the packed rows, the padding left out.
    let real: Vec<u32> = spans
        .iter()
        .enumerate()
        .flat_map(|(i, &(_, len))| (0..len).map(move |t| (i * longest + t) as u32))
        .collect();
    let out = out.index_select(&Tensor::from_vec(real, n, dev)?, 0)?;
    Ok((out, k, v))
}

/// Whether a prefill of fresh sequences attends in one call: where the flash kernels take
/// its queries (a GPU, half precision, head size 64 or 128), which read the sequence ids
/// instead of a mask, unless `RLHOST_PREFILL=sequences` asks for the per-sequence form
/// (the benchmark runs both). Elsewhere (the CPU, whose kernels attend sequence by
/// sequence without launches) each sequence attends alone.
fn batches_prefill(q: &Tensor) -> bool {
    #[cfg(test)]
    if let Some(forced) = FORCE_BATCHED_PREFILL.with(|f| f.get()) {
        return forced;
    }
    #[cfg(feature = "cuda")]
    if super::cuda::applies(q) && super::cuda::flash::applies(q) {
        static SEQUENCES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        return !*SEQUENCES.get_or_init(|| {
            std::env::var("RLHOST_PREFILL").is_ok_and(|v| v.eq_ignore_ascii_case("sequences"))
        });
    }
    let _ = q;
    false
}

/// [`compute::attention`] of rows of sequences with ids `ids` (`[S, T]`): the flash
/// kernels where [`batches_prefill`] found them, else the composed form under the mask of
/// those ids.
fn prefill_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ids: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if super::cuda::applies(q) && super::cuda::flash::applies(q) {
        return super::cuda::flash::attention(q, k, v, ids, scale);
    }
    compute::attention(q, k, v, &batch_mask(ids)?, ids, scale)
}

#[cfg(test)]
thread_local! {
    static FORCE_BATCHED_PREFILL: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// In tests: runs `f` with fresh prefills in one attention call (`true`) or attending
/// sequence by sequence, whatever the device.
#[cfg(test)]
pub(crate) fn with_batched_prefill<R>(on: bool, f: impl FnOnce() -> R) -> R {
    let before = FORCE_BATCHED_PREFILL.with(|c| c.replace(Some(on)));
    let r = f();
    FORCE_BATCHED_PREFILL.with(|c| c.set(before));
    r
}

impl Mlp {
    fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        if let Some(y) =
            compute::lora_mlp(x, [&self.gate_proj, &self.up_proj, &self.down_proj], mode)?
        {
            return Ok(y);
        }
        if let Some(joint) = &self.gate_up
            && let Some(gate_up) = joint.forward(&[&self.gate_proj, &self.up_proj], x, mode)?
        {
            let h = compute::swiglu_joint(&gate_up)?;
            return compute::lora_linear(&self.down_proj, &h, mode);
        }
        let gate = compute::lora_linear(&self.gate_proj, x, mode)?;
        let up = compute::lora_linear(&self.up_proj, x, mode)?;
        compute::lora_linear(&self.down_proj, &compute::swiglu(&gate, &up)?, mode)
    }
}

/// Additive mask `[B, 1, 1, T, T]` (broadcast over kv heads and their query groups)
/// from the sequence ids of a batch's tokens (`attention_mask`, `[B, T]`): 0 is
/// padding, and a row may hold several sequences packed one after another, each with
/// an id of its own (transformers' 0/1 mask is the case of one sequence a row). Query i
/// may see key j when
///   j <= i  and  id[j] != 0  and  (id[i] == id[j]  or  id[i] == 0),
/// so a sequence never sees its neighbours in a packed row, and a padding query sees
/// the real keys before it as in transformers (nothing reads its output). Built with
/// tensor ops where `attention_mask` lives, so that on a GPU only the `[B, T]` ids
/// cross over, not `B·T²` floats.
pub fn batch_mask(attention_mask: &Tensor) -> Result<Tensor> {
    let (b, t) = attention_mask.dims2()?;
    let dev = attention_mask.device();
    let pos = Tensor::arange(0u32, t as u32, dev)?;
    // [T, T]: row i (query), column j (key), 1 where j <= i.
    let causal = pos.unsqueeze(0)?.broadcast_le(&pos.unsqueeze(1)?)?;
    let ids = attention_mask.to_dtype(DType::U32)?;
    let (query, key) = (ids.unsqueeze(2)?, ids.unsqueeze(1)?);
    // [B, T, T]: the same sequence, or a padding query; and a real key.
    let same = query.broadcast_eq(&key)?;
    // 1 or 2 where either holds: `where_cond` takes any non-zero as true.
    let together = same.broadcast_add(&query.eq(0u32)?)?;
    let allowed = together
        .broadcast_mul(&key.ne(0u32)?)?
        .broadcast_mul(&causal.unsqueeze(0)?)?
        .reshape((b, 1, 1, t, t))?;
    let open = Tensor::zeros((b, 1, 1, t, t), DType::F32, dev)?;
    let shut = Tensor::full(MASKED, (b, 1, 1, t, t), dev)?;
    allowed.where_cond(&open, &shut)
}

/// The sequence ids of `attention_mask` as f32 `[B, T]` (exact below 2^24), the form
/// the fused GPU attention reads them in: it applies [`batch_mask`]'s rule itself.
pub fn sequence_ids(attention_mask: &Tensor) -> Result<Tensor> {
    attention_mask.to_dtype(DType::F32)?.contiguous()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::{self, MODELS, Reference, masked_max_diff, max_diff};

    /// The mask built with tensor ops is the causal-and-not-padding rule, written out.
    #[test]
    fn batch_mask_is_causal_and_hides_padding_on_either_side() {
        let am = [[0u32, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]];
        let t = Tensor::new(&am, &Device::Cpu).unwrap();
        let got = batch_mask(&t).unwrap();
        assert_eq!(got.dims(), [3, 1, 1, 5, 5]);
        let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut want = Vec::new();
        for row in &am {
            for i in 0..5 {
                for (j, &key) in row.iter().enumerate() {
                    want.push(if j <= i && key != 0 { 0.0 } else { MASKED });
                }
            }
        }
        assert_eq!(got, want);
    }

    /// Packed rows: each sequence sees only its own keys, a padding query every real key
    /// before it.
    #[test]
    fn batch_mask_keeps_packed_sequences_apart() {
        let ids = [[1u32, 1, 2, 2, 2, 0], [0, 7, 7, 3, 3, 3]];
        let got = batch_mask(&Tensor::new(&ids, &Device::Cpu).unwrap()).unwrap();
        let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut want = Vec::new();
        for row in &ids {
            for (i, &q) in row.iter().enumerate() {
                for (j, &k) in row.iter().enumerate() {
                    let open = j <= i && k != 0 && (q == k || q == 0);
                    want.push(if open { 0.0 } else { MASKED });
                }
            }
        }
        assert_eq!(got, want);
    }

    /// Sequences packed into rows (sequence ids in the mask, positions from 0 again at
    /// each) give each sequence's logits as transformers computes it alone, in the fused
    /// and the composed forms, with and without gradients.
    #[test]
    fn packed_rows_give_each_sequence_its_own_logits() {
        for name in MODELS {
            let model = fixtures::load(name);
            let r = Reference::load(name);
            let rows = r.rows();
            let (first, want) = (r.first_real(), r.get("logits"));
            // (reference row, tokens taken from its start) a sequence, each lane in turn.
            let lanes: [&[(usize, usize)]; 2] = [
                &[(0, rows[0].len()), (1, rows[1].len())],
                &[(1, 4), (0, rows[0].len())],
            ];
            let t = lanes
                .iter()
                .map(|l| l.iter().map(|s| s.1).sum::<usize>())
                .max()
                .unwrap()
                + 2;
            let (mut ids, mut seqs, mut pos) = (vec![], vec![], vec![]);
            for lane in lanes {
                let mut used = 0;
                for (s, &(row, n)) in lane.iter().enumerate() {
                    ids.extend(&rows[row][..n]);
                    seqs.extend(std::iter::repeat_n(3 * s as u32 + 2, n));
                    pos.extend(0..n as u32);
                    used += n;
                }
                ids.extend(std::iter::repeat_n(0, t - used));
                seqs.extend(std::iter::repeat_n(0, t - used));
                pos.extend(std::iter::repeat_n(0, t - used));
            }
            let dev = model.device();
            let at = |v: Vec<u32>| Tensor::from_vec(v, (2, t), dev).unwrap();
            let (ids, seqs, pos) = (at(ids), at(seqs), at(pos));
            for (form, grad) in [("fused", false), ("fused", true), ("composed", true)] {
                let mode = if grad { Mode::TRAIN } else { Mode::INFERENCE };
                let run = || {
                    let h = model.forward_batch(&ids, &seqs, &pos, mode).unwrap();
                    model.logits(&h).unwrap()
                };
                let logits = if form == "composed" {
                    crate::model::cpu::composed(run)
                } else {
                    run()
                };
                let mut worst = 0f32;
                for (l, lane) in lanes.iter().enumerate() {
                    let mut at = 0;
                    for &(row, n) in lane.iter() {
                        let got = logits.get(l).unwrap().narrow(0, at, n).unwrap();
                        let exp = want.get(row).unwrap().narrow(0, first[row], n).unwrap();
                        worst = worst.max(max_diff(&got, &exp));
                        at += n;
                    }
                }
                eprintln!("{name} {form} (grad {grad}): packed rows vs transformers {worst:.2e}");
                assert!(
                    worst <= 1e-4,
                    "{name} {form} (grad {grad}): packed diff {worst}"
                );
            }
        }
    }

    /// Logits of the batch path vs transformers (eager attention, f32), at real positions.
    #[test]
    fn batch_logits_match_transformers() {
        for name in MODELS {
            let model = fixtures::load(name);
            let r = Reference::load(name);
            let logits = r.logits(&model, Mode::BASE);
            let diff = masked_max_diff(&logits, r.get("logits"), &r.attention_mask());
            eprintln!("{name}: logits vs transformers, max abs diff {diff:.2e}");
            assert!(diff <= 1e-4, "{name}: max abs diff {diff}");
        }
    }

    /// The cached path, prefilling each row's real tokens (no padding) in one call,
    /// gives the same logits at every position; so does decoding one token at a time
    /// after a prefix, batched across rows of different lengths.
    #[test]
    fn cached_prefill_and_decode_match_transformers() {
        // As on the CPU, with a GPU's pooled decode steps, and with its batched prefill.
        for (pooled, batched) in [(false, false), (true, false), (false, true), (true, true)] {
            kv_cache::with_pooling(pooled, || {
                with_batched_prefill(batched, cached_prefill_and_decode_case)
            });
        }
    }

    fn cached_prefill_and_decode_case() {
        for name in MODELS {
            let model = fixtures::load(name);
            let r = Reference::load(name);
            let rows = r.rows();
            let first = r.first_real();
            let want = r.get("logits");
            // Both rows in one call, all positions.
            let mut caches: Vec<KvCache> = rows.iter().map(|_| model.new_cache()).collect();
            let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
            let toks: Vec<&[u32]> = rows.iter().map(|r| r.as_slice()).collect();
            let all = model
                .forward_cached(&mut refs, &toks, Mode::BASE, true)
                .unwrap();
            let mut at = 0;
            for (i, row) in rows.iter().enumerate() {
                let got = all.narrow(0, at, row.len()).unwrap();
                let exp = want.get(i).unwrap().narrow(0, first[i], row.len()).unwrap();
                let diff = max_diff(&got, &exp);
                assert!(diff <= 1e-4, "{name} row {i}: prefill diff {diff}");
                at += row.len();
            }
            // Prefix of `prefix_len`, then both rows decoded token by token in one batch.
            let prefix = r.get("prefix_len").to_scalar::<i64>().unwrap() as usize;
            let mut caches: Vec<KvCache> = rows.iter().map(|_| model.new_cache()).collect();
            let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
            let toks: Vec<&[u32]> = rows.iter().map(|r| &r[..prefix]).collect();
            model
                .forward_cached(&mut refs, &toks, Mode::BASE, false)
                .unwrap();
            let steps = rows.iter().map(Vec::len).min().unwrap();
            let mut worst = 0f32;
            for t in prefix..steps {
                let toks: Vec<&[u32]> = rows.iter().map(|r| &r[t..t + 1]).collect();
                let got = model
                    .forward_cached(&mut refs, &toks, Mode::BASE, false)
                    .unwrap();
                for (i, start) in first.iter().enumerate() {
                    let exp = want.get(i).unwrap().get(start + t).unwrap();
                    worst = worst.max(max_diff(&got.get(i).unwrap(), &exp));
                }
            }
            eprintln!("{name}: KV-cache decode vs transformers, max abs diff {worst:.2e}");
            assert!(worst <= 1e-4, "{name}: decode diff {worst}");
            assert_eq!(refs[0].len(), steps);
        }
    }

    /// The batched prefill's attention through the flash kernels (half precision, head
    /// sizes 128 and 64, right-padded rows of different lengths, grouped queries) against
    /// the composed form of the same rows. Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[cfg(feature = "cuda")]
    #[test]
    fn batched_prefill_attention_on_flash_matches_the_composed_form() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        for (nh, nkv, d, lens) in [
            (12, 2, 128, vec![37, 128, 5, 64]),
            (14, 2, 64, vec![200, 1, 77]),
        ] {
            for dtype in [DType::BF16, DType::F16] {
                let n: usize = lens.iter().sum();
                let mut spans = Vec::new();
                let mut at = 0;
                for &len in &lens {
                    spans.push((at, len));
                    at += len;
                }
                let make = |count: usize, seed: u64| {
                    (fixtures::uniform(&[n, count, 1, d], seed) * 2.0)
                        .unwrap()
                        .to_device(&dev)
                        .unwrap()
                };
                let (q, k, v) = (make(nh, 1), make(nkv, 2), make(nkv, 3));
                let half = |t: &Tensor| t.to_dtype(dtype).unwrap();
                let (qh, kh, vh) = (half(&q), half(&k), half(&v));
                assert!(
                    batches_prefill(&qh),
                    "the flash kernels take {dtype:?}, d {d}"
                );
                let composed = |q: &Tensor, k: &Tensor, v: &Tensor| {
                    crate::model::cpu::composed(|| prefill_rows(q, k, v, &spans))
                        .unwrap()
                        .0
                };
                // The flash rows and the composed ones in the half dtype, each against the
                // composed form in f32: the kernels may not be further from it.
                let reference = composed(&q, &k, &v);
                let (flash, _, _) = prefill_rows(&qh, &kh, &vh, &spans).unwrap();
                let ef = fixtures::relative_diff(&flash, &reference);
                let eh = fixtures::relative_diff(&composed(&qh, &kh, &vh), &reference);
                eprintln!(
                    "batched prefill {nh}/{nkv} heads of {d}, {lens:?}, {dtype:?}: flash {ef:.2e}, composed {eh:.2e} from f32"
                );
                assert!(
                    ef.is_finite() && ef <= 1.5 * eh + 1e-3,
                    "{lens:?} {dtype:?}: {ef} vs {eh}"
                );
            }
        }
    }

    /// With q/k/v and gate/up joined (as on a GPU), a frozen set's sampling forward gives
    /// the logits the parts give one by one, prefill and decode steps, and so does its
    /// batch forward; and the training path, whose parts now read views of the joined
    /// buffers, is unchanged.
    #[test]
    fn joined_projections_sample_and_train_as_the_parts() {
        for name in MODELS {
            let adapted = |joined: bool| {
                let mut model = fixtures::load(name);
                if joined {
                    model.join_projections().unwrap();
                } else {
                    model.split_projections();
                }
                assert_eq!(model.layers[0].self_attn.qkv.is_some(), joined);
                assert_eq!(model.layers[0].mlp.gate_up.is_some(), joined);
                let cfg = LoraConfig {
                    r: 2,
                    ..LoraConfig::default()
                };
                model.attach_lora(&cfg, 1).unwrap();
                for (i, (_, lin)) in model.projections_mut().into_iter().enumerate() {
                    let l = lin.lora.as_ref().unwrap();
                    let b = fixtures::uniform(l.lora_b.as_tensor().dims(), i as u64);
                    l.lora_b
                        .set(&(b * 0.05).unwrap().to_device(l.lora_b.device()).unwrap())
                        .unwrap();
                }
                model
            };
            let r = Reference::load(name);
            let rows = r.rows();
            let run = |model: &Model| {
                let set = model.adapter_snapshot(1).unwrap();
                let mode = Mode {
                    adapter: Some(&set),
                    ..Mode::INFERENCE
                };
                let mut caches: Vec<KvCache> = rows.iter().map(|_| model.new_cache()).collect();
                let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
                let toks: Vec<&[u32]> = rows.iter().map(|r| &r[..4]).collect();
                let mut out = vec![model.forward_cached(&mut refs, &toks, mode, true).unwrap()];
                for t in 4..7 {
                    let toks: Vec<&[u32]> = rows.iter().map(|r| &r[t..t + 1]).collect();
                    out.push(model.forward_cached(&mut refs, &toks, mode, false).unwrap());
                }
                // The batch path: training (the parts over views), and with the set and no
                // gradient (the MLP's gate/up joined over `[B, T, ·]`).
                let args = (r.input_ids(), r.attention_mask(), r.position_ids());
                for mode in [Mode::TRAIN, mode] {
                    let h = model
                        .forward_batch(&args.0, &args.1, &args.2, mode)
                        .unwrap();
                    out.push(model.logits(&h).unwrap());
                }
                out
            };
            for pooled in [false, true] {
                let (joined, parts) =
                    kv_cache::with_pooling(pooled, || (run(&adapted(true)), run(&adapted(false))));
                for (step, (a, b)) in joined.iter().zip(&parts).enumerate() {
                    let d = max_diff(a, b);
                    assert!(d <= 1e-4, "{name} pooled {pooled}, call {step}: {d}");
                }
            }
        }
    }

    /// A forked cache (shared prefix segment) continues exactly like the original.
    #[test]
    fn forked_caches_share_the_prefix() {
        let model = fixtures::load("qwen2");
        let r = Reference::load("qwen2");
        let row = &r.rows()[0];
        let want = r.get("logits").get(0).unwrap();
        let mut parent = model.new_cache();
        model
            .forward_cached(&mut [&mut parent], &[&row[..5]], Mode::BASE, false)
            .unwrap();
        let mut a = parent.fork();
        let mut b = parent.fork();
        // a: one token at a time; b: the rest as one chunk (inserted tokens).
        for t in 5..row.len() {
            let got = model
                .forward_cached(&mut [&mut a], &[&row[t..t + 1]], Mode::BASE, false)
                .unwrap();
            assert!(max_diff(&got.get(0).unwrap(), &want.get(t).unwrap()) <= 1e-4);
        }
        let got = model
            .forward_cached(&mut [&mut b], &[&row[5..]], Mode::BASE, true)
            .unwrap();
        assert!(max_diff(&got, &want.narrow(0, 5, row.len() - 5).unwrap()) <= 1e-4);
        assert_eq!(parent.len(), 5);
        assert_eq!(a.len(), row.len());
    }

    /// The differentiable ops give the same logits as the fused ones, and every LoRA
    /// tensor receives a gradient.
    #[test]
    fn training_path_equals_inference_path_and_reaches_every_lora_tensor() {
        for name in MODELS {
            let mut model = fixtures::load(name);
            model
                .attach_lora(
                    &LoraConfig {
                        r: 2,
                        ..LoraConfig::default()
                    },
                    1,
                )
                .unwrap();
            // Give B non-zero values so the adapter changes the output.
            for (_, lin) in model.projections_mut() {
                let l = lin.lora.as_ref().unwrap();
                let b = (l.lora_b.as_tensor().ones_like().unwrap() * 0.05).unwrap();
                l.lora_b.set(&b).unwrap();
            }
            let r = Reference::load(name);
            let args = (r.input_ids(), r.attention_mask(), r.position_ids());
            let fused = model
                .forward_batch(&args.0, &args.1, &args.2, Mode::INFERENCE)
                .unwrap();
            let train_mode = Mode::TRAIN;
            let diff_h = model
                .forward_batch(&args.0, &args.1, &args.2, train_mode)
                .unwrap();
            assert!(diff_h.track_op());
            let logits_f = model.logits(&fused).unwrap();
            let logits_d = model.logits(&diff_h).unwrap();
            let d = masked_max_diff(&logits_f, &logits_d, &args.1);
            assert!(d <= 1e-4, "{name}: fused vs differentiable {d}");
            // ... and the cached path agrees with both.
            let rows = r.rows();
            let mut cache = model.new_cache();
            let cached = model
                .forward_cached(&mut [&mut cache], &[&rows[0]], Mode::INFERENCE, true)
                .unwrap();
            assert!(max_diff(&cached, &logits_f.get(0).unwrap()) <= 1e-4);
            let targets = args.0.clone();
            let (logp, _) = model.logprobs(&diff_h, &targets).unwrap();
            let grads = logp.sum_all().unwrap().backward().unwrap();
            let missing = model.missing_grads(&grads);
            assert!(missing.is_empty(), "{name}: no gradient for {missing:?}");
        }
    }
}
