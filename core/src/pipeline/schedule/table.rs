//! A terminal picture of a simulation: one row per rank, one column per time unit, so the
//! bubble is visible at a glance (and diffable in a test or a review).

use super::simulate::Simulation;
use std::fmt::Write;

/// Renders `sim` as a rank × time grid. A compute action shows its label (PyTorch notation)
/// in the column where it starts and `·` in the further units it spans; idle units are `.`.
/// Every column is as wide as the longest label, and a header marks every fifth time unit. A
/// last line gives the makespan and the exact bubble.
pub fn render_table(sim: &Simulation) -> String {
    let makespan = usize::try_from(sim.makespan).unwrap_or(usize::MAX);
    let mut grid: Vec<Vec<String>> = vec![vec![".".to_owned(); makespan]; sim.ranks];
    let mut width = 1;
    for (r, spans) in sim.timeline.iter().enumerate() {
        for span in spans {
            let label = span.action.to_string();
            width = width.max(label.chars().count());
            let (start, end) = (span.start as usize, (span.end as usize).min(makespan));
            for (k, cell) in grid[r].iter_mut().enumerate().take(end).skip(start) {
                *cell = if k == start {
                    label.clone()
                } else {
                    "·".to_owned()
                };
            }
        }
    }
    let head = format!("rank {}", sim.ranks.saturating_sub(1)).len().max(4);
    let mut out = String::new();
    let _ = write!(out, "{:<head$}", "time");
    for t in 0..makespan {
        let mark = t.to_string();
        let cell = if t % 5 == 0 && mark.len() <= width {
            mark
        } else {
            String::new()
        };
        let _ = write!(out, " {cell:<width$}");
    }
    out.push('\n');
    for (r, row) in grid.iter().enumerate() {
        let _ = write!(out, "{:<head$}", format!("rank {r}"));
        for cell in row {
            let _ = write!(out, " {cell:<width$}");
        }
        out.push('\n');
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

#[cfg(test)]
mod tests {
    use super::super::{generate, simulate, Costs, ScheduleKind};
    use super::*;

    #[test]
    fn gpipe_picture() {
        let s = generate(ScheduleKind::GPipe, 2, 1, 2).unwrap();
        let t = render_table(&simulate(&s, Costs::default()).unwrap());
        let want = "\
time   0                                      
rank 0 0F0 0F1 .   .   .   .   0B0 ·   0B1 ·  
rank 1 .   1F0 1F1 1B0 ·   1B1 ·   .   .   .  
gpipe: makespan 9, bubble 1/3 (33.3%)
";
        assert_eq!(t, want, "\n{t}");
    }

    #[test]
    fn wide_schedules_stay_aligned() {
        let s = generate(ScheduleKind::Interleaved1F1B, 8, 2, 16).unwrap();
        let sim = simulate(&s, Costs::default()).unwrap();
        let t = render_table(&sim);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 8 + 2);
        let width = lines[1].chars().count();
        assert!(lines[..9].iter().all(|l| l.chars().count() == width), "\n{t}");
        assert!(lines[8].starts_with("rank 7 .   .   .   .   .   .   .   7F0"), "\n{t}");
    }
}
