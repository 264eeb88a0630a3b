//! Schedules as CSV, in the layout of PyTorch's `_dump_csv` / `_load_csv`: one row per rank,
//! that rank's actions in order, in PyTorch's notation, separated by commas. Both compute-only
//! and lowered (compute + comms) schedules use it.

use super::error::ScheduleError;
use super::ir::{chain_edges, Action, Schedule};

/// One line per rank (rank order), actions separated by commas, each line ending in `\n`.
pub fn to_csv(schedule: &Schedule) -> String {
    let mut out = String::new();
    for list in &schedule.actions {
        let row: Vec<String> = list.iter().map(Action::to_string).collect();
        out.push_str(&row.join(","));
        out.push('\n');
    }
    out
}

/// Reads a schedule from CSV (as [`to_csv`] or PyTorch writes it). Rows are ranks; empty
/// cells (PyTorch's idle steps) are skipped; `\r\n` line ends are accepted. The number of
/// stages is one more than the highest stage index, the number of microbatches one more than
/// the highest microbatch index. StageLayout is `stage_ranks` when given (that each row's stages
/// live on its rank is then [`super::validate()`]'s to check), else inferred from which row
/// lists each stage — a stage on two rows, or on none, is an error. CSV carries no edges:
/// they are the chain (a caller with skip connections sets its own); the name is `csv`.
pub fn from_csv(text: &str, stage_ranks: Option<&[usize]>) -> Result<Schedule, ScheduleError> {
    let mut lines: Vec<&str> = text.split('\n').collect();
    if lines.last() == Some(&"") {
        lines.pop();
    }
    let mut actions: Vec<Vec<Action>> = Vec::with_capacity(lines.len());
    for (r, line) in lines.iter().enumerate() {
        let mut row = Vec::new();
        for cell in line.trim_end_matches('\r').split(',') {
            let cell = cell.trim().trim_matches('"');
            if cell.is_empty() {
                continue;
            }
            let a: Action = cell.parse().map_err(|e| match e {
                ScheduleError::Parse { text, reason } => ScheduleError::Parse {
                    text,
                    reason: format!("{reason} (row {r}, i.e. rank {r})"),
                },
                other => other,
            })?;
            row.push(a);
        }
        actions.push(row);
    }
    let ranks = actions.len();
    if ranks == 0 {
        return Err(ScheduleError::parse(
            text,
            "the CSV has no rows (one row per rank)",
        ));
    }
    let stages = actions
        .iter()
        .flatten()
        .map(|a| a.stage + 1)
        .max()
        .unwrap_or(0);
    let microbatches = actions
        .iter()
        .flatten()
        .filter_map(|a| a.microbatch)
        .map(|mb| mb + 1)
        .max()
        .ok_or_else(|| ScheduleError::Invalid("the CSV names no microbatch".into()))?;
    let placement = match stage_ranks {
        Some(given) => {
            if given.len() < stages {
                return Err(ScheduleError::Invalid(format!(
                    "the CSV names stage {}, but the placement has {} stages",
                    stages - 1,
                    given.len()
                )));
            }
            given.to_vec()
        }
        None => infer_placement(&actions, stages)?,
    };
    Ok(Schedule {
        name: "csv".into(),
        ranks,
        microbatches,
        edges: chain_edges(placement.len()),
        stage_ranks: placement,
        actions,
    })
}

/// Stage → the row listing it; every stage on exactly one row.
fn infer_placement(actions: &[Vec<Action>], stages: usize) -> Result<Vec<usize>, ScheduleError> {
    let mut owner: Vec<Option<(usize, Action)>> = vec![None; stages];
    for (r, row) in actions.iter().enumerate() {
        for &a in row {
            match owner[a.stage] {
                None => owner[a.stage] = Some((r, a)),
                Some((first, seen)) if first != r => {
                    return Err(ScheduleError::Invalid(format!(
                        "stage {} appears on two rows: rank {first} lists {seen}, rank {r} \
                         lists {a}",
                        a.stage
                    )))
                }
                Some(_) => {}
            }
        }
    }
    owner
        .iter()
        .enumerate()
        .map(|(s, o)| {
            o.map(|(r, _)| r).ok_or_else(|| {
                ScheduleError::Invalid(format!(
                    "stage {s} appears on no row, so its rank is unknown (give the placement)"
                ))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::{generate, lower, validate, ScheduleKind};
    use super::*;

    #[test]
    fn every_builtin_schedule_round_trips() {
        for kind in ScheduleKind::all() {
            for (p, m) in [(1, 2), (2, 4), (3, 6), (4, 8)] {
                for v in [1, 2, 3] {
                    let Ok(s) = generate(kind, p, v, m) else {
                        continue;
                    };
                    for s in [s.clone(), lower(&s)] {
                        let text = to_csv(&s);
                        let back = from_csv(&text, None).unwrap();
                        let mut want = s.clone();
                        want.name = "csv".into();
                        assert_eq!(back, want, "{kind} p={p} v={v} m={m}");
                        assert_eq!(to_csv(&back), text);
                        let given = from_csv(&text, Some(&s.stage_ranks)).unwrap();
                        assert_eq!(given, want);
                    }
                }
            }
        }
    }

    #[test]
    fn reads_pytorch_style_rows() {
        // CRLF line ends and empty cells for idle steps, as Python's csv writer leaves them.
        let text = "0F0,0F1,,0B0,0B1\r\n,1F0,1B0,1F1,1B1\r\n";
        let s = from_csv(text, None).unwrap();
        assert_eq!((s.ranks, s.stages(), s.microbatches), (2, 2, 2));
        assert_eq!(s.stage_ranks, vec![0, 1]);
        assert_eq!(s.name, "csv");
        validate(&s).unwrap();
        assert_eq!(to_csv(&s), "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n");
    }

    #[test]
    fn errors_name_the_cell_and_the_rows() {
        let e = from_csv("0F0,0B0\n1F0,1Q0\n", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`1Q0`") && e.contains("rank 1"), "{e}");
        let e = from_csv("0F0,1F0\n1B0\n", None).unwrap_err().to_string();
        assert!(e.contains("stage 1 appears on two rows"), "{e}");
        let e = from_csv("0F0,0B0\n2F0,2B0\n", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("stage 1 appears on no row"), "{e}");
        let e = from_csv("0UNSHARD\n", None).unwrap_err().to_string();
        assert!(e.contains("names no microbatch"), "{e}");
        let e = from_csv("0F0,2F0\n", Some(&[0, 0]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("names stage 2, but the placement has 2 stages"),
            "{e}"
        );
    }
}
