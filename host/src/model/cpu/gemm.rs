//! `C = A · B` in f32 for the training step's large products, AVX-512 or AVX2/FMA,
//! BLIS-style.
//!
//! candle's CPU matmul (the `gemm` crate) reached 90–131 GFLOPS on the products of a
//! 0.5B-shaped LoRA step on a 2-core AVX2 machine whose FMA peak is ~182 GFLOPS, 170–195
//! on a 2-core AVX-512 Xeon whose peak is ~440 (`examples/gemm_probe.rs`), and it
//! re-packs the frozen weight for every call: the 151,936-row output head in 52-row chunks
//! ran at 90. This is the textbook blocking (Goto & van de Geijn; BLIS's Haswell and
//! Skylake-X parameters): B is packed in 4 MB panels (`KC × NC`, or several KC blocks deep
//! where k is small) of 32-column strips that stay in L3, A in `MC × KC` blocks of 12-row
//! strips that stay in L2, and a 12×32 register tile runs over a `KC`-long product with
//! one B strip in L1: 24 zmm accumulators with AVX-512, or four 6×16 quarters in 12 ymm
//! each with AVX2 ([`tile`](mod@tile)). Threads split the rows of C (or its columns when there are
//! few rows) and share each packed B panel.
//!
//! Operands are strided views, so `x W^T` (W `[out, in]`, read across its rows) and
//! `g W` (read along them) both run without copying W. Used only where AVX2 and FMA are
//! present ([`super::gemv::available`]); callers fall back to candle otherwise.

use rayon::prelude::*;

mod tile;

use tile::{Tail, Tile, isa, tile};

/// Rows of the register tile (AVX-512; the AVX2 kernel runs it as two halves of
/// [`MR2`]).
const MR: usize = 12;
/// Rows of the AVX2 kernel's tile.
const MR2: usize = 6;
/// Columns of the register tile and of a packed B strip: two zmm (AVX-512), or two
/// 16-column halves of two ymm each, one after the other (AVX2).
const NR: usize = 32;
/// Depth of one packed panel: a 32 KB B strip in L1 (48 KB here; the AVX2 kernel reads
/// one 16 KB half of it at a time).
const KC: usize = 256;
/// Rows of a packed A block: 144 × 256 × 4 = 147 KB, in L2 (512 KB per core or more).
const MC: usize = 144;
/// Most columns of a packed B panel: 4096 × 256 × 4 = 4 MB, in L3.
const NC: usize = 4096;
/// Floats in a packed B panel (4 MB, in L3): `KC × NC`, or fewer columns and more
/// depth (several KC blocks) where k is small, see [`panel_shape`].
const PANEL: usize = KC * NC;
/// Fewest columns of a panel chosen for its depth: the narrower it is, the more often
/// A is read again (once per panel).
const NC_MIN: usize = 1024;

/// Tasks per thread in each panel's parallel loop: on a shared VM one thread is often
/// slowed for a while, and with one task per thread the other then idles at the join
/// (the step's q, gate, down and backward products, 2 threads, best of 7: mean 130–138
/// GFLOPS with 1 task per thread, 140–146 with 4).
const TASKS_PER_THREAD: usize = 4;

/// A read-only matrix view: element `(r, c)` is `data[r * rs + c * cs]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major `[rows, cols]` matrix.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> MatRef<'a> {
        MatRef {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose (no copy).
    pub fn t(self) -> MatRef<'a> {
        MatRef {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Columns `c0..c1` (no copy).
    pub fn cols_range(self, c0: usize, c1: usize) -> MatRef<'a> {
        assert!(c0 <= c1 && c1 <= self.cols, "gemm: columns out of range");
        MatRef {
            data: if c1 > c0 {
                &self.data[c0 * self.cs..]
            } else {
                &[]
            },
            cols: c1 - c0,
            ..self
        }
    }

    fn in_bounds(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.rs + (self.cols - 1) * self.cs < self.data.len()
    }
}

/// `c = a · b` (or `c += a · b` with `accumulate`), `c` row-major `[a.rows, b.cols]` with row
/// stride `ldc`. Panics on mismatched shapes, out-of-bounds views, or if called where
/// [`super::gemv::available`] is false.
pub fn gemm(a: MatRef, b: MatRef, c: &mut [f32], ldc: usize, accumulate: bool) {
    let (m, n) = (a.rows, b.cols);
    assert!(
        ldc >= n && (m == 0 || (m - 1) * ldc + n <= c.len()),
        "gemm: c too small"
    );
    // SAFETY: `c` holds the `m` rows of `n` at stride `ldc` (asserted) and is initialised.
    unsafe { gemm_to(a, b, c.as_mut_ptr(), ldc, accumulate) }
}

/// [`gemm`] plus an optional low-rank `tail` product (`a2 · b2`, see [`product_plus`]; `a`
/// and `a2` row-major): `c = a · b + a2 · b2` or `+=` with `accumulate`, at row stride
/// `ldc`. For products built a block of columns (or of depth) at a time, as NF4 weights
/// are.
pub fn gemm_plus(
    a: MatRef,
    b: MatRef,
    tail: Option<(MatRef, MatRef)>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    let (m, n) = (a.rows, b.cols);
    assert!(
        ldc >= n && (m == 0 || (m - 1) * ldc + n <= c.len()),
        "gemm: c too small"
    );
    // SAFETY: `c` holds the `m` rows of `n` at stride `ldc` (asserted) and is initialised;
    // `gemm_tail` checks the tail's shapes and layout.
    unsafe {
        match tail {
            Some(t) if a.cols > 0 && a.cs == 1 && t.0.cs == 1 => {
                gemm_tail(a, b, Some(t), c.as_mut_ptr(), ldc, accumulate)
            }
            Some((a2, b2)) => {
                assert!(a2.rows == m && b2.cols == n, "gemm: tail does not fit");
                gemm_to(a, b, c.as_mut_ptr(), ldc, accumulate);
                gemm_to(a2, b2, c.as_mut_ptr(), ldc, true);
            }
            None => gemm_to(a, b, c.as_mut_ptr(), ldc, accumulate),
        }
    }
}

/// `a · b` as a new row-major `[a.rows, b.cols]` buffer. Not zeroed first: the product
/// writes every element (a zeroed allocation was a single-threaded `memset` of up to
/// 20 MB per projection, on a path where the other core then waits).
pub fn product(a: MatRef, b: MatRef) -> Vec<f32> {
    let len = a.rows * b.cols;
    let mut c = Vec::with_capacity(len);
    // SAFETY: the buffer has room for `len` floats; without `accumulate` every element of
    // the `[rows, cols]` result is written (and none read) before `set_len`.
    unsafe {
        gemm_to(a, b, c.as_mut_ptr(), b.cols, false);
        c.set_len(len);
    }
    c
}

/// `a · b + a2 · b2` as a new row-major buffer, for a low-rank term (`a2` with few
/// columns, LoRA's): when `a` and `a2` are row-major its steps run in the register tiles
/// of `a · b`'s last block, so C is not read and written once more for it (the separate
/// accumulating product was a pass over up to 20 MB per projection).
pub fn product_plus(a: MatRef, b: MatRef, a2: MatRef, b2: MatRef) -> Vec<f32> {
    assert!(
        a2.rows == a.rows && b2.cols == b.cols && a2.cols == b2.rows,
        "gemm: tail does not fit"
    );
    let len = a.rows * b.cols;
    let mut c = Vec::with_capacity(len);
    // SAFETY: as in `product`; the tail only adds to what the first block wrote.
    unsafe {
        plus_to(a, b, a2, b2, c.as_mut_ptr(), false);
        c.set_len(len);
    }
    c
}

/// [`product_plus`] into `c` (row-major `[a.rows, b.cols]`), or added to it with
/// `accumulate`.
pub fn product_plus_into(
    a: MatRef,
    b: MatRef,
    a2: MatRef,
    b2: MatRef,
    c: &mut [f32],
    accumulate: bool,
) {
    assert!(
        a2.rows == a.rows && b2.cols == b.cols && a2.cols == b2.rows,
        "gemm: tail does not fit"
    );
    assert_eq!(c.len(), a.rows * b.cols, "gemm: c does not fit");
    // SAFETY: `c` holds the `[a.rows, b.cols]` result and is initialised.
    unsafe { plus_to(a, b, a2, b2, c.as_mut_ptr(), accumulate) }
}

/// `c = a · b + a2 · b2` (`+=` with `accumulate`) for row-major `c` of `a.rows × b.cols`
/// floats, initialised when `accumulate`.
unsafe fn plus_to(a: MatRef, b: MatRef, a2: MatRef, b2: MatRef, c: *mut f32, acc: bool) {
    // SAFETY: the same contract as `gemm_to`, twice.
    unsafe {
        if a.cols > 0 && a.cs == 1 && a2.cs == 1 {
            gemm_tail(a, b, Some((a2, b2)), c, b.cols, acc);
        } else {
            gemm_to(a, b, c, b.cols, acc);
            gemm_to(a2, b2, c, b.cols, true);
        }
    }
}

/// [`gemm`] into `c`, which must be valid for `a.rows` rows of `b.cols` floats at stride
/// `ldc`, and initialised there when `accumulate`.
unsafe fn gemm_to(a: MatRef, b: MatRef, c: *mut f32, ldc: usize, accumulate: bool) {
    // SAFETY: the same contract.
    unsafe { gemm_tail(a, b, None, c, ldc, accumulate) }
}

/// [`gemm_to`] plus `tail`'s product (`a2 · b2`, both row-major A and `a` with `k > 0`),
/// whose steps the last block's tiles run before they store C.
unsafe fn gemm_tail(
    a: MatRef,
    b: MatRef,
    tail: Option<(MatRef, MatRef)>,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(super::gemv::available(), "gemm: needs AVX2 and FMA");
    assert_eq!(b.rows, k, "gemm: inner dimensions differ");
    assert!(a.in_bounds() && b.in_bounds(), "gemm: view out of bounds");
    assert!(ldc >= n, "gemm: c too small");
    if let Some((a2, b2)) = tail {
        assert!(
            k > 0 && a.cs == 1 && a2.cs == 1 && a2.in_bounds() && b2.in_bounds(),
            "gemm: tail needs row-major A"
        );
        assert!(
            a2.rows == m && b2.cols == n && a2.cols == b2.rows,
            "gemm: tail does not fit"
        );
    }
    let r = tail.map_or(0, |(a2, _)| a2.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                // SAFETY: row `i` of `c` holds `n` floats (the contract).
                unsafe { std::ptr::write_bytes(c.add(i * ldc), 0, n) };
            }
        }
        return;
    }
    let threads = rayon::current_num_threads().max(1);
    let isa = isa();
    let c_ptr = SendPtr(c);
    let mut bp = B_PANELS
        .lock()
        .map(|mut free| free.pop())
        .ok()
        .flatten()
        .unwrap_or_else(|| Aligned::new(0));
    let (nc_max, kg_max) = panel_shape(k, n);
    bp.get(nc_max.next_multiple_of(NR) * (kg_max + r));
    let tail_a = tail.map(|(a2, _)| a2);
    for jc in (0..n).step_by(nc_max) {
        let nc = nc_max.min(n - jc);
        let strips = nc.div_ceil(NR);
        for pg in (0..k).step_by(kg_max) {
            let kg = kg_max.min(k - pg);
            // The group's KC blocks, each `strips` strips of its depth; the block that ends
            // k carries the tail's `r` steps after its own in each strip.
            let blocks = || {
                (pg..pg + kg).step_by(KC).map(move |pc| {
                    let kc = KC.min(k - pc);
                    let tr = if pc + kc == k { r } else { 0 };
                    (pc, kc, tr, (pc - pg) * strips * NR)
                })
            };
            let panel_len = strips * (kg + if pg + kg == k { r } else { 0 }) * NR;
            let panel = &mut bp.as_mut()[..panel_len];
            // Every (block, strip) of the group packs in one parallel loop.
            let mut jobs = Vec::with_capacity(kg.div_ceil(KC) * strips);
            let mut rest = &mut *panel;
            for (pc, kc, tr, _) in blocks() {
                let (block, after) = rest.split_at_mut(strips * (kc + tr) * NR);
                rest = after;
                jobs.extend(
                    block
                        .chunks_exact_mut((kc + tr) * NR)
                        .enumerate()
                        .map(|(s, strip)| (pc, kc, tr, s, strip)),
                );
            }
            jobs.into_par_iter().for_each(|(pc, kc, tr, s, strip)| {
                let (col, nr) = (jc + s * NR, NR.min(nc - s * NR));
                let (own, rest) = strip.split_at_mut(kc * NR);
                pack_b(b, pc, kc, col, nr, own);
                if let Some((_, b2)) = tail.filter(|_| tr > 0) {
                    pack_b(b2, 0, tr, col, nr, rest);
                }
            });
            let panel = &*panel;
            // Few rows: split the strips of the panel instead, so every thread has work.
            let by_rows = m >= threads * MR * 4;
            let tasks =
                (threads * TASKS_PER_THREAD).min(if by_rows { m.div_ceil(MR) } else { strips });
            (0..tasks).into_par_iter().for_each(|t| {
                let (r0, r1, s0, s1) = if by_rows {
                    let per = m.div_ceil(MR).div_ceil(tasks) * MR;
                    ((t * per).min(m), ((t + 1) * per).min(m), 0, strips)
                } else {
                    let per = strips.div_ceil(tasks);
                    (0, m, (t * per).min(strips), ((t + 1) * per).min(strips))
                };
                if r0 >= r1 || s0 >= s1 {
                    return;
                }
                // Row-major A is read in place (6 row streams); other layouts are packed.
                let direct = a.cs == 1;
                A_BLOCK.with(|buf| {
                    let mut buf = buf.borrow_mut();
                    let ap = buf.get(if direct { 0 } else { MC * KC });
                    // Each row block of C runs through the whole group before the next, so
                    // its tiles come back from L2 or L3 for each KC block, not from memory.
                    for ic in (r0..r1).step_by(MC) {
                        let mc = MC.min(r1 - ic);
                        for (pc, kc, tr, offset) in blocks() {
                            let depth = kc + tr;
                            let add = accumulate || pc > 0;
                            if !direct {
                                pack_a(a, ic, mc, pc, kc, ap);
                            }
                            for s in s0..s1 {
                                let col = jc + s * NR;
                                let nr = NR.min(jc + nc - col);
                                let b_strip =
                                    &panel[offset + s * depth * NR..offset + (s + 1) * depth * NR];
                                for i in 0..mc.div_ceil(MR) {
                                    let row = ic + i * MR;
                                    let mr = MR.min(r1 - row);
                                    let c_tile = c_ptr.get().wrapping_add(row * ldc + col);
                                    // SAFETY: `isa`'s features checked above; the tile `[row..row+mr,
                                    // col..col+nr]` is inside `c` (asserted) and only this
                                    // task writes those rows (by_rows) or columns (strips);
                                    // A's rows `row..row+mr` from column `pc` hold `kc`
                                    // elements (in_bounds), as does a packed strip.
                                    unsafe {
                                        let t = Tile {
                                            kc,
                                            a: ap.as_ptr().add(i * MR * kc),
                                            lda: 0,
                                            b: b_strip,
                                            c: c_tile,
                                            ldc,
                                            mr,
                                            nr,
                                            add,
                                            tail: None,
                                        };
                                        if direct {
                                            let tail = tail_a.filter(|_| tr > 0).map(|a2| Tail {
                                                a: a2.data.as_ptr().add(row * a2.rs),
                                                lda: a2.rs,
                                                steps: tr,
                                            });
                                            let a0 = a.data.as_ptr().add(row * a.rs + pc);
                                            let t = Tile {
                                                a: a0,
                                                lda: a.rs,
                                                tail,
                                                ..t
                                            };
                                            tile::<true>(isa, t)
                                        } else {
                                            tile::<false>(isa, t)
                                        }
                                    }
                                }
                            }
                        }
                    }
                });
            });
        }
    }
    if let Ok(mut free) = B_PANELS.lock() {
        free.push(bp);
    }
}

/// Columns and depth (a multiple of KC, or all of k) of the B panels for a `k × n` B: as
/// deep as [`PANEL`] allows at [`NC_MIN`] columns or more, with the columns split evenly.
///
/// Why deep: C's tiles are read and written once per KC block of a panel. With k = 896 and
/// `KC × NC` panels, the 20 MB C of a `[1024, 4864]` product (the gate and up projections,
/// the down projection's backward) went to memory and back four times; with the panel's
/// depth all of k, each row block of C is done before the next starts and comes back from
/// L2 or L3 between blocks. Deeper panels are also fewer parallel loops to join.
fn panel_shape(k: usize, n: usize) -> (usize, usize) {
    let cols = (PANEL / k.max(1)).clamp(NC_MIN, NC);
    let panels = n.div_ceil(cols);
    let nc = if panels == 1 {
        n
    } else {
        n.div_ceil(panels).next_multiple_of(NR)
    };
    let fit = PANEL / nc.next_multiple_of(NR);
    let kg = if k <= fit { k } else { (fit / KC).max(1) * KC };
    (nc, kg)
}

/// B packed once for several [`gemm_packed`] calls: every `KC`-deep block of `NR`-column
/// strips (zero-padded to whole strips), block `pc` at `pc * strips * NR`.
pub struct PackedB {
    data: Vec<f32>,
    k: usize,
    n: usize,
}

impl PackedB {
    /// Packs `b` (any layout); panics where [`super::gemv::available`] is false.
    pub fn new(b: MatRef) -> PackedB {
        assert!(super::gemv::available(), "gemm: needs AVX2 and FMA");
        assert!(b.in_bounds(), "gemm: view out of bounds");
        let (k, n) = (b.rows, b.cols);
        let strips = n.div_ceil(NR);
        let mut data = vec![0f32; k * strips * NR];
        for pc in (0..k).step_by(KC) {
            let kc = KC.min(k - pc);
            let block = &mut data[pc * strips * NR..(pc + kc) * strips * NR];
            for (s, strip) in block.chunks_exact_mut(kc * NR).enumerate() {
                pack_b(b, pc, kc, s * NR, NR.min(n - s * NR), strip);
            }
        }
        PackedB { data, k, n }
    }
}

/// The part of a product that a tile of rows `row..row + mr` of C needs, where whole
/// blocks of an operand are known zero or unused (causal attention).
#[derive(Clone, Copy)]
pub enum Band<'f> {
    /// All of it.
    Full,
    /// Only C's columns `..f(row, mr)`; the others may be left unwritten.
    Cols(&'f (dyn Fn(usize, usize) -> usize + Sync)),
    /// A's rows are zero outside columns `f(row, mr)`, so only that part of k is summed.
    Depth(&'f (dyn Fn(usize, usize) -> std::ops::Range<usize> + Sync)),
}

/// `c = a · b` (or `+=`) on the calling thread with a pre-packed B, for products small
/// enough to run many at once in parallel (attention heads), skipping what `band` allows.
/// Panics like [`gemm`].
pub fn gemm_packed(
    a: MatRef,
    b: &PackedB,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    band: Band,
) {
    let (m, k, n) = (a.rows, a.cols, b.n);
    assert!(super::gemv::available(), "gemm: needs AVX2 and FMA");
    assert_eq!(b.k, k, "gemm: inner dimensions differ");
    assert!(a.in_bounds(), "gemm: view out of bounds");
    assert!(
        ldc >= n && (m == 0 || (m - 1) * ldc + n <= c.len()),
        "gemm: c too small"
    );
    let strips = n.div_ceil(NR);
    let direct = a.cs == 1;
    let isa = isa();
    let mut a_strip = [0f32; MR * KC];
    // k == 0 still runs one (empty) block, so that C is written.
    for pc in (0..k.max(1)).step_by(KC) {
        let kc = KC.min(k - pc);
        let block = &b.data[pc * strips * NR..(pc + kc) * strips * NR];
        let add = accumulate || pc > 0;
        for row in (0..m).step_by(MR) {
            let mr = MR.min(m - row);
            let (k0, k1) = match band {
                Band::Depth(f) => {
                    let r = f(row, mr);
                    let k1 = r.end.clamp(pc, pc + kc);
                    (r.start.max(pc).min(k1), k1)
                }
                _ => (pc, pc + kc),
            };
            let cols = match band {
                Band::Cols(f) => f(row, mr).min(n),
                _ => n,
            };
            if !direct && k1 > k0 {
                pack_strip(a, row, mr, k0, k1 - k0, MR, &mut a_strip[..MR * (k1 - k0)]);
            }
            for s in 0..cols.div_ceil(NR) {
                let col = s * NR;
                let b_strip = &block[s * kc * NR + (k0 - pc) * NR..(s + 1) * kc * NR];
                let c_tile = c.as_mut_ptr().wrapping_add(row * ldc + col);
                // SAFETY: `isa`'s features checked above; the tile `[row..row+mr, col..col+nr]` is
                // inside `c` (asserted, nr ≤ n - col); A's rows from column k0 hold k1 - k0
                // elements (in_bounds), as do the packed strips.
                unsafe {
                    let t = Tile {
                        kc: k1 - k0,
                        a: a_strip.as_ptr(),
                        lda: 0,
                        b: b_strip,
                        c: c_tile,
                        ldc,
                        mr,
                        nr: NR.min(cols - col),
                        add,
                        tail: None,
                    };
                    if direct {
                        let a0 = a.data.as_ptr().add(row * a.rs + k0);
                        tile::<true>(
                            isa,
                            Tile {
                                a: a0,
                                lda: a.rs,
                                ..t
                            },
                        )
                    } else {
                        tile::<false>(isa, t)
                    }
                }
            }
        }
    }
}

/// Whether the gemm-based training ops apply: AVX2/FMA, and `x` and the frozen `w` f32 on
/// the CPU with `w` contiguous.
pub fn applies(x: &candle_core::Tensor, w: &candle_core::Tensor) -> bool {
    super::gemv::available()
        && x.device().is_cpu()
        && x.dtype() == candle_core::DType::F32
        && w.dtype() == candle_core::DType::F32
        && w.is_contiguous()
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);

impl SendPtr {
    // A method, so that closures capture the wrapper (which is Sync), not the raw field.
    fn get(self) -> *mut f32 {
        self.0
    }
}
// SAFETY: tasks write disjoint tiles of `c` (see `gemm`), which outlives the parallel loop.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// A 64-byte aligned f32 buffer (a packed strip starts on a cache line).
struct Aligned {
    buf: Vec<f32>,
    offset: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let buf = vec![0f32; len + 16];
        let offset = buf.as_ptr().align_offset(64).min(16);
        Aligned { buf, offset, len }
    }

    fn as_mut(&mut self) -> &mut [f32] {
        &mut self.buf[self.offset..self.offset + self.len]
    }

    /// At least `len` floats, growing if needed.
    fn get(&mut self, len: usize) -> &mut [f32] {
        if self.len < len {
            *self = Aligned::new(len);
        }
        self.as_mut()
    }
}

/// Packed B panels (about 4 MB) kept for the next call instead of a fresh zeroed
/// allocation each time (a step makes about a thousand calls). A free list rather than a
/// thread-local: a thread waiting inside `gemm`'s parallel loop may run another task
/// that calls `gemm` again.
static B_PANELS: std::sync::Mutex<Vec<Aligned>> = std::sync::Mutex::new(Vec::new());

thread_local! {
    /// Each thread's packed A block, kept between calls.
    static A_BLOCK: std::cell::RefCell<Aligned> = std::cell::RefCell::new(Aligned::new(0));
}

/// Packs `b[pc..pc+kc, col..col+nr]` as `strip[p * NR + j]`, zero beyond `nr`.
fn pack_b(b: MatRef, pc: usize, kc: usize, col: usize, nr: usize, strip: &mut [f32]) {
    pack_strip(b.t(), col, nr, pc, kc, NR, strip);
}

/// Packs `a[ic..ic+mc, pc..pc+kc]` as strips of `MR` rows, `strip[p * MR + i]`, zero beyond
/// `mc`.
fn pack_a(a: MatRef, ic: usize, mc: usize, pc: usize, kc: usize, out: &mut [f32]) {
    for (s, strip) in out[..mc.div_ceil(MR) * MR * kc]
        .chunks_exact_mut(MR * kc)
        .enumerate()
    {
        let r0 = ic + s * MR;
        pack_strip(a, r0, MR.min(ic + mc - r0), pc, kc, MR, strip);
    }
}

/// `strip[p * width + i] = m[r0 + i, pc + p]` for `i < rows`, zero for `rows ≤ i < width`.
fn pack_strip(
    m: MatRef,
    r0: usize,
    rows: usize,
    pc: usize,
    kc: usize,
    width: usize,
    strip: &mut [f32],
) {
    if rows < width {
        strip.fill(0.0);
    }
    if m.rs == 1 && rows == width && width == NR {
        copy_steps::<NR>(m, r0, pc, kc, strip);
    } else if m.rs == 1 && rows == width && width == MR {
        copy_steps::<MR>(m, r0, pc, kc, strip);
    } else if m.rs == 1 {
        // The strip's rows are adjacent at each step: one copy per step.
        for p in 0..kc {
            let base = r0 + (pc + p) * m.cs;
            strip[p * width..p * width + rows].copy_from_slice(&m.data[base..base + rows]);
        }
    } else if m.cs == 1 && rows == width && width.is_multiple_of(8) {
        // Full strip of contiguous rows (the weight in `x W^T`): 8×8 register transposes,
        // several times faster than the element-by-element scatter below.
        let full = kc - kc % 8;
        for i0 in (0..rows).step_by(8) {
            let base = (r0 + i0) * m.rs + pc;
            for p in (0..full).step_by(8) {
                // SAFETY: AVX2 is checked by `gemm`; rows `r0+i0..+8` hold columns
                // `pc+p..+8` (in_bounds), and the strip holds step `p+7`'s columns
                // `i0..i0+8` (`width` floats per step, `kc` steps).
                unsafe {
                    transpose8(
                        m.data.as_ptr().add(base + p),
                        m.rs,
                        strip.as_mut_ptr().add(p * width + i0),
                        width,
                    )
                };
            }
            for i in i0..i0 + 8 {
                let row = (r0 + i) * m.rs + pc;
                for p in full..kc {
                    strip[p * width + i] = m.data[row + p];
                }
            }
        }
    } else {
        // Each row is a run along m's columns (contiguous when cs == 1).
        for i in 0..rows {
            let base = (r0 + i) * m.rs + pc * m.cs;
            for p in 0..kc {
                strip[p * width + i] = m.data[base + p * m.cs];
            }
        }
    }
}

/// `strip[p * W + i] = m[r0 + i, pc + p]` for a full strip whose rows are adjacent in `m`
/// (`m.rs == 1`): a fixed-size copy per step, which compiles to vector moves where a
/// `rows`-long one was a `memcpy` call per 64 bytes (most of the packing time).
fn copy_steps<const W: usize>(m: MatRef, r0: usize, pc: usize, kc: usize, strip: &mut [f32]) {
    for (p, dst) in strip[..kc * W].chunks_exact_mut(W).enumerate() {
        let base = r0 + (pc + p) * m.cs;
        let src: &[f32; W] = m.data[base..base + W]
            .try_into()
            .expect("a slice of W elements");
        dst.copy_from_slice(src);
    }
}

/// Writes the transpose of the 8×8 block at `src` (row stride `lds`) to `dst` (row stride
/// `ldd`): `dst[j * ldd + i] = src[i * lds + j]`.
///
/// # Safety
/// AVX2 must be available; both blocks must be valid for 8 rows of 8 floats.
#[target_feature(enable = "avx2")]
unsafe fn transpose8(src: *const f32, lds: usize, dst: *mut f32, ldd: usize) {
    use std::arch::x86_64::*;
    // SAFETY: per the contract above.
    unsafe {
        let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * lds)));
        // Interleave pairs of rows, then pairs of pairs, then swap 128-bit halves.
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        let out = [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ];
        for (j, v) in out.into_iter().enumerate() {
            _mm256_storeu_ps(dst.add(j * ldd), v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::tile::Isa;
    use super::*;

    thread_local! {
        /// The kernel that products started on this thread use, where a test chose one.
        pub(super) static FORCE_ISA: std::cell::Cell<Option<Isa>> = const { std::cell::Cell::new(None) };
    }

    /// Runs `check` once with each kernel this machine has.
    fn each_isa(check: impl Fn()) {
        let mut isas = vec![Isa::Avx2];
        if std::is_x86_feature_detected!("avx512f") {
            isas.push(Isa::Avx512);
        }
        for isa in isas {
            FORCE_ISA.set(Some(isa));
            check();
        }
        FORCE_ISA.set(None);
    }

    fn naive(a: MatRef, b: MatRef) -> Vec<f32> {
        let mut c = vec![0f32; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                let mut s = 0f64;
                for p in 0..a.cols {
                    s += a.data[i * a.rs + p * a.cs] as f64 * b.data[p * b.rs + j * b.cs] as f64;
                }
                c[i * b.cols + j] = s as f32;
            }
        }
        c
    }

    fn data(n: usize, salt: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(salt) >> 8) as f32
                    / (1 << 24) as f32
                    - 0.5
            })
            .collect()
    }

    #[test]
    fn matches_naive_product_for_edge_shapes_and_both_weight_layouts() {
        if !super::super::gemv::available() {
            return;
        }
        each_isa(|| {
            // Shapes off every block size (MR, NR, KC, MC, NC) and on them.
            for &(m, k, n) in &[
                (1, 1, 1),
                (7, 13, 17),
                (6, 256, 16),
                (12, 256, 64),
                (29, 300, 4100),
                (150, 520, 33),
                (300, 257, 40),
                // Panels of several KC blocks, split in depth (k × NC_MIN past PANEL) and in
                // columns (n past PANEL / k).
                (20, 2600, 600),
                (13, 1100, 2100),
            ] {
                let a = data(m * k, 1);
                let w = data(n * k, 2);
                // A in place (row-major) and packed (a transposed view); x W^T with W [n, k],
                // and g W with W [k, n].
                let a_views = [MatRef::row_major(&a, m, k), MatRef::row_major(&a, k, m).t()];
                let b_views = [MatRef::row_major(&w, n, k).t(), MatRef::row_major(&w, k, n)];
                for (am, b) in a_views
                    .iter()
                    .flat_map(|&am| b_views.iter().map(move |&b| (am, b)))
                {
                    let want = naive(am, b);
                    let mut c = vec![0f32; m * n];
                    gemm(am, b, &mut c, n, false);
                    let tol = 1e-5 * k as f32;
                    for (x, y) in c.iter().zip(&want) {
                        assert!((x - y).abs() <= tol, "{m}x{k}x{n}: {x} vs {y}");
                    }
                    // Accumulating adds to what is there.
                    gemm(am, b, &mut c, n, true);
                    for (x, y) in c.iter().zip(&want) {
                        assert!((x - 2.0 * y).abs() <= 2.0 * tol, "{m}x{k}x{n} accumulate");
                    }
                }
            }
        });
    }

    #[test]
    fn packed_product_with_bands_matches_naive_product() {
        if !super::super::gemv::available() {
            return;
        }
        each_isa(|| {
            // k over two KC blocks; rows and columns off the tile sizes.
            let (m, k, n) = (29, 300, 37);
            let a = data(m * k, 5);
            let b = data(k * n, 6);
            let (am, bm) = (MatRef::row_major(&a, m, k), MatRef::row_major(&b, k, n));
            let packed = PackedB::new(bm);
            // A in place and packed (the transposed copy of A viewed back).
            let transposed =
                |x: &[f32]| -> Vec<f32> { (0..k * m).map(|i| x[(i % m) * k + i / m]).collect() };
            let at = transposed(&a);
            for am in [am, MatRef::row_major(&at, k, m).t()] {
                let want = naive(am, bm);
                let mut c = vec![7f32; m * n];
                gemm_packed(am, &packed, &mut c, n, false, Band::Full);
                for (x, y) in c.iter().zip(&want) {
                    assert!((x - y).abs() <= 1e-3, "full: {x} vs {y}");
                }
                // Cols: each tile's first `row + 3` columns at least, nothing past its limit.
                let limit = |row: usize, mr: usize| row + mr + 2;
                let mut c = vec![7f32; m * n];
                gemm_packed(am, &packed, &mut c, n, false, Band::Cols(&limit));
                for i in 0..m {
                    let tile = i - i % MR;
                    for j in 0..n {
                        let got = c[i * n + j];
                        if j < tile + MR.min(m - tile) + 2 {
                            assert!((got - want[i * n + j]).abs() <= 1e-3, "cols ({i}, {j})");
                        } else {
                            assert_eq!(got, 7.0, "cols ({i}, {j}) written");
                        }
                    }
                }
            }
            // Depth: A zero outside each tile's range (here from its first row to 250, across
            // the KC boundary, empty for some tiles) gives the full product; accumulating adds.
            let range = |row: usize, _: usize| (row * 11).min(250)..250;
            let mut banded = a.clone();
            for i in 0..m {
                let r = range(i - i % MR, MR);
                for p in 0..k {
                    if !r.contains(&p) {
                        banded[i * k + p] = 0.0;
                    }
                }
            }
            let bam = MatRef::row_major(&banded, m, k);
            let want = naive(bam, bm);
            let bt = transposed(&banded);
            for am in [bam, MatRef::row_major(&bt, k, m).t()] {
                let mut c = vec![1f32; m * n];
                gemm_packed(am, &packed, &mut c, n, true, Band::Depth(&range));
                for (x, y) in c.iter().zip(&want) {
                    assert!((x - 1.0 - y).abs() <= 1e-3, "depth: {x} vs {y}");
                }
            }
        });
    }

    #[test]
    fn product_with_a_low_rank_tail_matches_naive_sum() {
        if !super::super::gemv::available() {
            return;
        }
        each_isa(|| {
            // One block and several (k past KC), n past a panel, panels split in depth, rows and
            // columns off the tiles.
            for &(m, k, n, r) in &[
                (7, 13, 17, 3),
                (29, 300, 4100, 16),
                (150, 520, 33, 5),
                (20, 2600, 600, 16),
            ] {
                let (a, a2) = (data(m * k, 11), data(m * r, 12));
                let (w, w2) = (data(n * k, 13), data(n * r, 14));
                let (am, a2m) = (MatRef::row_major(&a, m, k), MatRef::row_major(&a2, m, r));
                // x Wᵀ + low Bᵀ (the LoRA forward) and g W + gl A (its backward) layouts.
                for (b, b2) in [
                    (
                        MatRef::row_major(&w, n, k).t(),
                        MatRef::row_major(&w2, n, r).t(),
                    ),
                    (MatRef::row_major(&w, k, n), MatRef::row_major(&w2, r, n)),
                ] {
                    let (p1, p2) = (naive(am, b), naive(a2m, b2));
                    let got = product_plus(am, b, a2m, b2);
                    let tol = 1e-5 * (k + r) as f32;
                    for ((x, y1), y2) in got.iter().zip(&p1).zip(&p2) {
                        assert!(
                            (x - y1 - y2).abs() <= tol,
                            "{m}x{k}x{n}+{r}: {x} vs {}",
                            y1 + y2
                        );
                    }
                    // A packed (not row-major) falls back to two products.
                    let at: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
                    let got = product_plus(MatRef::row_major(&at, k, m).t(), b, a2m, b2);
                    for ((x, y1), y2) in got.iter().zip(&p1).zip(&p2) {
                        assert!((x - y1 - y2).abs() <= tol, "{m}x{k}x{n}+{r} packed A");
                    }
                }
            }
        });
    }

    #[test]
    fn writes_only_its_columns_of_a_wider_c() {
        if !super::super::gemv::available() {
            return;
        }
        each_isa(|| {
            let (m, k, n, ldc) = (10, 20, 18, 25);
            let a = data(m * k, 3);
            let b = data(k * n, 4);
            let (am, bm) = (MatRef::row_major(&a, m, k), MatRef::row_major(&b, k, n));
            let mut c = vec![7f32; m * ldc];
            gemm(am, bm, &mut c, ldc, false);
            let want = naive(am, bm);
            for i in 0..m {
                for j in 0..ldc {
                    let got = c[i * ldc + j];
                    if j < n {
                        assert!((got - want[i * n + j]).abs() < 1e-4);
                    } else {
                        assert_eq!(got, 7.0);
                    }
                }
            }
        });
    }
}
