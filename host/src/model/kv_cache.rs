//! Keys and values of the sequences being generated.
//!
//! A [`KvCache`] holds one sequence's keys and values per layer: frozen segments it shares
//! with its forks (a group's prompt, prefilled once), then its own growing buffer.
//!
//! On a GPU a decode step (one new token for each sequence) attending sequence by
//! sequence is some fifteen small kernels per sequence and layer: measured on an H200,
//! 70% of a decode step of 64 sequences on a 1.5B-shaped model, which is all launches.
//! There the batch's caches move into one [`KvPool`]: per layer a `[rows, kv_heads, cap, d]`
//! buffer, one row per sequence, each row becoming that sequence's own buffer (a view,
//! no copy). A decode step ([`PooledStep`]) then writes every sequence's new key and value
//! with one scatter and attends for all sequences at once per layer
//! ([`super::compute::decode_attention`]: on a GPU a flash-decoding kernel reading each
//! row up to its length; composed, one masked product over the pool).
//! A cache leaves its pool when it is forked or its row fills up; the next decode step
//! that finds a batch not all in one pool builds a new one (a copy of each cache, the
//! cost of about one step done sequence by sequence).

use super::compute::{decode_attention, decode_mask};
use candle_core::{DType, Device, Result, Tensor};
use std::sync::Arc;

/// Keys and values of one sequence, per layer.
pub struct KvCache {
    pub(super) layers: Vec<LayerKv>,
    pub(super) len: usize,
    /// The pool whose row `.1` holds this cache's own buffers, while it does.
    pooled: Option<(Arc<KvPool>, usize)>,
}

impl Clone for KvCache {
    /// A copy that shares what is cached so far as frozen segments (no copy of the data)
    /// and appends to buffers of its own: neither ever writes where the other reads.
    fn clone(&self) -> KvCache {
        KvCache {
            layers: self.layers.iter().map(LayerKv::shared).collect(),
            len: self.len,
            pooled: None,
        }
    }
}

impl KvCache {
    /// An empty cache for a model of `layers` layers.
    pub(super) fn new(layers: usize) -> KvCache {
        KvCache {
            layers: (0..layers).map(|_| LayerKv::default()).collect(),
            len: 0,
            pooled: None,
        }
    }

    /// Tokens cached so far (= the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A second cache with the same contents. What is cached so far becomes a frozen
    /// segment both share (no copy); each then appends to its own buffer.
    pub fn fork(&mut self) -> KvCache {
        for l in &mut self.layers {
            l.freeze();
        }
        self.pooled = None;
        self.clone()
    }

    /// Forgets the last token cached: a forward ahead read a token the host then did
    /// not take (`sampler::decode::draw_ahead`). Its keys and values stay where they are,
    /// to be written over by the next token's. Only a token in this cache's own buffer
    /// (not in a segment shared with forks) can be forgotten.
    pub fn forget_last(&mut self) -> Result<()> {
        if self.len == 0 || self.layers.iter().any(|l| l.used == 0) {
            candle_core::bail!("the last cached token is not in this cache's own buffer");
        }
        for l in &mut self.layers {
            l.used -= 1;
        }
        self.len -= 1;
        Ok(())
    }

    /// The pool row this cache can take one more token in, if it is in `pool`'s row and
    /// every layer still appends there.
    fn row_in(&self, pool: &Arc<KvPool>) -> Option<usize> {
        let (p, row) = self.pooled.as_ref()?;
        let fits = self.len < pool.cap - 1;
        let there = self.layers.iter().all(|l| l.pool_room.is_some());
        (Arc::ptr_eq(p, pool) && fits && there).then_some(*row)
    }
}

/// One layer's cache: frozen shared segments, then this sequence's own growing buffer.
#[derive(Default)]
pub(super) struct LayerKv {
    frozen: Vec<(Tensor, Tensor)>,
    k: Option<Tensor>,
    v: Option<Tensor>,
    used: usize,
    /// While the own buffer is a pool's row: the positions it may fill (the row's last
    /// position is the pool's scratch, written by steps this sequence sits out).
    pool_room: Option<usize>,
}

impl LayerKv {
    /// Appends `[kv_heads, L, d]` keys and values, growing the buffer geometrically.
    pub(super) fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let (nkv, len, d) = k.dims3()?;
        let cap = match (self.pool_room, self.k.as_ref()) {
            (Some(room), _) => room,
            (None, Some(b)) => b.dim(1)?,
            (None, None) => 0,
        };
        if self.used + len > cap {
            let new_cap = (self.used + len).max(2 * cap).max(16);
            let grow = |old: &Option<Tensor>| -> Result<Tensor> {
                let buf = Tensor::zeros((nkv, new_cap, d), k.dtype(), k.device())?;
                if let Some(old) = old
                    && self.used > 0
                {
                    buf.slice_set(&old.narrow(1, 0, self.used)?.contiguous()?, 1, 0)?;
                }
                Ok(buf)
            };
            self.k = Some(grow(&self.k)?);
            self.v = Some(grow(&self.v)?);
            // A buffer of its own now: the pool's row is left behind.
            self.pool_room = None;
        }
        let (kb, vb) = (
            self.k.as_ref().expect("grown"),
            self.v.as_ref().expect("grown"),
        );
        kb.slice_set(k, 1, self.used)?;
        vb.slice_set(v, 1, self.used)?;
        self.used += len;
        Ok(())
    }

    /// Keys and values `[kv_heads, len, d]` in order: the frozen segments, then the own
    /// buffer's filled part.
    pub(super) fn segments(&self) -> Result<Vec<(Tensor, Tensor)>> {
        let mut s = self.frozen.clone();
        if self.used > 0 {
            let (kb, vb) = (
                self.k.as_ref().expect("used"),
                self.v.as_ref().expect("used"),
            );
            s.push((kb.narrow(1, 0, self.used)?, vb.narrow(1, 0, self.used)?));
        }
        Ok(s)
    }

    /// This layer's contents as frozen segments only, sharing the data.
    fn shared(&self) -> LayerKv {
        LayerKv {
            frozen: self.segments().unwrap_or_else(|_| self.frozen.clone()),
            ..LayerKv::default()
        }
    }

    /// Moves the own buffer into the frozen list: nobody writes to it again, so forks can
    /// share it.
    fn freeze(&mut self) {
        if let Ok(all) = self.segments() {
            self.frozen = all;
        }
        self.k = None;
        self.v = None;
        self.used = 0;
        self.pool_room = None;
    }
}

/// One buffer per layer for a batch of decoding sequences, a row each.
pub(super) struct KvPool {
    /// Per layer: keys and values `[rows, kv_heads, cap, d]`.
    layers: Vec<(Tensor, Tensor)>,
    rows: usize,
    /// Positions per row; the last is scratch, where rows a step leaves out write.
    cap: usize,
}

/// Whether decode steps on `device` go through a [`KvPool`]: on a GPU. On the CPU the
/// per-sequence attention has its own kernels and costs no launches.
pub(super) fn pooling(device: &Device) -> bool {
    #[cfg(test)]
    if let Some(forced) = FORCE_POOL.with(|f| f.get()) {
        return forced;
    }
    !device.is_cpu()
}

#[cfg(test)]
thread_local! {
    static FORCE_POOL: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// In tests: runs `f` with decode steps pooled (`true`) or not, whatever the device.
#[cfg(test)]
pub(crate) fn with_pooling<R>(on: bool, f: impl FnOnce() -> R) -> R {
    let before = FORCE_POOL.with(|c| c.replace(Some(on)));
    let r = f();
    FORCE_POOL.with(|c| c.set(before));
    r
}

/// What every layer of one pooled decode step shares.
pub(super) struct PooledStep {
    pool: Arc<KvPool>,
    /// `[rows, kv_heads, 1, d]`: the position each row's new key and value go to.
    index: Tensor,
    /// `[rows, 1, 1, cap]`: 0 where a row's query may look, `MASKED` elsewhere; made at
    /// the first layer that takes the composed attention (none where the kernel runs:
    /// `rows · cap` floats a step not sent to the GPU).
    mask: std::sync::OnceLock<Tensor>,
    /// `[rows]` u32: the positions each row's query sees (its first ones), and the most;
    /// on the host too, for the mask.
    lens: Tensor,
    host_lens: Vec<u32>,
    longest: usize,
    /// Where the batch is not every row in order: for each row, the batch index it takes
    /// its query from (the batch size for a zero row), and for each sequence its row.
    gather: Option<(Tensor, Tensor)>,
}

/// The shape of a model's keys: heads, head size, dtype.
#[derive(Clone, Copy)]
pub(super) struct KvShape {
    pub heads: usize,
    pub dim: usize,
    pub dtype: DType,
}

impl PooledStep {
    /// Readies a decode step (one new token each) of `caches`: in the pool they are all
    /// in, with room; else a new pool with one row per cache, their contents copied in.
    pub(super) fn prepare(
        caches: &mut [&mut KvCache],
        shape: KvShape,
        device: &Device,
    ) -> Result<PooledStep> {
        let reuse = caches
            .first()
            .and_then(|c| c.pooled.clone())
            .and_then(|(pool, _)| {
                let mut seen = vec![false; pool.rows];
                for c in caches.iter() {
                    let row = c.row_in(&pool)?;
                    if std::mem::replace(&mut seen[row], true) {
                        return None;
                    }
                }
                Some(pool)
            });
        let pool = match reuse {
            Some(pool) => pool,
            None => Self::build(caches, shape, device)?,
        };
        let rows: Vec<usize> = caches
            .iter()
            .map(|c| c.pooled.as_ref().expect("pooled above").1)
            .collect();
        let (p, cap) = (pool.rows, pool.cap);
        let mut at = vec![cap - 1; p];
        let mut take = vec![caches.len() as u32; p];
        for (i, (c, &row)) in caches.iter().zip(&rows).enumerate() {
            at[row] = c.len;
            take[row] = i as u32;
        }
        // Each row's position, spread over its heads and dims on the device: an upload of
        // `rows` numbers, not `rows · heads · dim` (64 KiB a step for 64 rows of the 1.5B
        // shape, too many for candle's upload cache that a captured step reads from).
        let positions: Vec<u32> = at.iter().map(|&a| a as u32).collect();
        let index = Tensor::from_vec(positions, (p, 1, 1, 1), device)?
            .broadcast_as((p, shape.heads, 1, shape.dim))?
            .contiguous()?;
        // A row's query sees positions up to and including its new token; a row left out
        // sees its first position only (anything finite: its output is dropped).
        let lens: Vec<u32> = at
            .iter()
            .map(|&a| if a == cap - 1 { 1 } else { a as u32 + 1 })
            .collect();
        let longest = lens.iter().copied().max().unwrap_or(1) as usize;
        let host_lens = lens.clone();
        let lens = Tensor::from_vec(lens, p, device)?;
        let in_order = rows.len() == p && rows.iter().enumerate().all(|(i, &r)| i == r);
        let gather = if in_order {
            None
        } else {
            let rows: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            Some((
                Tensor::from_vec(take, p, device)?,
                Tensor::from_vec(rows, caches.len(), device)?,
            ))
        };
        Ok(PooledStep {
            pool,
            index,
            mask: std::sync::OnceLock::new(),
            lens,
            host_lens,
            longest,
            gather,
        })
    }

    /// A pool with a row per cache, each holding that cache's keys and values, with room
    /// to grow by half again; each cache's own buffers become views of its row.
    fn build(caches: &mut [&mut KvCache], shape: KvShape, device: &Device) -> Result<Arc<KvPool>> {
        let rows = caches.len();
        let longest = caches.iter().map(|c| c.len).max().unwrap_or(0);
        let cap = ((longest + 2) * 3 / 2).next_multiple_of(64);
        let layers = caches.first().map_or(0, |c| c.layers.len());
        let mut buffers = Vec::with_capacity(layers);
        for l in 0..layers {
            let dims = (rows, shape.heads, cap, shape.dim);
            let (kb, vb) = (
                Tensor::zeros(dims, shape.dtype, device)?,
                Tensor::zeros(dims, shape.dtype, device)?,
            );
            for (row, c) in caches.iter().enumerate() {
                let (krow, vrow) = (kb.get(row)?, vb.get(row)?);
                let mut at = 0;
                for (k, v) in c.layers[l].segments()? {
                    krow.slice_set(&k.contiguous()?, 1, at)?;
                    vrow.slice_set(&v.contiguous()?, 1, at)?;
                    at += k.dim(1)?;
                }
            }
            buffers.push((kb, vb));
        }
        let pool = Arc::new(KvPool {
            layers: buffers,
            rows,
            cap,
        });
        for (row, c) in caches.iter_mut().enumerate() {
            for (l, layer) in c.layers.iter_mut().enumerate() {
                let (kb, vb) = &pool.layers[l];
                *layer = LayerKv {
                    frozen: Vec::new(),
                    k: Some(kb.get(row)?),
                    v: Some(vb.get(row)?),
                    used: c.len,
                    pool_room: Some(cap - 1),
                };
            }
            c.pooled = Some((pool.clone(), row));
        }
        Ok(pool)
    }

    /// One layer's attention for the step: `q: [B, heads, 1, d]`, `k`, `v: [B, kv_heads,
    /// 1, d]` (the batch in the order of the caches); returns `[B, heads·d]`.
    pub(super) fn attend(
        &self,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
    ) -> Result<Tensor> {
        let (n, nh, _, d) = q.dims4()?;
        let nkv = k.dim(1)?;
        let rows = |t: &Tensor| -> Result<Tensor> {
            match &self.gather {
                None => t.contiguous(),
                Some((take, _)) => {
                    let zero = t.narrow(0, 0, 1)?.zeros_like()?;
                    Tensor::cat(&[t, &zero], 0)?.index_select(take, 0)
                }
            }
        };
        let (q, k, v) = (rows(q)?, rows(k)?, rows(v)?);
        let (kb, vb) = &self.pool.layers[layer];
        kb.scatter_set(&self.index, &k, 2)?;
        vb.scatter_set(&self.index, &v, 2)?;
        let p = self.pool.rows;
        // The query heads of each kv head as rows: `[P, kv_heads, n_rep, d]`.
        let q = q.reshape((p, nkv, nh / nkv, d))?;
        let mask = || self.mask(kb.device());
        let out = decode_attention(&q, kb, vb, mask, &self.lens, self.longest, scale)?
            .reshape((p, nh * d))?;
        match &self.gather {
            None => Ok(out),
            Some((_, rows)) => {
                let out = out.index_select(rows, 0)?;
                debug_assert_eq!(out.dim(0)?, n);
                Ok(out)
            }
        }
    }

    /// The step's additive mask, made once.
    fn mask(&self, device: &Device) -> Result<Tensor> {
        if let Some(m) = self.mask.get() {
            return Ok(m.clone());
        }
        let m = decode_mask(&self.host_lens, self.pool.cap, device)?;
        Ok(self.mask.get_or_init(|| m).clone())
    }

    /// Records the step's token in every layer of every cache.
    pub(super) fn finish(&self, caches: &mut [&mut KvCache]) {
        for c in caches.iter_mut() {
            for l in &mut c.layers {
                l.used += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Mode;
    use crate::model::fixtures::{self, Reference, max_diff};

    /// One script of cache operations (prefill, fork, decode steps of all and of some,
    /// tokens inserted between steps, a fork of a pooled cache, decoding on past a row's
    /// room) gives the same logits with decode steps pooled as sequence by sequence, and
    /// the pooled run really ran its steps in one pool.
    #[test]
    fn pooled_decode_follows_the_per_sequence_path() {
        let model = fixtures::load("qwen2");
        let r = Reference::load("qwen2");
        let rows = r.rows();
        let vocab = model.cfg.vocab_size as u32;
        let script = |pooled: bool| -> Vec<Tensor> {
            with_pooling(pooled, || {
                let mut out = Vec::new();
                let mut caches: Vec<KvCache> = Vec::new();
                for row in rows.iter().take(2) {
                    let mut c = model.new_cache();
                    out.push(
                        model
                            .forward_cached(&mut [&mut c], &[row], Mode::BASE, false)
                            .unwrap(),
                    );
                    caches.push(c);
                }
                let mut c = model.new_cache();
                out.push(
                    model
                        .forward_cached(&mut [&mut c], &[&rows[0][..3]], Mode::BASE, false)
                        .unwrap(),
                );
                caches.push(c);
                let forked = caches[0].fork();
                caches.push(forked);
                let mut step = 0u32;
                let mut decode =
                    |caches: &mut Vec<KvCache>, which: &[usize], out: &mut Vec<Tensor>| {
                        step += 1;
                        let toks: Vec<[u32; 1]> = which
                            .iter()
                            .map(|&i| [(step * 7 + i as u32 * 13) % vocab])
                            .collect();
                        let toks: Vec<&[u32]> = toks.iter().map(|t| t.as_slice()).collect();
                        let mut refs: Vec<&mut KvCache> = caches
                            .iter_mut()
                            .enumerate()
                            .filter(|(i, _)| which.contains(i))
                            .map(|(_, c)| c)
                            .collect();
                        out.push(
                            model
                                .forward_cached(&mut refs, &toks, Mode::BASE, false)
                                .unwrap(),
                        );
                    };
                for _ in 0..5 {
                    decode(&mut caches, &[0, 1, 2, 3], &mut out);
                }
                for _ in 0..3 {
                    decode(&mut caches, &[0, 2, 3], &mut out);
                }
                // Inserted tokens (a tool's output) on a cache in the pool.
                out.push(
                    model
                        .forward_cached(&mut [&mut caches[1]], &[&[5, 6, 7]], Mode::BASE, true)
                        .unwrap(),
                );
                for _ in 0..3 {
                    decode(&mut caches, &[3, 2, 1, 0], &mut out);
                }
                let forked = caches[2].fork();
                caches.push(forked);
                for _ in 0..70 {
                    decode(&mut caches, &[0, 1, 2, 3, 4], &mut out);
                }
                if pooled {
                    let (first, _) = caches[0].pooled.clone().expect("pooled");
                    for c in &caches {
                        let (p, _) = c.pooled.as_ref().expect("every cache pooled");
                        assert!(Arc::ptr_eq(p, &first), "one pool for the batch");
                    }
                    assert!(first.cap > 64, "the pool grew past its first room");
                }
                out
            })
        };
        let (plain, pooled) = (script(false), script(true));
        assert_eq!(plain.len(), pooled.len());
        let worst = plain
            .iter()
            .zip(&pooled)
            .map(|(a, b)| max_diff(a, b))
            .fold(0f32, f32::max);
        eprintln!("pooled vs per-sequence decode, max abs diff {worst:.2e}");
        assert!(worst <= 1e-4, "pooled decode moved the logits by {worst}");
    }

    /// A copy shares the data and never writes where the original reads.
    #[test]
    fn a_clone_appends_to_buffers_of_its_own() {
        let model = fixtures::load("qwen2");
        let r = Reference::load("qwen2");
        let row = &r.rows()[0];
        let mut a = model.new_cache();
        model
            .forward_cached(&mut [&mut a], &[&row[..4]], Mode::BASE, false)
            .unwrap();
        let mut b = a.clone();
        let next = |c: &mut KvCache, t: u32| {
            model
                .forward_cached(&mut [c], &[&[t]], Mode::BASE, false)
                .unwrap()
        };
        let (a1, b1) = (next(&mut a, 3), next(&mut b, 9));
        let mut c = model.new_cache();
        model
            .forward_cached(&mut [&mut c], &[&row[..4]], Mode::BASE, false)
            .unwrap();
        assert!(max_diff(&next(&mut c, 3), &a1) <= 1e-6);
        assert!(
            max_diff(&a1, &b1) > 1e-3,
            "different tokens, different logits"
        );
        assert_eq!((a.len(), b.len()), (5, 5));
    }
}
