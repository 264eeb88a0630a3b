//! The page's first screen: per world size, a grid of models by configurations, each cell
//! coloured by the worst of its comparisons (every reference the configuration is judged
//! against), and linked to its detail further down.

use super::super::junit::xml_escape;
use super::super::{fmt_num, split_world, Report};
use std::fmt::Write as _;

/// A comparison whose error is more than this share of what it may be passes, but close to
/// its envelope: the grid marks it, and the closest rows get their charts drawn.
pub(super) const CLOSE_MARGIN: f64 = 0.5;

/// How a cell is coloured: the worst state among its comparisons.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum CellState {
    /// Every comparison passed, none close to its envelope.
    Pass,
    /// Passed, one at least above [`CLOSE_MARGIN`] of its envelope.
    Close,
    /// Not compared: the reference cannot exist for the model (the reason is in the detail).
    Skip,
    /// A comparison failed.
    Fail,
    /// A run it needed failed, so nothing was compared.
    Error,
}

impl CellState {
    /// The CSS class and the word a reader sees.
    pub(super) fn name(self) -> &'static str {
        match self {
            CellState::Pass => "pass",
            CellState::Close => "close",
            CellState::Skip => "skip",
            CellState::Fail => "fail",
            CellState::Error => "error",
        }
    }
}

/// One configuration of one model at one world size, and what the report holds of it.
pub(super) struct Cell {
    pub(super) model: String,
    /// The configuration at its world size (`ddp@4`).
    pub(super) config: String,
    pub(super) world: usize,
    pub(super) state: CellState,
    /// The largest margin among its comparisons (what colours it amber).
    pub(super) margin: Option<f64>,
    /// Indices into the report's comparisons, errors and skipped lists.
    pub(super) comparisons: Vec<usize>,
    pub(super) errors: Vec<usize>,
    pub(super) skipped: Vec<usize>,
    /// The anchor of its detail.
    pub(super) id: String,
}

/// Every cell of the report, in the order the report lists them.
pub(super) struct Overview {
    pub(super) cells: Vec<Cell>,
}

/// The configuration's name without its world size.
fn base_name(config: &str) -> &str {
    split_world(config).0
}

impl Overview {
    /// The cells of `report`.
    pub(super) fn of(report: &Report) -> Overview {
        let mut overview = Overview { cells: Vec::new() };
        for (i, c) in report.comparisons.iter().enumerate() {
            let cell = overview.cell(&c.model, &c.config);
            cell.comparisons.push(i);
            let margin = c.overall().margin;
            let state = match (c.passed, margin > CLOSE_MARGIN) {
                (false, _) => CellState::Fail,
                (true, true) => CellState::Close,
                (true, false) => CellState::Pass,
            };
            cell.state = cell.state.max(state);
            cell.margin = Some(cell.margin.map_or(margin, |m| m.max(margin)));
        }
        for (i, e) in report.errors.iter().enumerate() {
            let cell = overview.cell(&e.model, &e.config);
            cell.errors.push(i);
            cell.state = CellState::Error;
        }
        for (i, s) in report.skipped.iter().enumerate() {
            let cell = overview.cell(&s.model, &s.config);
            cell.skipped.push(i);
            if cell.comparisons.is_empty() && cell.errors.is_empty() {
                cell.state = CellState::Skip;
            }
        }
        overview
    }

    /// The cell of `model` × `config`, made on first use.
    fn cell(&mut self, model: &str, config: &str) -> &mut Cell {
        let at = self
            .cells
            .iter()
            .position(|c| c.model == model && c.config == config);
        let at = at.unwrap_or_else(|| {
            let id = format!("c{}", self.cells.len());
            self.cells.push(Cell {
                model: model.to_owned(),
                config: config.to_owned(),
                world: split_world(config).1,
                state: CellState::Pass,
                margin: None,
                comparisons: Vec::new(),
                errors: Vec::new(),
                skipped: Vec::new(),
                id,
            });
            self.cells.len() - 1
        });
        &mut self.cells[at]
    }

    /// The cell a comparison of `model` × `config` belongs to.
    pub(super) fn cell_of(&self, model: &str, config: &str) -> Option<&Cell> {
        self.cells
            .iter()
            .find(|c| c.model == model && c.config == config)
    }

    /// The grids, one per world size (ascending), each preceded by the legend once.
    pub(super) fn render(&self, out: &mut String) {
        let mut worlds: Vec<usize> = self.cells.iter().map(|c| c.world).collect();
        worlds.sort_unstable();
        worlds.dedup();
        out.push_str("<section id=\"overview\">\n<p class=\"legend\">");
        for (state, what) in [
            (CellState::Pass, "passed"),
            (CellState::Close, "passed, close to its envelope"),
            (CellState::Fail, "failed"),
            (CellState::Error, "a run failed"),
            (CellState::Skip, "skipped (why in its detail)"),
        ] {
            let _ = write!(
                out,
                "<span class=\"key s-{}\"></span> {what} ",
                state.name()
            );
        }
        out.push_str("<span class=\"key na\"></span> cannot run there</p>\n");
        for world in worlds {
            self.render_world(world, out);
        }
        out.push_str("</section>\n");
    }

    /// The grid of one world size: a row per model, a column per configuration.
    fn render_world(&self, world: usize, out: &mut String) {
        let cells: Vec<&Cell> = self.cells.iter().filter(|c| c.world == world).collect();
        let mut models: Vec<&str> = Vec::new();
        let mut configs: Vec<&str> = Vec::new();
        for c in &cells {
            if !models.contains(&c.model.as_str()) {
                models.push(&c.model);
            }
            if !configs.contains(&base_name(&c.config)) {
                configs.push(base_name(&c.config));
            }
        }
        let heading = match world {
            0 => "runs".to_owned(),
            n => format!("world size {n}"),
        };
        let _ = writeln!(
            out,
            "<h2>{heading}</h2>\n<table class=\"grid\">\n<tr><th></th>"
        );
        for config in &configs {
            let _ = write!(
                out,
                "<th class=\"v\" title=\"{0}\"><span>{0}</span></th>",
                xml_escape(config)
            );
        }
        out.push_str("</tr>\n");
        for model in models {
            let _ = write!(out, "<tr><th class=\"m\">{}</th>", xml_escape(model));
            for config in &configs {
                let found = cells
                    .iter()
                    .find(|c| c.model == model && base_name(&c.config) == *config);
                match found {
                    Some(c) => render_cell(c, out),
                    None => out.push_str("<td class=\"na\"></td>"),
                }
            }
            out.push_str("</tr>\n");
        }
        out.push_str("</table>\n");
    }
}

/// One grid cell: its colour, a tooltip with its verdict, a link to its detail.
fn render_cell(c: &Cell, out: &mut String) {
    let references = c.comparisons.len() + c.errors.len() + c.skipped.len();
    let mut tip = format!(
        "{} {}: {} ({} reference{})",
        c.model,
        c.config,
        c.state.name(),
        references,
        if references == 1 { "" } else { "s" }
    );
    if let Some(m) = c.margin {
        let _ = write!(tip, ", worst margin {}", fmt_num(m));
    }
    let _ = write!(
        out,
        "<td class=\"s-{}\"><a href=\"#{}\" title=\"{}\"></a></td>",
        c.state.name(),
        c.id,
        xml_escape(&tip)
    );
}
