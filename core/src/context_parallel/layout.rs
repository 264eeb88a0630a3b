//! Where each rank's tokens sit in the sequence: the chunks it holds under a layout, their
//! global positions, and the slices of a batch it trains on.

use super::options::SequenceLayout;
use tch::{TchError, Tensor};

/// The chunks a sequence is cut into under `layout` over `cp` ranks.
pub fn chunk_count(layout: SequenceLayout, cp: usize) -> usize {
    match layout {
        SequenceLayout::Balanced => 2 * cp,
        SequenceLayout::Contiguous => cp,
    }
}

/// The global chunk indices rank `rank` holds, in the order it holds them: `[i, 2·cp−1−i]`
/// balanced, `[i]` contiguous.
pub fn chunks_of(layout: SequenceLayout, rank: usize, cp: usize) -> Vec<usize> {
    match layout {
        SequenceLayout::Balanced => vec![rank, 2 * cp - 1 - rank],
        SequenceLayout::Contiguous => vec![rank],
    }
}

/// The positions, within the whole sequence of `seq` tokens, of the tokens rank `rank` holds.
pub fn positions_of(layout: SequenceLayout, rank: usize, cp: usize, seq: i64) -> Vec<i64> {
    let len = seq / chunk_count(layout, cp) as i64;
    chunks_of(layout, rank, cp)
        .into_iter()
        .flat_map(|c| (c as i64 * len)..((c as i64 + 1) * len))
        .collect()
}

/// Rank `rank`'s slice of `t` along the sequence dimension `dim`: its chunks, concatenated
/// in the order it holds them.
pub fn shard_sequence(
    t: &Tensor,
    dim: i64,
    layout: SequenceLayout,
    rank: usize,
    cp: usize,
) -> Result<Tensor, TchError> {
    let len = t.size()[dim as usize] / chunk_count(layout, cp) as i64;
    let parts = chunks_of(layout, rank, cp)
        .into_iter()
        .map(|c| t.f_narrow(dim, c as i64 * len, len))
        .collect::<Result<Vec<_>, _>>()?;
    Tensor::f_cat(&parts, dim)
}

/// Why a sequence of `seq` tokens cannot be laid out over `cp` ranks, if it cannot.
pub fn layout_blocker(layout: SequenceLayout, cp: usize, seq: i64) -> Option<String> {
    let chunks = chunk_count(layout, cp) as i64;
    (cp == 0 || seq % chunks != 0).then(|| match layout {
        SequenceLayout::Balanced => format!(
            "the sequence of {seq} tokens does not divide into 2 × cp = {chunks} chunks \
             (the load-balanced layout's)"
        ),
        SequenceLayout::Contiguous => {
            format!("the sequence of {seq} tokens does not divide by cp = {cp}")
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_ranks_hold_a_chunk_from_each_end() {
        assert_eq!(chunks_of(SequenceLayout::Balanced, 0, 2), vec![0, 3]);
        assert_eq!(chunks_of(SequenceLayout::Balanced, 1, 2), vec![1, 2]);
        assert_eq!(
            positions_of(SequenceLayout::Balanced, 1, 2, 8),
            vec![2, 3, 4, 5]
        );
        assert_eq!(
            positions_of(SequenceLayout::Balanced, 0, 2, 8),
            vec![0, 1, 6, 7]
        );
        assert_eq!(
            positions_of(SequenceLayout::Contiguous, 1, 2, 8),
            vec![4, 5, 6, 7]
        );
    }

    #[test]
    fn a_sequence_the_chunks_do_not_divide_is_refused_naming_both() {
        let why = layout_blocker(SequenceLayout::Balanced, 4, 12).expect("refused");
        assert!(
            why.contains("12 tokens") && why.contains("8 chunks"),
            "{why}"
        );
        assert!(layout_blocker(SequenceLayout::Contiguous, 4, 12).is_none());
    }
}
