//! The launcher's side of the cross-rank check ([`lockstep_core::consistency`]): every rank
//! writes its state digest beside rank 0's record, and the launching process compares them
//! and attaches the verdict to the record, so a rank that diverged fails the run even when
//! rank 0's numbers match the reference.

use crate::rank_error::{hand_back_json, take_handed_back, RankError};
use lockstep_core::consistency::{check_digests, RankDigest, StateProbe};
use lockstep_core::record::RunRecord;
use std::path::{Path, PathBuf};

/// The probe a launched rank trains with: `None` when `LOCKSTEP_CROSS_RANK=0` turns the
/// check off (to measure what it costs, or for a model too large to hash every step).
pub fn probe_for(rank: usize) -> Option<StateProbe> {
    let off = std::env::var("LOCKSTEP_CROSS_RANK").is_ok_and(|v| v == "0");
    (!off).then(|| StateProbe::new(rank))
}

/// Where rank `rank` leaves its digest for the record at `out`.
fn digest_path(out: &Path, rank: usize) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(format!(".digest{rank}"));
    PathBuf::from(name)
}

/// Writes `probe`'s digest where the launcher of the record at `out` reads it (every rank
/// calls it after training, before any barrier that ends the run).
pub fn hand_back_digest(probe: Option<&StateProbe>, out: &Path) -> Result<(), RankError> {
    let Some(probe) = probe else {
        return Ok(());
    };
    let digest = probe.digest();
    let path = digest_path(out, digest.rank);
    hand_back_json("the state digest", &path, &digest)
}

/// Reads (and removes) the `world_size` digests left for the record at `out` and, when every
/// rank left one, attaches their comparison to `record`. A digest missing means a rank did
/// not finish, which the launch has reported already; nothing is attached then.
pub fn attach_cross_rank(record: Option<&mut RunRecord>, out: &Path, world_size: usize) {
    if world_size == 0 {
        return;
    }
    let digests: Vec<Option<RankDigest>> = (0..world_size)
        .map(|rank| {
            let path = digest_path(out, rank);
            take_handed_back(&path).and_then(|bytes| serde_json::from_slice(&bytes).ok())
        })
        .collect();
    let (Some(record), Some(digests)) = (record, digests.into_iter().collect::<Option<Vec<_>>>())
    else {
        return;
    };
    record.cross_rank = Some(check_digests(&digests));
}
