//! A terminal picture of a simulation: one row per rank, one column per time unit, so the
//! bubble is visible at a glance (and diffable in a test or a review).

use super::simulate::Simulation;
use std::fmt::Write;

/// Renders `sim` as a rank × time grid. A compute action shows its label (PyTorch notation)
/// in the column where it starts and `·` in the further units it spans; idle units are `.`.
/// Every column is as wide as the longest label; a header row marks every fifth time unit.
/// With `width` set, the grid is cut into bands of time no wider than `width` characters
/// (each with its own header), so a long schedule stays readable in a terminal; `None` keeps
/// one band. A last line gives the makespan and the exact bubble.
pub fn render_table(sim: &Simulation, width: Option<usize>) -> String {
    let makespan = usize::try_from(sim.makespan).unwrap_or(usize::MAX);
    let mut grid: Vec<Vec<String>> = vec![vec![".".to_owned(); makespan]; sim.ranks];
    let mut cell = 1;
    for (r, spans) in sim.timeline.iter().enumerate() {
        for span in spans {
            let label = span.action.to_string();
            cell = cell.max(label.chars().count());
            let start = usize::try_from(span.start).unwrap_or(usize::MAX);
            let end = usize::try_from(span.end)
                .unwrap_or(usize::MAX)
                .min(makespan);
            for (t, slot) in grid[r].iter_mut().enumerate().take(end).skip(start) {
                *slot = if t == start {
                    label.clone()
                } else {
                    "·".to_owned()
                };
            }
        }
    }
    let head = format!("rank {}", sim.ranks.saturating_sub(1)).len();
    let per_band = match width {
        Some(w) => (w.saturating_sub(head) / (cell + 1)).max(1),
        None => makespan.max(1),
    };
    let mut out = String::new();
    let mut from = 0;
    while from < makespan {
        let to = (from + per_band).min(makespan);
        if from > 0 {
            out.push('\n');
        }
        let _ = write!(out, "{:<head$}", "time");
        for t in from..to {
            let mark = t.to_string();
            let mark = if t % 5 == 0 && mark.len() <= cell {
                mark
            } else {
                String::new()
            };
            let _ = write!(out, " {mark:<cell$}");
        }
        end_line(&mut out);
        for (r, row) in grid.iter().enumerate() {
            let _ = write!(out, "{:<head$}", format!("rank {r}"));
            for slot in &row[from..to] {
                let _ = write!(out, " {slot:<cell$}");
            }
            end_line(&mut out);
        }
        from = to;
    }
    let _ = writeln!(
        out,
        "{}: makespan {}, bubble {}/{} ({:.1}%)",
        sim.schedule,
        sim.makespan,
        sim.bubble_numerator,
        sim.bubble_denominator,
        sim.bubble_fraction * 100.0
    );
    out
}

/// Ends the current line without trailing padding.
fn end_line(out: &mut String) {
    let kept = out.trim_end_matches(' ').len();
    out.truncate(kept);
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use super::super::{generate, simulate, Action, Costs, ScheduleKind};
    use super::*;

    #[test]
    fn gpipe_picture() {
        let s = generate(ScheduleKind::GPipe, 2, 1, 2).unwrap();
        let sim = simulate(&s, Costs::default()).unwrap();
        let want = "\
time   0                   5
rank 0 0F0 0F1 .   .   .   0B0 ·   0B1 ·
rank 1 .   1F0 1F1 1B0 ·   1B1 ·   .   .
gpipe: makespan 9, bubble 1/3 (33.3%)
";
        assert_eq!(render_table(&sim, None), want);
        let banded = "\
time   0
rank 0 0F0 0F1 .   .   .
rank 1 .   1F0 1F1 1B0 ·

time   5
rank 0 0B0 ·   0B1 ·
rank 1 1B1 ·   .   .
gpipe: makespan 9, bubble 1/3 (33.3%)
";
        assert_eq!(render_table(&sim, Some(26)), banded);
    }

    #[test]
    fn wide_schedules_stay_aligned_and_fit() {
        let s = generate(ScheduleKind::Interleaved1F1B, 8, 2, 16).unwrap();
        let sim = simulate(&s, Costs::default()).unwrap();
        let t = render_table(&sim, Some(120));
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines.iter().all(|l| l.chars().count() <= 120), "\n{t}");
        assert!(lines[8].starts_with("rank 7 .     .     .     .     .     .     .     7F0"));
        assert!(lines.last().unwrap().contains("bubble 7/39"));
        // Labels are at most 5 wide (`15F15`): every 6-character cell after `rank r` holds
        // one token, so columns line up.
        let mut units = 0;
        for line in lines.iter().filter(|l| l.starts_with("rank ")) {
            let cells: Vec<char> = line.chars().skip(6).collect();
            for c in cells.chunks(6) {
                let token = c.iter().collect::<String>().trim().to_owned();
                assert!(
                    token == "." || token == "·" || token.parse::<Action>().is_ok(),
                    "{token:?} in {line}"
                );
                units += 1;
            }
        }
        assert!(units <= 8 * sim.makespan as usize);
    }
}
