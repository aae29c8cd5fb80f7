//! Sequence packing: the rows of a (mini-)batch laid out as `[L, T]` micro-batches, each
//! lane holding several rows one after another instead of one row padded to the longest
//! (RL2's, verl's and TRL's padding-free batches do the same).
//!
//! A packed lane keeps its rows apart through the attention mask: each token's entry is
//! its row's sequence id within the lane (1, 2, … in order; 0 is padding), which the
//! decoder turns into "attend within your own sequence only"
//! ([`crate::model::decoder::batch_mask`]), and positions start again at 0 with each row.
//! Everything per token (targets, loss masks, weights) is placed where its row sits
//! ([`Layout::place`]) and read back the same way ([`Layout::unpack`]).

/// Where one row sits in a micro-batch: its lane, its first column and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub row: usize,
    pub lane: usize,
    pub start: usize,
    pub len: usize,
}

/// One micro-batch's layout: `lanes × width` tokens, the rows' slots in lane order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub slots: Vec<Slot>,
    pub lanes: usize,
    pub width: usize,
}

impl Layout {
    /// `[lanes × width]` values, row-major: `value(slot, k)` at the k-th token of each
    /// row, `T::default()` on padding.
    pub fn place<T: Copy + Default>(&self, value: impl Fn(&Slot, usize) -> T) -> Vec<T> {
        let mut out = vec![T::default(); self.lanes * self.width];
        for s in &self.slots {
            let at = s.lane * self.width + s.start;
            for (k, o) in out[at..at + s.len].iter_mut().enumerate() {
                *o = value(s, k);
            }
        }
        out
    }

    /// Each token's sequence id within its lane (the slot's rank in its lane, from 1), 0
    /// on padding: the attention mask of the packed rows.
    pub fn sequence_ids(&self) -> Vec<u32> {
        // Each lane numbers its rows 1, 2, ... in slot order.
        let mut next = vec![1u32; self.lanes];
        let mut out = vec![0u32; self.lanes * self.width];
        for s in &self.slots {
            out[s.lane * self.width + s.start..][..s.len].fill(next[s.lane]);
            next[s.lane] += 1;
        }
        out
    }

    /// Positions from 0 at each row's first token (0 on padding).
    pub fn positions(&self) -> Vec<u32> {
        self.place(|_, k| k as u32)
    }

    /// Each row's values `(row, its len values)` from `[lanes][width]` values.
    pub fn unpack(&self, all: &[Vec<f32>]) -> Vec<(usize, Vec<f32>)> {
        self.slots
            .iter()
            .map(|s| (s.row, all[s.lane][s.start..][..s.len].to_vec()))
            .collect()
    }
}

/// Rows `(index, length)` in lanes of `width` tokens: first-fit decreasing (the longest
/// first, each into the first lane it fits, ties in row order) when `pack`, else one row
/// a lane in the given order. With `width` the longest row's length no lane is longer
/// than the padded batch's rows, so attention (quadratic in a lane's length) never costs
/// more than it does padded.
pub fn lanes(rows: &[(usize, usize)], width: usize, pack: bool) -> Vec<Vec<(usize, usize)>> {
    if !pack {
        return rows.iter().map(|&r| vec![r]).collect();
    }
    let mut order = rows.to_vec();
    order.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut out: Vec<(usize, Vec<(usize, usize)>)> = Vec::new();
    for r in order {
        match out.iter_mut().find(|(used, _)| used + r.1 <= width) {
            Some((used, members)) => {
                *used += r.1;
                members.push(r);
            }
            None => out.push((r.1, vec![r])),
        }
    }
    out.into_iter().map(|(_, members)| members).collect()
}

/// The micro-batches of `rows` (`(index, length)`): their [`lanes`] as wide as the
/// longest row, taken in order while lanes × the longest lane stays within `budget`
/// tokens (a lane longer than that is a micro-batch of its own), each padded on the
/// right to its longest lane.
pub fn micro_batches(rows: &[(usize, usize)], pack: bool, budget: usize) -> Vec<Layout> {
    let width = rows.iter().map(|r| r.1).max().unwrap_or(0);
    let lanes = lanes(rows, width, pack);
    let used = |lane: &[(usize, usize)]| lane.iter().map(|r| r.1).sum::<usize>();
    let mut out = Vec::new();
    let mut start = 0;
    while start < lanes.len() {
        let mut end = start + 1;
        let mut longest = used(&lanes[start]);
        while end < lanes.len() {
            let l = longest.max(used(&lanes[end]));
            if l * (end + 1 - start) > budget {
                break;
            }
            longest = l;
            end += 1;
        }
        let mut slots = Vec::new();
        for (lane, members) in lanes[start..end].iter().enumerate() {
            let mut at = 0;
            for &(row, len) in members {
                slots.push(Slot {
                    row,
                    lane,
                    start: at,
                    len,
                });
                at += len;
            }
        }
        out.push(Layout {
            slots,
            lanes: end - start,
            width: longest,
        });
        start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// First-fit decreasing in the longest row's width; the padded layout is one row a
    /// lane in order; micro-batches stop at the budget.
    #[test]
    fn rows_pack_first_fit_decreasing_within_the_budget() {
        let rows = [(0, 28), (1, 11), (2, 11), (3, 5), (4, 20)];
        let packed = lanes(&rows, 28, true);
        assert_eq!(
            packed,
            [vec![(0, 28)], vec![(4, 20), (3, 5)], vec![(1, 11), (2, 11)]]
        );
        assert_eq!(lanes(&rows, 28, false).len(), 5);
        let all = micro_batches(&rows, true, 10_000);
        assert_eq!(all.len(), 1);
        let m = &all[0];
        assert_eq!((m.lanes, m.width), (3, 28));
        assert_eq!(
            m.slots[1..3],
            [
                Slot {
                    row: 4,
                    lane: 1,
                    start: 0,
                    len: 20
                },
                Slot {
                    row: 3,
                    lane: 1,
                    start: 20,
                    len: 5
                }
            ]
        );
        let ids = m.sequence_ids();
        assert_eq!(&ids[28..28 + 28], {
            let mut want = vec![1u32; 20];
            want.extend([2; 5]);
            want.extend([0; 3]);
            want
        });
        let pos = m.positions();
        assert_eq!(
            (pos[28 + 19], pos[28 + 20], pos[28 + 24], pos[28 + 25]),
            (19, 0, 4, 0)
        );
        // Two lanes of 28 are 56 tokens: a budget of 56 takes two, then the third alone.
        let split = micro_batches(&rows, true, 56);
        assert_eq!(
            split.iter().map(|m| (m.lanes, m.width)).collect::<Vec<_>>(),
            [(2, 28), (1, 22)]
        );
        // Padded: one row a lane, in order, as the budget allows (3 × 20 is 60).
        let padded = micro_batches(&rows, false, 60);
        assert_eq!(
            padded
                .iter()
                .map(|m| (m.lanes, m.width))
                .collect::<Vec<_>>(),
            [(2, 28), (3, 20)]
        );
        // Values go where their rows sit and come back whole.
        let values = m.place(|s, k| (s.row * 100 + k) as f32);
        let grid: Vec<Vec<f32>> = values.chunks(28).map(<[f32]>::to_vec).collect();
        for (row, v) in m.unpack(&grid) {
            let want: Vec<f32> = (0..v.len()).map(|k| (row * 100 + k) as f32).collect();
            assert_eq!(v, want);
        }
    }
}
