//! Pipeline schedules as data.
//!
//! A [`Schedule`] is, per rank, the list of [`Action`]s it runs in order — forwards,
//! backwards (full B, or input-gradient I and weight-gradient W), sends and receives — in
//! PyTorch's schedule IR notation (`0F1`, `3SEND_B2`). Because it is data it can be checked
//! before any rank starts:
//!
//! - [`generate()`] builds the built-in schedules ([`ScheduleKind`]: GPipe, 1F1B, interleaved
//!   1F1B, Looped BFS, interleaved zero bubble, ZBV, DualPipeV), compute actions only,
//!   rejecting (p, v, m) combinations a schedule does not support with the rule's name;
//! - [`lower()`] inserts the sends and receives the stage edges and placement imply;
//! - [`validate()`] checks placement, exactly-once, ordering and send/receive matching;
//! - [`simulate()`] runs the schedule on idealised ranks under [`Costs`]: it finds deadlocks
//!   (naming every blocked rank and what it waits for) and measures the bubble exactly;
//! - [`to_csv`] / [`from_csv`] exchange schedules with PyTorch's `_dump_csv` / `_load_csv`;
//! - [`render_table`] draws a simulation as a rank × time grid.

mod csv;
mod error;
mod generate;
mod ir;
mod loop_orders;
mod lower;
mod parse;
mod rank_ops;
mod simulate;
mod table;
mod v_orders;
mod validate;

pub use csv::{from_csv, to_csv};
pub use error::{ScheduleError, Wait};
pub use generate::{generate, ScheduleKind};
pub use ir::{chain_edges, Action, ActionKind, Schedule, StageLayout};
pub use lower::lower;
pub use simulate::{simulate, simulate_costed, Costs, Simulation, Span};
pub use table::render_table;
pub use validate::validate;
