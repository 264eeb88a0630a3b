//! The `--list` text.

use super::*;

/// The world size `--list` shows each configuration's references at (`Config::edges`).
const LIST_WORLD: usize = 4;

/// The `--list` text: every configuration with the models it applies to, then the models.
pub fn render_list(seed: u64) -> Result<String, MatrixError> {
    let mut models = Vec::new();
    for name in zoo::names() {
        let m = zoo::build(name, seed, 0)?;
        models.push((
            name,
            m.num_parameters(),
            m.single_device_reference_blocker(),
        ));
    }
    let configs = Config::all();
    let width = configs.iter().map(|c| c.name().len()).max().unwrap_or(0) + 2;
    let mut out = String::from("configs:\n");
    for &c in &configs {
        let applies = models_for(c, &models, seed);
        let _ = writeln!(out, "  {:<width$}{}", c.name(), c.description());
        let _ = writeln!(
            out,
            "  {:<width$}zoo models: {} (and any model of yours: `ParityTest::model`)",
            "",
            applies.join(", ")
        );
        let edges: Vec<String> = c
            .edges(LIST_WORLD)
            .iter()
            .map(|e| e.describe(c, LIST_WORLD))
            .collect();
        let _ = writeln!(
            out,
            "  {:<width$}judged at world {LIST_WORLD} against: {}",
            "",
            edges.join("; ")
        );
        if let Some(FsdpLayout::Hybrid { replicas }) = c.fsdp_config().map(|f| f.layout) {
            let _ = writeln!(
                out,
                "  {:<width$}world sizes: multiples of {replicas} ({replicas} replicas of N/{replicas} \
                 ranks; other sizes are skipped)",
                ""
            );
            let _ = writeln!(
                out,
                "  {:<width$}against {}: {HYBRID_VS_DDP_REASON}",
                "",
                Config::DdpHybridOrder.name()
            );
        }
        if let Some(DdpCheck::DtypeTable { reason }) = c.fsdp_config().map(|f| f.vs_ddp) {
            let _ = writeln!(out, "  {:<width$}override vs ddp: {reason}", "");
        }
    }
    out.push_str("references only (run when a config above needs them, never selected):\n");
    for c in Config::references_only() {
        let _ = writeln!(out, "  {:<width$}{}", c.name(), c.description());
    }
    let mixed: Vec<&str> = configs
        .iter()
        .filter(|c| c.precision().is_some())
        .map(|c| c.name())
        .collect();
    let _ = writeln!(
        out,
        "mixed precision ({}): against single by the fp64 arbiter, with their DDP reference \
         under the same policy as the envelope: {MIXED_VS_SINGLE_REASON}",
        mixed.join(", ")
    );
    let _ = writeln!(
        out,
        "against single (and single.mbM where a pipeline cannot be bitwise): the fp64 arbiter, \
         d(run, fp64) <= {} x d(reference, fp64) + {} fp32 ULPs of the tensor's scale \
         (docs/parity.md)",
        ENVELOPE.k, ENVELOPE.floor_ulps
    );
    let _ = writeln!(
        out,
        "pipelines (pp.*): microbatches 2p for p pipeline ranks; models whose stages a \
         schedule's stage count exceeds are skipped with the reason"
    );
    out.push_str("models:\n");
    for (name, params, blocker) in &models {
        let note = match blocker {
            None => "single + ddp + fsdp + pp".to_owned(),
            Some(reason) => format!("ddp + fsdp only (no single-device reference: {reason})"),
        };
        let _ = writeln!(out, "  {name:<16}{params:>8} params  {note}");
    }
    Ok(out)
}

/// A zoo model as `--list` shows it: name, parameters, why it has no single-device reference.
type ListedModel = (&'static str, i64, Option<String>);

/// The zoo models configuration `c` applies to.
fn models_for(c: Config, models: &[ListedModel], seed: u64) -> Vec<&'static str> {
    models
        .iter()
        .filter(|(name, _, single)| match c {
            Config::Single | Config::Pipeline(_) => single.is_none(),
            // The models whose plan fits at world 2 or 4 (`tp.2` on `mlp` is refused).
            Config::ModelParallel(id) => zoo::build(name, seed, 0).is_ok_and(|m| {
                [2, 4]
                    .iter()
                    .any(|&w| id.get().model_blocker(m.as_ref(), w).is_none())
            }),
            // The models the composition serves at world 4 or 8 (its table's sizes).
            Config::Composed(id) => zoo::build(name, seed, 0).is_ok_and(|m| {
                [4, 8]
                    .iter()
                    .any(|&w| id.get().model_blocker(m.as_ref(), w).is_none())
            }),
            _ => true,
        })
        .map(|(n, _, _)| *n)
        .collect()
}
