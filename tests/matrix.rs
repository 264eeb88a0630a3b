//! `lockstep matrix` end to end through the built binary (exit codes, messages, the report
//! set on disk), plus the library's name matching and planning.

use lockstep::configs::{self, Config, DdpCheck, Precision};
use lockstep::harness::report::{read_json, SCHEMA_VERSION};
use lockstep::matrix::{self, MatrixError, MatrixOptions, RowStatus};
use lockstep_core::fsdp::{BackwardPrefetch, ShardingStrategy, WrapPolicy};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A fresh directory under the system temp dir, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("lockstep-matrix-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Output {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn lockstep(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .output()
        .expect("run the lockstep binary");
    Output {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `lockstep matrix` into `out` with `extra`, printing every row (`--rows`): the tests read
/// the rows.
fn matrix_into(out: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["matrix", "--rows", "--out", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    lockstep(&args)
}

#[test]
fn small_matrix_passes_and_writes_every_report() {
    let scratch = Scratch::new("small");
    let out = scratch.0.join("reports");
    let run = matrix_into(
        &out,
        &[
            "--models",
            "nested,mlp",
            "--configs",
            "single,ddp",
            "--world-size",
            "2",
            "--steps",
            "2",
        ],
    );
    assert_eq!(
        run.code,
        Some(0),
        "stdout:\n{}\nstderr:\n{}",
        run.stdout,
        run.stderr
    );
    for row in [
        "single@2  single@2",
        "ddp@2     single@2",
        "ddp@2     ddp@2",
    ] {
        assert!(
            run.stdout.contains(row),
            "no `{row}` row in:\n{}",
            run.stdout
        );
    }
    // Per model: single, its repeat, its float64 shadow, two fp32 variants, ddp and its
    // repeat.
    assert!(run.stdout.contains("matrix: 14 runs in "), "{}", run.stdout);
    assert!(!run.stdout.contains("FAIL"), "{}", run.stdout);

    for file in matrix::REPORT_FILES {
        assert!(out.join(file).is_file(), "{file} missing");
    }
    let raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(raw["schema_version"], SCHEMA_VERSION);
    let report = read_json(&out.join("report.json")).unwrap();
    assert!(report.passed());
    assert!(report.wall_time_seconds.is_some_and(|s| s > 0.0));
    // Per model: single vs single, ddp vs single, ddp vs ddp.
    assert_eq!(report.comparisons.len(), 6);
    let keys: Vec<(&str, &str, &str)> = report
        .comparisons
        .iter()
        .map(|c| (c.model.as_str(), c.config.as_str(), c.reference.as_str()))
        .collect();
    assert!(keys.contains(&("mlp", "ddp@2", "single@2")));
    assert!(keys.contains(&("nested", "ddp@2", "ddp@2")));
    assert_eq!(report.steps.len(), 6 * 2);
    let junit = std::fs::read_to_string(out.join("junit.xml")).unwrap();
    assert!(junit.contains("<testsuite"), "{junit}");
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("ddp@2"), "{md}");
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("<html"), "{}", &html[..html.len().min(200)]);
}

#[test]
fn models_without_a_single_reference_get_ddp_rows_and_a_reason() {
    let scratch = Scratch::new("moe");
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "moe",
            "--configs",
            "ddp*",
            "--world-size",
            "2",
            "--steps",
            "2",
        ],
    );
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout
            .contains("no single-device reference: its expert"),
        "{}",
        run.stdout
    );
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    let keys: Vec<(&str, &str)> = report
        .comparisons
        .iter()
        .map(|c| (c.config.as_str(), c.reference.as_str()))
        .collect();
    // `ddp*` selects the mixed-precision DDP references too: each against its repeat only.
    assert_eq!(
        keys,
        [
            ("ddp@2", "ddp@2"),
            ("ddp.bf16@2", "ddp.bf16@2"),
            ("ddp.fp16@2", "ddp.fp16@2")
        ]
    );
    assert!(run.stdout.contains("matrix: 6 runs in "), "{}", run.stdout);
}

#[test]
fn list_prints_configs_and_models() {
    let run = lockstep(&["matrix", "--list"]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(run.stdout.contains("configs:"), "{}", run.stdout);
    for config in Config::all() {
        // Every config on its own line, with its description.
        let line = run
            .stdout
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{} ", config.name())))
            .unwrap_or_else(|| panic!("{} missing:\n{}", config.name(), run.stdout));
        assert!(line.contains(&config.description()), "{line}");
    }
    for fsdp in [
        "fsdp.full_shard ",
        "fsdp.shard_grad_op ",
        "fsdp.no_shard ",
        "fsdp.full_shard.per_layer ",
        "fsdp.hybrid_shard ",
        "ddp.bf16 ",
        "ddp.fp16 ",
        "fsdp.full_shard.bf16 ",
        "fsdp.full_shard.per_layer.fp16 ",
    ] {
        assert!(run.stdout.contains(fsdp), "{fsdp} missing:\n{}", run.stdout);
    }
    // Mixed precision: why there is no row against single, once; and the model FSDP mixed
    // precision cannot run (rank-local parameters) is left out of those configs' models.
    assert_eq!(
        run.stdout.matches(configs::MIXED_VS_SINGLE_REASON).count(),
        1,
        "{}",
        run.stdout
    );
    let models_of = |config: &str| {
        let mut lines = run.stdout.lines();
        lines
            .find(|l| l.trim_start().starts_with(&format!("{config} ")))
            .unwrap();
        lines.next().unwrap().trim().to_owned()
    };
    // Each configuration's judging edges, from the catalog (`Config::edges`).
    let judged = |config: &str| {
        let mut lines = run.stdout.lines();
        lines
            .find(|l| l.trim_start().starts_with(&format!("{config} ")))
            .unwrap();
        lines.nth(1).unwrap().trim().to_owned()
    };
    assert_eq!(
        judged("ddp"),
        "judged at world 4 against: single@4 (fp64 arbiter, envelope single@4); ddp@4 (bitwise)"
    );
    assert_eq!(
        judged("fsdp.hybrid_shard"),
        "judged at world 4 against: ddp.hybrid_order@4 (bitwise); single@4 (fp64 arbiter, \
         envelope single@4)"
    );
    assert_eq!(
        judged("fsdp.full_shard.bf16"),
        "judged at world 4 against: ddp.bf16@4 (bitwise); single@4 (fp64 arbiter, envelope \
         ddp.bf16@4)"
    );
    assert_eq!(
        judged("ep.2.drop"),
        "judged at world 4 against: single.cap1@4 (fp64 arbiter, envelope single.cap1@4)"
    );
    assert!(models_of("fsdp.full_shard.bf16").contains("moe,"));
    assert!(models_of("ddp.bf16").contains("moe,"));
    assert!(!run.stdout.contains("no FSDP mixed precision"));
    // Hybrid shard's reference and why, under each hybrid config; the reference-only
    // configuration listed apart, never among the selectable ones.
    assert_eq!(
        run.stdout
            .matches(&format!(
                "against ddp.hybrid_order: {}",
                configs::HYBRID_VS_DDP_REASON
            ))
            .count(),
        4,
        "{}",
        run.stdout
    );
    assert!(!run.stdout.contains("override vs ddp"), "{}", run.stdout);
    let references = run
        .stdout
        .split("references only")
        .nth(1)
        .expect("the references section");
    assert!(
        references.contains(&Config::DdpHybridOrder.description())
            && references.contains("tp.2.hybrid_order"),
        "{}",
        run.stdout
    );
    assert!(!Config::all().contains(&Config::DdpHybridOrder));
    assert_eq!(
        Config::by_name("ddp.hybrid_order"),
        Some(Config::DdpHybridOrder)
    );
    assert!(run.stdout.contains("models:"), "{}", run.stdout);
    for model in lockstep::models::zoo::names() {
        assert!(
            run.stdout.contains(model),
            "{model} missing:\n{}",
            run.stdout
        );
    }
    assert!(
        run.stdout
            .contains("ddp + fsdp only (no single-device reference"),
        "{}",
        run.stdout
    );
}

/// Runs a matrix that must be refused, and checks the refusal: exit 2, the message names the
/// problem, and nothing that looks like a report is left in the output directory.
fn refused(extra: &[&str], out: &Path, expect: &[&str]) {
    let run = matrix_into(out, extra);
    assert_eq!(
        run.code,
        Some(2),
        "stdout:\n{}\nstderr:\n{}",
        run.stdout,
        run.stderr
    );
    for text in expect {
        assert!(
            run.stderr.contains(text),
            "`{text}` not in stderr:\n{}",
            run.stderr
        );
    }
    assert!(!out.join("report.json").exists(), "report.json was written");
}

#[test]
fn unknown_model_is_refused_with_the_known_names() {
    let scratch = Scratch::new("unknown-model");
    refused(
        &["--models", "nested,resnet"],
        &scratch.0,
        &["unknown model `resnet`", "nested", "gpt_moe"],
    );
}

#[test]
fn unknown_config_is_refused_with_the_known_names() {
    let scratch = Scratch::new("unknown-config");
    refused(
        &["--configs", "fsdp"],
        &scratch.0,
        &["unknown config `fsdp`", "single, ddp"],
    );
}

#[test]
fn world_size_zero_and_too_large_are_refused() {
    let scratch = Scratch::new("world");
    refused(
        &["--world-size", "2,0"],
        &scratch.0,
        &["invalid world size 0"],
    );
    refused(
        &["--world-size", "1000"],
        &scratch.0,
        &["invalid world size 1000"],
    );
}

#[test]
fn unwritable_out_dir_is_refused_before_running() {
    let scratch = Scratch::new("unwritable");
    let file = scratch.0.join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let out = file.join("reports");
    let run = matrix_into(&out, &["--models", "nested", "--world-size", "2"]);
    assert_eq!(run.code, Some(2), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stderr.contains("output directory") && run.stderr.contains("a-file"),
        "{}",
        run.stderr
    );
    // Refused before any run: no progress lines, no table.
    assert!(!run.stderr.contains("[1/"), "{}", run.stderr);
    assert!(run.stdout.is_empty(), "{}", run.stdout);
    assert!(!out.exists());
}

#[test]
fn stale_reports_are_removed_before_running() {
    let scratch = Scratch::new("stale");
    let stale = scratch.0.join("report.json");
    std::fs::write(&stale, b"{\"stale\": true}").unwrap();
    matrix::prepare_out_dir(&scratch.0).unwrap();
    assert!(!stale.exists());
    assert!(scratch.0.is_dir());
}

#[test]
fn patterns_match_exactly_or_by_glob() {
    assert!(matrix::matches("ddp", "ddp"));
    assert!(!matrix::matches("dd", "ddp"));
    assert!(matrix::matches("ddp*", "ddp"));
    assert!(matrix::matches("gpt*", "gpt_moe"));
    assert!(matrix::matches("*moe", "gpt_moe"));
    assert!(matrix::matches("*", "nested"));
    assert!(matrix::matches("t*_*n", "transformer_bn"));
    assert!(!matrix::matches("t*_*x", "transformer_bn"));
}

#[test]
fn plan_selects_expands_and_counts_runs() {
    let plan = matrix::plan(&MatrixOptions {
        models: vec!["gpt*".into(), "moe".into()],
        world_sizes: vec![2, 4, 2],
        ..MatrixOptions::default()
    })
    .unwrap();
    assert_eq!(plan.models, ["moe", "gpt", "gpt_moe", "gpt_dropout"]);
    assert_eq!(plan.world_sizes, [2, 4]);
    assert_eq!(plan.configs, Config::all());
    let fsdp = Config::fsdp().len();
    // gpt, gpt_moe and gpt_dropout: 2 single + 2 ddp + 2 ddp.bf16 + 2 ddp.fp16 + 1
    // ddp.hybrid_order (hybrid shard's reference, never repeated) + every fsdp config per
    // world size (hybrid runs at 2 and 4); moe (no single-device reference): the 7 ddp runs
    // + every fsdp config.
    // Pipelines, per model with a single-device reference (gpt, gpt_moe, gpt_dropout): at world 2 the 11
    // pp configs that fit 2 ranks (all but dp2), single.mb3 (pp.gpipe's 2N - 1 microbatches)
    // and single.mb4; at world 4 the 6 with one stage per rank (the 2-per-rank ones need 8
    // layers, the GPT has 6), dp2, single.mb7 and single.mb8.
    let pipelines = 3 * ((11 + 2) + (7 + 2));
    // Tensor and expert parallel: gpt and gpt_dropout tp.2, tp.2.sp at world 2 and tp.2, tp.4, tp.2.sp at 4
    // (no MoE: its ep rows skip); gpt_moe those plus ep.2, ep.2.allgather, ep.2.capacity,
    // ep.2.drop at 2 and ep.2, ep.4, ep.2.allgather, ep.2.capacity, ep.2.drop at 4; moe has
    // no single-device reference. Context parallel on gpt and gpt_moe (gpt_dropout's masks
    // are per whole sequence): cp.2, cp.2.allgather, cp.2.contiguous at 2, those and cp.4,
    // cp.4.allgather, cp.4.contiguous at 4.
    let model_parallel = 2 * (2 + 3) + (6 + 8) + 2 * (3 + 6);
    // Compositions: at world 2 only fsdp_x_tp2 (dp = 1) for the three decoders and
    // ep2_x_fsdp for gpt_moe; at world 4 fsdp_x_tp2, hsdp_x_tp2, pp2_x_dp and pp2_x_fsdp for
    // the three, pp2_x_tp2 for the three (gpt_dropout's keys reach the stages' module hooks)
    // and ep2_x_fsdp for gpt_moe; their simpler configurations are selected already, except
    // hsdp_x_tp2's tp.2.hybrid_order (a reference only), which runs once for each of the three;
    // fsdp_x_cp2 for gpt and gpt_moe at both worlds; cp2_x_tp2 and pp2_x_cp2 for gpt and
    // gpt_moe at world 4; cp2_x_ep2 for gpt_moe at both worlds; pp2_x_ep2 for gpt_moe at
    // world 4.
    let compositions = (3 + 1) + (4 * 3 + 3 + 1) + 3 + 2 * 2 + 2 * 2 + 2 + 1;
    // The float64 shadows: one per cell with a single-device reference (3 models × 2 worlds)
    // and one per microbatched reference (3 models × 2 worlds × 2 microbatch counts).
    let shadows = 3 * 2 + 3 * 2 * 2;
    // The fp32 variants beside the single-device shadow (single.mb2, single.mb3): gpt and
    // gpt_dropout at both worlds; gpt_moe routes tokens and has none (`lockstep::spread`).
    let spread = 2 * 2 * 2;
    // The independent mixed-precision references (single.bf16, single.fp16) beside ddp.bf16
    // and ddp.fp16: gpt, gpt_moe and gpt_dropout at both worlds; moe seeds its experts per
    // rank and has none.
    let mixed = 3 * 2 * 2;
    // The dropping references of gpt_moe's capacity rows, each with its float64 shadow:
    // single.cap4 and single.cap1 at both worlds.
    let dropping = 2 * 2 * 2;
    // The ring-ordered references of the ring rows (gpt and gpt_moe): single.cp2 and
    // single.cp2.contiguous at world 2, those and single.cp4, single.cp4.contiguous at 4.
    let ring_ordered = 2 * (2 + 4);
    assert_eq!(
        plan.run_count(),
        2 * (3 * (9 + fsdp) + (7 + fsdp))
            + mixed
            + dropping
            + ring_ordered
            + pipelines
            + model_parallel
            + compositions
            + shadows
            + spread
    );

    let fsdp_only = matrix::plan(&MatrixOptions {
        models: vec!["nested".into(), "moe".into()],
        configs: vec!["fsdp.*".into()],
        world_sizes: vec![2],
        ..MatrixOptions::default()
    })
    .unwrap();
    assert_eq!(fsdp_only.configs, Config::fsdp());
    // nested: 1 single, its float64 shadow and 2 fp32 variants + 1 ddp + 1 ddp.bf16 + 1
    // ddp.fp16 + 1 ddp.hybrid_order reference + every fsdp config; moe: the same without the
    // single-device reference, its shadow and variants.
    assert_eq!(fsdp_only.run_count(), (8 + fsdp) + (4 + fsdp));

    // At an odd world size hybrid shard launches nothing, and alone needs no references.
    let odd = |configs: &str| {
        matrix::plan(&MatrixOptions {
            models: vec!["nested".into()],
            configs: vec![configs.into()],
            world_sizes: vec![3],
            ..MatrixOptions::default()
        })
        .unwrap()
        .run_count()
    };
    assert_eq!(odd("fsdp.hybrid_shard"), 0);
    let hybrid = Config::fsdp()
        .iter()
        .filter(|c| c.name().starts_with("fsdp.hybrid_shard"))
        .count();
    assert_eq!(odd("fsdp.*"), 7 + fsdp - hybrid);
    // At an even one, hybrid shard alone needs single (and its float64 shadow) and its own
    // DDP reference, once each, and not plain DDP.
    let hybrid_alone = matrix::plan(&MatrixOptions {
        models: vec!["nested".into()],
        configs: vec!["fsdp.hybrid_shard".into()],
        world_sizes: vec![4],
        ..MatrixOptions::default()
    })
    .unwrap();
    // single, its shadow, its 2 fp32 variants, ddp.hybrid_order and the hybrid launch: 6 (7
    // if plain DDP ran too).
    assert_eq!(hybrid_alone.run_count(), 6);

    let ddp_only = matrix::plan(&MatrixOptions {
        models: vec!["nested".into()],
        configs: vec!["ddp".into()],
        ..MatrixOptions::default()
    })
    .unwrap();
    assert_eq!(ddp_only.world_sizes, [matrix::DEFAULT_WORLD_SIZE]);
    // The single-device reference still runs once, with its float64 shadow and 2 fp32
    // variants: ddp is compared against it by the fp64 arbiter.
    assert_eq!(ddp_only.run_count(), 6);

    // Mixed precision needs its own DDP reference once, and no single-device reference; a
    // selected `ddp.bf16` runs twice (its repeat), and serves the FSDP configs too.
    let count = |models: &str, configs: &str| {
        matrix::plan(&MatrixOptions {
            models: vec![models.into()],
            configs: vec![configs.into()],
            world_sizes: vec![2, 4],
            ..MatrixOptions::default()
        })
        .unwrap()
        .run_count()
    };
    // (+1 per world: the single-device reference's float64 shadow, for the arbiter's rows
    // against single; `ddp.bf16` alone has no such row, but a selected `ddp.bf16` adds its
    // independent reference `single.bf16` per world, except on moe, whose experts are
    // seeded per rank.)
    assert_eq!(count("nested", "fsdp.*.bf16"), 2 * (1 + 3 + 1));
    assert_eq!(count("nested", "fsdp.*.fp16"), 2 * (1 + 1 + 1));
    assert_eq!(count("nested", "ddp.bf16"), 2 * (2 + 1));
    assert_eq!(
        count("nested", "ddp.bf16,fsdp.full_shard.bf16"),
        2 * (2 + 1 + 1 + 1)
    );
    assert_eq!(count("nested", "ddp.*"), 2 * (2 + 2 + 2));
    assert_eq!(
        count("nested", "fsdp.full_shard,fsdp.full_shard.bf16"),
        2 * (7 + 1)
    );
    assert_eq!(count("moe", "fsdp.*.bf16"), 2 * (1 + 3));
    assert_eq!(count("moe", "ddp.bf16,fsdp.*.bf16"), 2 * (2 + 3));

    let err = matrix::plan(&MatrixOptions {
        steps: 0,
        ..MatrixOptions::default()
    })
    .unwrap_err();
    assert!(matches!(err, MatrixError::InvalidOption(_)), "{err}");
}

/// The mixed-precision FSDP names, with the DDP reference each is judged against.
const MIXED_NAMES: [(&str, &str); 4] = [
    ("fsdp.full_shard.bf16", "ddp.bf16"),
    ("fsdp.full_shard.per_layer.bf16", "ddp.bf16"),
    ("fsdp.shard_grad_op.per_layer.bf16", "ddp.bf16"),
    ("fsdp.full_shard.per_layer.fp16", "ddp.fp16"),
];

/// The FSDP names the matrix must offer: the original four (kept stable for users and CI),
/// one per FSDP option, then the mixed-precision ones.
const FSDP_NAMES: [&str; 26] = [
    "fsdp.full_shard",
    "fsdp.shard_grad_op",
    "fsdp.no_shard",
    "fsdp.full_shard.per_layer",
    "fsdp.shard_grad_op.per_layer",
    "fsdp.full_shard.per_layer.no_reshard",
    "fsdp.full_shard.per_layer.prefetch_post",
    "fsdp.full_shard.per_layer.no_prefetch",
    "fsdp.full_shard.per_layer.forward_prefetch",
    "fsdp.full_shard.blocks",
    "fsdp.full_shard.min_params",
    "fsdp.full_shard.offload",
    "fsdp.full_shard.no_sync_module_states",
    "fsdp.hybrid_shard",
    "fsdp.hybrid_shard.per_layer",
    "fsdp.shard_grad_op.blocks",
    "fsdp.shard_grad_op.min_params",
    "fsdp.no_shard.per_layer",
    "fsdp.no_shard.blocks",
    "fsdp.no_shard.min_params",
    "fsdp.hybrid_shard.blocks",
    "fsdp.hybrid_shard.min_params",
    "fsdp.full_shard.bf16",
    "fsdp.full_shard.per_layer.bf16",
    "fsdp.shard_grad_op.per_layer.bf16",
    "fsdp.full_shard.per_layer.fp16",
];

#[test]
fn every_fsdp_config_resolves_by_name_and_fsdp_star_selects_them_all() {
    let names: Vec<&str> = Config::fsdp().iter().map(|c| c.name()).collect();
    assert_eq!(names, FSDP_NAMES);
    for name in FSDP_NAMES {
        let plan = matrix::plan(&MatrixOptions {
            models: vec!["nested".into()],
            configs: vec![name.into()],
            world_sizes: vec![2],
            ..MatrixOptions::default()
        })
        .unwrap();
        let config = Config::by_name(name).unwrap();
        assert_eq!(plan.configs, [config], "{name}");
        assert!(
            config.is_fsdp() && config.fsdp_options().is_some(),
            "{name}"
        );
        assert!(!config.description().is_empty(), "{name}");
    }
    let all = matrix::plan(&MatrixOptions {
        configs: vec!["fsdp.*".into()],
        ..MatrixOptions::default()
    })
    .unwrap();
    assert_eq!(all.configs, Config::fsdp());
    // Each table row's options are what its name says.
    let opts = |name: &str| Config::by_name(name).unwrap().fsdp_options().unwrap();
    assert!(!opts("fsdp.full_shard.per_layer.no_reshard").reshard_after_forward);
    assert!(opts("fsdp.full_shard.per_layer.forward_prefetch").forward_prefetch);
    assert!(opts("fsdp.full_shard.offload").offload_params);
    assert!(!opts("fsdp.full_shard.no_sync_module_states").sync_module_states);
    assert_eq!(
        opts("fsdp.full_shard.per_layer.prefetch_post").backward_prefetch,
        BackwardPrefetch::Post
    );
    assert_eq!(
        opts("fsdp.full_shard.per_layer.no_prefetch").backward_prefetch,
        BackwardPrefetch::None
    );
    assert_eq!(
        opts("fsdp.full_shard.blocks").wrap,
        WrapPolicy::ByKind(configs::BLOCK_KINDS.to_vec())
    );
    assert_eq!(
        opts("fsdp.full_shard.min_params").wrap,
        WrapPolicy::MinParams(configs::MIN_PARAMS)
    );
    assert_eq!(
        opts("fsdp.hybrid_shard").strategy,
        ShardingStrategy::HybridShard
    );
    assert_eq!(
        opts("fsdp.shard_grad_op.per_layer.bf16").strategy,
        ShardingStrategy::ShardGradOp
    );
    assert_eq!(opts("fsdp.full_shard.bf16").wrap, WrapPolicy::Root);
    assert_eq!(
        opts("fsdp.full_shard.per_layer.fp16").wrap,
        WrapPolicy::PerLayer
    );
    // Mixed precision: the options carry the policy, and the DDP reference is the same
    // policy's (`ddp.bf16`, itself a config users can select); the rest are fp32 against
    // `ddp`, hybrid shard against `ddp.hybrid_order`.
    for c in Config::fsdp() {
        let f = c.fsdp_config().unwrap();
        let expected = MIXED_NAMES.iter().find(|(n, _)| *n == c.name());
        assert_eq!(
            f.options.mixed_precision,
            f.precision.map(Precision::policy),
            "{}",
            c.name()
        );
        assert_eq!(
            c.ddp_reference().map(Config::name),
            Some(expected.map_or(
                if c.name().starts_with("fsdp.hybrid_shard") {
                    "ddp.hybrid_order"
                } else {
                    "ddp"
                },
                |(_, r)| *r
            )),
            "{}",
            c.name()
        );
        assert_eq!(f.precision.is_some(), expected.is_some(), "{}", c.name());
    }
    for p in Precision::ALL {
        let ddp = Config::by_name(p.ddp_name()).unwrap();
        assert_eq!(ddp, Config::DdpMixed(p));
        assert_eq!(ddp.precision(), Some(p));
        assert_eq!(p.label(), p.policy().label());
        assert_eq!(ddp.name(), format!("ddp.{}", p.label()));
    }
    let ddp_star = matrix::plan(&MatrixOptions {
        configs: vec!["ddp.*".into()],
        ..MatrixOptions::default()
    })
    .unwrap();
    assert_eq!(
        ddp_star.configs,
        [
            Config::DdpMixed(Precision::Bf16),
            Config::DdpMixed(Precision::Fp16)
        ]
    );
    let bf16 = matrix::plan(&MatrixOptions {
        configs: vec!["*.bf16".into()],
        ..MatrixOptions::default()
    })
    .unwrap();
    let names: Vec<&str> = bf16.configs.iter().map(|c| c.name()).collect();
    assert_eq!(
        names,
        [
            "ddp.bf16",
            "fsdp.full_shard.bf16",
            "fsdp.full_shard.per_layer.bf16",
            "fsdp.shard_grad_op.per_layer.bf16"
        ]
    );
    // Every FSDP config is judged bitwise against its DDP reference: hybrid shard against
    // DDP averaging in its own two stages, the others against plain DDP (or DDP under
    // their policy).
    for c in Config::fsdp() {
        let f = c.fsdp_config().unwrap();
        let hybrid = f.options.strategy == ShardingStrategy::HybridShard;
        assert_eq!(f.vs_ddp, DdpCheck::Bitwise, "{}", c.name());
        let expected = match (hybrid, f.precision) {
            (_, Some(p)) => Config::DdpMixed(p),
            (true, None) => Config::DdpHybridOrder,
            (false, None) => Config::Ddp,
        };
        assert_eq!(c.ddp_reference(), Some(expected), "{}", c.name());
        assert!(
            c.policy(expected, 4).unwrap().mode() == lockstep::harness::parity::Mode::Bitwise,
            "{}",
            c.name()
        );
        assert_eq!(
            f.layout.shard_size(4),
            Ok(hybrid.then_some(2)),
            "{}",
            c.name()
        );
    }
}

#[test]
fn fsdp_configs_match_ddp_bitwise_and_single_within_tolerance() {
    let scratch = Scratch::new("fsdp");
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "nested,mlp",
            "--configs",
            "fsdp.*",
            "--world-size",
            "2",
            "--steps",
            "2",
            "--json",
        ],
    );
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let n = FSDP_NAMES.len();
    let fp32 = n - MIXED_NAMES.len();
    // Per model: one single-device run, its float64 shadow and two fp32 variants, one DDP,
    // one DDP-bf16, one DDP-fp16 and one ddp.hybrid_order reference run, one launch per FSDP
    // config.
    assert!(
        run.stderr
            .contains(&format!("matrix: {} runs in ", 2 * (8 + n))),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("FAIL"), "{}", run.stderr);
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    assert!(report.passed());
    let keys: Vec<(&str, &str, &str)> = report
        .comparisons
        .iter()
        .map(|c| (c.model.as_str(), c.config.as_str(), c.reference.as_str()))
        .collect();
    // Every config against its DDP reference and against single (mixed precision by the fp64
    // arbiter with its DDP reference's noise as the envelope).
    let rows_per_model = 2 * fp32 + 2 * MIXED_NAMES.len();
    assert_eq!(keys.len(), 2 * rows_per_model, "{keys:?}");
    for model in ["nested", "mlp"] {
        for name in FSDP_NAMES {
            let config = format!("{name}@2");
            let mixed = MIXED_NAMES.iter().find(|(n, _)| *n == name);
            let plain = if name.starts_with("fsdp.hybrid_shard") {
                "ddp.hybrid_order"
            } else {
                "ddp"
            };
            let ddp = format!("{}@2", mixed.map_or(plain, |(_, r)| *r));
            assert!(keys.contains(&(model, &config, &ddp)), "{keys:?}");
            assert!(keys.contains(&(model, &config, "single@2")), "{keys:?}");
            assert!(
                run.stderr.contains(&format!("{config} ")),
                "no {config} row:\n{}",
                run.stderr
            );
        }
    }
    // Against DDP the rows are bitwise with no override (hybrid against ddp.hybrid_order);
    // mixed-precision runs say their dtype.
    for c in report
        .comparisons
        .iter()
        .filter(|c| c.reference.starts_with("ddp"))
    {
        let dtype = MIXED_NAMES
            .iter()
            .find(|(n, _)| c.config == format!("{n}@2"))
            .map_or("fp32", |(_, r)| &r[4..]);
        assert_eq!(c.run_spec.dtype, dtype, "{} {}", c.model, c.config);
        assert_eq!(c.reference_spec.dtype, dtype, "{} {}", c.model, c.config);
        assert_eq!(c.overall().max_abs_err, 0.0, "{} {}", c.model, c.config);
        assert_eq!(c.override_reason, None, "{} {}", c.model, c.config);
        assert_eq!(
            c.reference == "ddp.hybrid_order@2",
            c.config.starts_with("fsdp.hybrid_shard"),
            "{} {}",
            c.model,
            c.config
        );
    }
    // Memory: every FSDP comparison carries rank 0's figures; full shard at world 2 keeps
    // half the (padded) flat parameter, and gathers the whole model at its peak.
    let raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(scratch.0.join("report.json")).unwrap())
            .unwrap();
    for c in raw["comparisons"].as_array().unwrap() {
        let m = &c["memory"];
        assert!(
            m["full_param_bytes_peak"].as_u64().is_some_and(|b| b > 0),
            "{c}"
        );
        assert!(m["shard_bytes"].as_u64().is_some_and(|b| b > 0), "{c}");
        assert!(
            m["model_param_bytes"].as_u64().is_some_and(|b| b > 0),
            "{c}"
        );
    }
    let full = report
        .comparisons
        .iter()
        .find(|c| c.model == "nested" && c.config == "fsdp.full_shard@2")
        .and_then(|c| c.memory)
        .unwrap();
    assert_eq!(full.model_param_bytes, 496 * 4);
    assert_eq!(full.full_param_bytes_peak, 496 * 4);
    assert_eq!(full.shard_bytes, 496 * 4 / 2);
    // The JSON rows and the human reports carry them too.
    let rows: Vec<serde_json::Value> = run
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2 * rows_per_model);
    for row in &rows {
        assert!(row["memory"]["full_param_bytes_peak"].is_u64(), "{row}");
    }
    assert!(run.stderr.contains("peak params KiB"), "{}", run.stderr);
    let md = std::fs::read_to_string(scratch.0.join("report.md")).unwrap();
    assert!(md.contains("peak full params (KiB) | shard (KiB)"), "{md}");
    assert!(md.contains("| 1.9 | 1.0 |"), "{md}");
    let html = std::fs::read_to_string(scratch.0.join("report.html")).unwrap();
    assert!(html.contains("memory (rank 0): peak full params"), "{html}");
}

/// Hybrid shard against `ddp.hybrid_order` (DDP averaging in hybrid shard's two stages):
/// bitwise, with no tolerance override, on `transformer` at world 4 too, where plain DDP's
/// rank-order sum differs in the last bits; the reference runs once per cell, plain DDP not
/// at all; odd worlds skip with the reason and launch nothing.
#[test]
fn hybrid_shard_is_bitwise_against_its_order_matched_ddp_and_skips_odd_worlds() {
    let scratch = Scratch::new("hybrid");
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "nested,transformer",
            "--configs",
            "fsdp.hybrid_shard",
            "--world-size",
            "2,3,4",
            "--steps",
            "3",
            "--json",
        ],
    );
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    // World 2 and 4, per model: single, its float64 shadow, two fp32 variants,
    // ddp.hybrid_order and hybrid; world 3: nothing runs.
    assert!(run.stderr.contains("matrix: 24 runs in "), "{}", run.stderr);
    let rows: Vec<serde_json::Value> = run
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let row = |model: &str, world: usize, reference: &str| {
        rows.iter()
            .find(|r| {
                r["model"] == model
                    && r["config"] == format!("fsdp.hybrid_shard@{world}")
                    && r["reference"] == format!("{reference}@{world}")
            })
            .unwrap_or_else(|| panic!("no {model} @{world} vs {reference} row: {rows:?}"))
    };
    assert!(!rows.iter().any(|r| r["reference"] == "ddp@4"), "{rows:?}");
    for model in ["nested", "transformer"] {
        for world in [2, 4] {
            let vs_ddp = row(model, world, "ddp.hybrid_order");
            assert_eq!(vs_ddp["status"], "pass", "{vs_ddp}");
            assert_eq!(vs_ddp["mode"], "bitwise", "{vs_ddp}");
            assert_eq!(vs_ddp["max_abs_err"], 0.0, "{vs_ddp}");
            assert!(vs_ddp["note"].is_null(), "{vs_ddp}");
            let vs_single = row(model, world, "single");
            assert_eq!(vs_single["status"], "pass", "{vs_single}");
            assert!(vs_single["note"].is_null(), "{vs_single}");
        }
        // Shard groups of world/2 ranks: each rank keeps a 1/(world/2) shard.
        let m = &row(model, 4, "ddp.hybrid_order")["memory"];
        let whole = m["model_param_bytes"].as_u64().unwrap();
        assert!(m["shard_bytes"].as_u64().unwrap() < whole, "{m}");
        for reference in ["ddp.hybrid_order", "single"] {
            let skipped = row(model, 3, reference);
            assert_eq!(skipped["status"], "skip", "{skipped}");
            assert!(
                skipped["note"]
                    .as_str()
                    .is_some_and(|n| n.contains("world size 3 does not split into 2")),
                "{skipped}"
            );
        }
    }
    assert!(!run.stderr.contains("tolerance override"), "{}", run.stderr);
    // No override anywhere in the reports.
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    assert!(report
        .comparisons
        .iter()
        .all(|c| c.override_reason.is_none()));
    let md = std::fs::read_to_string(scratch.0.join("report.md")).unwrap();
    assert!(!md.contains("override"), "{md}");
}

/// Mixed-precision FSDP at world 2 against DDP under the same policy: bitwise, one DDP
/// reference launch per policy, no single-device run or row; `moe`'s rank-local expert (which
/// FSDP ignores) is cast like every other parameter.
#[test]
fn mixed_precision_fsdp_matches_ddp_under_the_same_policy_bitwise() {
    let scratch = Scratch::new("mixed");
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "nested,transformer_bn,moe",
            "--configs",
            "fsdp.full_shard.bf16,fsdp.shard_grad_op.per_layer.bf16,\
             fsdp.full_shard.per_layer.fp16",
            "--world-size",
            "2",
            "--steps",
            "2",
            "--json",
        ],
    );
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    // Per model: ddp.bf16 + ddp.fp16 + 3 FSDP launches, and for nested (the one model here
    // with a single-device reference) the float64 shadow of it (no fp32 single run: the
    // envelope of a mixed-precision row is its DDP reference's noise).
    assert!(run.stderr.contains("matrix: 16 runs in "), "{}", run.stderr);
    let all_rows: Vec<serde_json::Value> = run
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let (vs_single, rows): (Vec<_>, Vec<_>) =
        all_rows.iter().partition(|r| r["reference"] == "single@2");
    assert_eq!(rows.len(), 3 * 3, "{rows:?}");
    assert_eq!(vs_single.len(), 3 * 3, "{vs_single:?}");
    for row in &vs_single {
        if row["model"] == "nested" {
            assert_eq!(row["status"], "pass", "{row}");
            assert_eq!(row["mode"], "arbiter", "{row}");
        } else {
            // BatchNorm statistics and a per-rank expert: no single-device reference.
            assert_eq!(row["status"], "skip", "{row}");
        }
    }
    for row in &rows {
        let config = row["config"].as_str().unwrap();
        let reference = if config.contains(".fp16@") {
            "ddp.fp16@2"
        } else {
            "ddp.bf16@2"
        };
        assert_eq!(row["reference"], reference, "{row}");
        assert_eq!(row["status"], "pass", "{row}");
        assert_eq!(row["mode"], "bitwise", "{row}");
        assert_eq!(row["max_abs_err"], 0.0, "{row}");
        assert!(row["note"].is_null(), "{row}");
        assert!(row["memory"]["shard_bytes"].is_u64(), "{row}");
    }
    assert!(
        !run.stderr.contains("no FSDP mixed precision"),
        "{}",
        run.stderr
    );
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    assert!(report.passed());
    assert_eq!(report.comparisons.len(), 3 * 3 + 3);
    for c in report
        .comparisons
        .iter()
        .filter(|c| c.reference != "single@2")
    {
        let label = if c.config.contains(".fp16@") {
            "fp16"
        } else {
            "bf16"
        };
        assert_eq!(c.reference, format!("ddp.{label}@2"));
        assert_eq!(c.run_spec.dtype, label);
        assert_eq!(c.reference_spec.dtype, label);
        assert!(c.override_reason.is_none(), "{}", c.config);
        assert_eq!(c.overall().max_abs_err, 0.0, "{} {}", c.model, c.config);
    }
}

/// `ddp.bf16` selected on its own: two launches, checked against its repeat bitwise, and
/// the independent mixed-precision reference `single.bf16` (one process, casts of its own),
/// also bitwise; no fp32 single-device run (the arbiter does not judge DDP under a policy).
#[test]
fn ddp_bf16_alone_passes_its_repeat_and_the_independent_reference() {
    let scratch = Scratch::new("ddp-bf16");
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "gpt",
            "--configs",
            "ddp.bf16",
            "--world-size",
            "2",
            "--steps",
            "2",
        ],
    );
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("matrix: 3 runs in "), "{}", run.stdout);
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    let pairs: Vec<(&str, &str)> = report
        .comparisons
        .iter()
        .map(|c| (c.config.as_str(), c.reference.as_str()))
        .collect();
    assert_eq!(
        pairs,
        [
            ("ddp.bf16@2", "ddp.bf16@2"),
            ("ddp.bf16@2", "single.bf16@2")
        ]
    );
    for c in &report.comparisons {
        assert!(c.passed, "{:?}", c.diagnosis);
        assert_eq!(c.run_spec.dtype, "bf16");
        assert_eq!(c.overall().max_abs_err, 0.0);
        assert!(c.override_reason.is_none());
    }
}

/// The mixed-precision bugs the independent reference exists for, planted in every DDP run
/// (`--fault`): each fails `ddp.fp16@2` against `single.fp16@2`, naming a tensor, while the
/// repeat row (both runs carry the bug) passes.
#[test]
fn the_matrix_catches_mixed_precision_bugs_naming_the_tensor() {
    for fault in ["other-half", "reduce-in-half", "half-master"] {
        let scratch = Scratch::new("mixed-fault");
        let run = matrix_into(
            &scratch.0,
            &[
                "--models",
                "gpt",
                "--configs",
                "ddp.fp16",
                "--world-size",
                "2",
                "--steps",
                "2",
                "--fault",
                fault,
            ],
        );
        assert_eq!(run.code, Some(1), "{fault}: {}\n{}", run.stdout, run.stderr);
        let failed = run
            .stdout
            .lines()
            .find(|l| l.starts_with("FAIL gpt ddp.fp16@2 vs single.fp16@2"))
            .unwrap_or_else(|| panic!("{fault}: no failing row\n{}", run.stdout));
        assert!(failed.contains("of `"), "{fault}: {failed}");
        let repeat = ["gpt", "ddp.fp16@2", "ddp.fp16@2", "2", "PASS"];
        assert!(
            run.stdout
                .lines()
                .any(|l| l.split_whitespace().take(5).eq(repeat)),
            "{fault}: {}",
            run.stdout
        );
    }
}

#[test]
fn fsdp_on_moe_is_checked_against_ddp_only() {
    let scratch = Scratch::new("fsdp-moe");
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "moe",
            "--configs",
            "fsdp.full_shard,fsdp.no_shard",
            "--world-size",
            "2",
            "--steps",
            "2",
        ],
    );
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    let keys: Vec<(&str, &str)> = report
        .comparisons
        .iter()
        .map(|c| (c.config.as_str(), c.reference.as_str()))
        .collect();
    assert_eq!(
        keys,
        [("fsdp.full_shard@2", "ddp@2"), ("fsdp.no_shard@2", "ddp@2")]
    );
}

#[test]
fn a_planted_divisor_bug_fails_the_matrix_with_a_report() {
    let scratch = Scratch::new("fault");
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "nested",
            "--configs",
            "ddp",
            "--world-size",
            "2",
            "--steps",
            "2",
            "--fault",
            "sum",
        ],
    );
    assert_eq!(run.code, Some(1), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains("FAIL nested ddp@2 vs single@2"),
        "{}",
        run.stdout
    );
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    assert!(!report.passed());
    let failed: Vec<(&str, &str)> = report
        .comparisons
        .iter()
        .filter(|c| !c.passed)
        .map(|c| (c.config.as_str(), c.reference.as_str()))
        .collect();
    // Both DDP runs carry the bug, so only the single-device reference exposes it.
    assert_eq!(failed, [("ddp@2", "single@2")]);
}

#[test]
fn failed_runs_are_error_rows_of_an_incomplete_report() {
    let scratch = Scratch::new("timeout");
    // No launch finishes in a microsecond: every DDP and FSDP run times out, each in a
    // launch of its own (`--isolated`). (One FSDP config suffices; each timed-out launch
    // costs most of a second.)
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "nested",
            "--configs",
            "single,ddp,fsdp.full_shard",
            "--world-size",
            "2",
            "--steps",
            "1",
            "--timeout",
            "0.000001",
            "--isolated",
        ],
    );
    assert_eq!(run.code, Some(1), "{}\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("ERROR"), "{}", run.stdout);
    assert!(run.stdout.contains("timed out"), "{}", run.stdout);
    assert!(run.stderr.contains("INCOMPLETE"), "{}", run.stderr);
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    assert!(!report.complete && !report.passed());
    // single vs its repeat passed; every row that needed a DDP or FSDP run is an error.
    assert_eq!(report.summary.passed, 1, "{:?}", report.summary);
    let errored: Vec<(&str, &str)> = report
        .errors
        .iter()
        .map(|e| (e.config.as_str(), e.reference.as_str()))
        .collect();
    assert_eq!(
        errored,
        [
            ("ddp@2", "single@2"),
            ("ddp@2", "ddp@2"),
            ("fsdp.full_shard@2", "ddp@2"),
            ("fsdp.full_shard@2", "single@2")
        ]
    );
    assert_eq!(report.summary.errors, 4);
    for e in &report.errors {
        assert!(e.details.contains("timed out"), "{e:?}");
    }
    let markdown = std::fs::read_to_string(scratch.0.join("report.md")).unwrap();
    assert!(
        markdown.contains("INCOMPLETE: 4 comparisons could not be made"),
        "{markdown}"
    );
    assert!(markdown.contains("**ERROR**"), "{markdown}");
    let junit = std::fs::read_to_string(scratch.0.join("junit.xml")).unwrap();
    let doc = roxmltree::Document::parse(&junit).unwrap();
    let errors = doc
        .descendants()
        .filter(|n| n.has_tag_name("error"))
        .count();
    assert_eq!(errors, 4, "{junit}");
    assert!(junit.contains("errors=\"4\""), "{junit}");
    let html = std::fs::read_to_string(scratch.0.join("report.html")).unwrap();
    assert!(
        html.contains("INCOMPLETE") && html.contains(">ERROR<"),
        "a page without the errors"
    );
}

/// A planted hang: the last rank of every DDP run stops before its first gradient
/// all-reduce. The matrix names the desync from every rank's flight recorder, in its output
/// and in the report, and a report comparison against a clean one flags the errored rows.
#[test]
fn planted_hang_shows_every_flight_recorder_and_regresses_in_compare() {
    let scratch = Scratch::new("hang");
    let clean = scratch.0.join("clean");
    let args = [
        "--models",
        "nested",
        "--configs",
        "ddp",
        "--world-size",
        "2",
        "--steps",
        "1",
    ];
    let run = matrix_into(&clean, &args);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let hung = scratch.0.join("hung");
    let mut planted = args.to_vec();
    planted.extend(["--fault", "stall", "--timeout", "3"]);
    let run = matrix_into(&hung, &planted);
    assert_eq!(run.code, Some(1), "{}\n{}", run.stdout, run.stderr);
    for needle in [
        "timed out after 3.0 s",
        "flight recorder of rank 0",
        "flight recorder of rank 1",
        "diagnosis: desync on group world: rank 0 inside collective",
        "all_reduce",
        "which 1 never issued",
    ] {
        assert!(
            run.stdout.contains(needle),
            "no {needle:?} in\n{}",
            run.stdout
        );
    }
    let report = read_json(&hung.join("report.json")).unwrap();
    assert!(!report.complete);
    let e = report.errors.first().expect("an error row");
    assert!(
        e.details.contains("flight recorder of rank 1")
            && e.details.contains("desync on group world"),
        "{}",
        e.details
    );
    let compare = lockstep(&[
        "compare",
        clean.join("report.json").to_str().unwrap(),
        hung.join("report.json").to_str().unwrap(),
    ]);
    assert_eq!(
        compare.code,
        Some(1),
        "{}\n{}",
        compare.stdout,
        compare.stderr
    );
    assert!(compare.stdout.contains("ERRORED"), "{}", compare.stdout);
    assert!(!compare.stdout.contains("VANISHED"), "{}", compare.stdout);
}

/// The pipeline rows: every `pp.*` configuration runs or is skipped with its reason, each
/// judged against `single@N` and `single.mbM@N`, and the plan counts exactly the runs made.
#[test]
fn pipeline_rows_pass_and_the_plan_counts_every_run() {
    let plan = matrix::plan(&MatrixOptions {
        models: vec!["gpt".into(), "mlp".into()],
        configs: vec!["pp.*".into()],
        world_sizes: vec![4],
        steps: 3,
        ..MatrixOptions::default()
    })
    .unwrap();
    let result = matrix::run_quietly(&plan);
    assert_eq!(result.runs, plan.run_count());
    assert_eq!(result.failed_runs, 0);
    for row in &result.rows {
        assert!(row.config.starts_with("pp."), "{row:?}");
        match row.status {
            RowStatus::Pass => {}
            RowStatus::Skip => assert!(
                row.note.as_deref().is_some_and(|n| !n.is_empty()),
                "{row:?}"
            ),
            _ => panic!(
                "{} {} vs {}: {:?}",
                row.model, row.config, row.reference, row.note
            ),
        }
    }
    // mlp has no tied weights and a chain of layers: bitwise against the microbatched run.
    let mlp = result
        .rows
        .iter()
        .find(|r| r.model == "mlp" && r.config == "pp.1f1b@4" && r.reference == "single.mb8@4")
        .expect("mlp pp.1f1b row");
    assert_eq!(mlp.mode, "bitwise");
    assert_eq!(mlp.max_abs_err, Some(0.0));
    // Two stages per rank need 8 layers at world 4; the GPT has 6.
    let skipped = result
        .rows
        .iter()
        .find(|r| r.model == "gpt" && r.config == "pp.zbv@4")
        .expect("gpt zbv row");
    assert_eq!(skipped.status, RowStatus::Skip);
    assert!(skipped
        .note
        .as_deref()
        .unwrap_or_default()
        .contains("8 stages need at least 8 layers"));
}

/// The tensor- and expert-parallel rows: every `tp.*` and `ep.*` configuration passes against
/// `single@N` on the decoders or is skipped with its reason, and the plan counts every run.
#[test]
fn tensor_and_expert_parallel_rows_pass() {
    let plan = matrix::plan(&MatrixOptions {
        models: vec!["gpt".into(), "gpt_moe".into(), "transformer".into()],
        configs: vec!["tp.*".into(), "ep.*".into()],
        world_sizes: vec![2, 4],
        steps: 3,
        ..MatrixOptions::default()
    })
    .unwrap();
    let result = matrix::run_quietly(&plan);
    assert_eq!(result.runs, plan.run_count());
    assert_eq!(result.failed_runs, 0);
    let mut passed = 0;
    for row in &result.rows {
        // A capacity row is judged against the reference dropping at its factor.
        let reference = match row.config.split('@').next() {
            Some("ep.2.capacity") => "single.cap4",
            Some("ep.2.drop") => "single.cap1",
            _ => "single",
        };
        assert_eq!(
            row.reference,
            format!("{reference}@{}", row.world_size),
            "{row:?}"
        );
        match row.status {
            RowStatus::Pass => passed += 1,
            RowStatus::Skip => {
                assert!(
                    row.note.as_deref().is_some_and(|n| !n.is_empty()),
                    "{row:?}"
                )
            }
            _ => panic!("{} {}: {:?}", row.model, row.config, row.note),
        }
    }
    // gpt: tp.2, tp.2.sp @2 and tp.2, tp.4, tp.2.sp @4; gpt_moe: those and ep.2,
    // ep.2.allgather, ep.2.capacity, ep.2.drop @2, ep.2, ep.4, ep.2.allgather, ep.2.capacity,
    // ep.2.drop @4; transformer: tp.2 @2, tp.2, tp.4 @4.
    assert_eq!(passed, 5 + 14 + 3);
}

/// Subtests: a model's configurations share one launch per world size, and that changes no
/// bit — every value of every comparison equals what a launch per run (`--isolated`) gives.
#[test]
fn configurations_in_one_launch_give_the_bits_of_one_launch_each() {
    let scratch = Scratch::new("subtests");
    let args = [
        "--models",
        "nested,gpt",
        "--configs",
        "ddp,fsdp.full_shard,fsdp.full_shard.per_layer,pp.1f1b,tp.2",
        "--world-size",
        "2",
        "--steps",
        "2",
    ];
    let together = scratch.0.join("together");
    let run = matrix_into(&together, &args);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let isolated = scratch.0.join("isolated");
    let mut alone = args.to_vec();
    alone.push("--isolated");
    let run = matrix_into(&isolated, &alone);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let a = read_json(&together.join("report.json")).unwrap();
    let b = read_json(&isolated.join("report.json")).unwrap();
    assert_eq!(a.comparisons.len(), b.comparisons.len());
    assert!(a.comparisons.len() >= 12, "{}", a.comparisons.len());
    for (x, y) in a.comparisons.iter().zip(&b.comparisons) {
        assert_eq!(
            (&x.model, &x.config, &x.reference),
            (&y.model, &y.config, &y.reference)
        );
        // Same statistics, to the bit, for every quantity.
        assert_eq!(x.losses, y.losses, "{} {}", x.model, x.config);
        assert_eq!(x.grad_norms, y.grad_norms, "{} {}", x.model, x.config);
        assert_eq!(x.params, y.params, "{} {}", x.model, x.config);
        assert_eq!(x.grads, y.grads, "{} {}", x.model, x.config);
    }
}

/// A hang inside a shared launch is charged to the configuration that hung (with every
/// rank's flight recorder), the configurations after it still run, in launches of their
/// own, and nothing already finished is lost.
#[test]
fn a_hang_in_a_shared_launch_is_charged_to_its_configuration_only() {
    let scratch = Scratch::new("subtest-hang");
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "nested",
            "--configs",
            "ddp,fsdp.full_shard,fsdp.no_shard",
            "--world-size",
            "2",
            "--steps",
            "1",
            "--fault",
            "stall",
            "--timeout",
            "3",
        ],
    );
    assert_eq!(run.code, Some(1), "{}\n{}", run.stdout, run.stderr);
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    // DDP (the first in the launch, carrying the planted stall) hung, so did its fresh
    // repeat; the FSDP launches after it ran alone and agree with single device.
    for e in &report.errors {
        assert!(
            e.config.starts_with("ddp@2") || e.reference == "ddp@2",
            "{e:?}"
        );
    }
    let hung = report
        .errors
        .iter()
        .find(|e| e.config == "ddp@2" && e.reference == "single@2")
        .expect("the hung DDP row");
    assert!(
        hung.details.contains("flight recorder of rank 1") && hung.details.contains("desync"),
        "{}",
        hung.details
    );
    for config in ["fsdp.full_shard@2", "fsdp.no_shard@2"] {
        let c = report
            .comparisons
            .iter()
            .find(|c| c.config == config && c.reference == "single@2")
            .unwrap_or_else(|| panic!("{config} against single"));
        assert!(c.passed, "{config}: {:?}", c.diagnosis);
    }
}

/// A shared launch that fails after every configuration finished (here: past an absurd
/// timeout) did not end cleanly; the last configuration in it carries the failure, the
/// earlier ones keep their records.
#[test]
fn a_shared_launch_failing_after_the_last_barrier_charges_the_last_configuration() {
    let scratch = Scratch::new("subtest-late");
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "nested",
            "--configs",
            "fsdp.full_shard",
            "--world-size",
            "2",
            "--steps",
            "1",
            "--timeout",
            "0.000001",
        ],
    );
    assert_eq!(run.code, Some(1), "{}\n{}", run.stdout, run.stderr);
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    let errored: Vec<(&str, &str)> = report
        .errors
        .iter()
        .map(|e| (e.config.as_str(), e.reference.as_str()))
        .collect();
    // ddp (first in the launch) finished; fsdp.full_shard (last) carries the timeout.
    assert_eq!(
        errored,
        [
            ("fsdp.full_shard@2", "ddp@2"),
            ("fsdp.full_shard@2", "single@2")
        ]
    );
    for e in &report.errors {
        assert!(e.details.contains("timed out"), "{e:?}");
    }
}

/// Compositions at world 4: every row passes against single and against the simpler
/// configuration it reduces to, which runs as a reference although not selected; the
/// world-8-only composition is skipped with the mesh's reason.
#[test]
fn composition_rows_pass_against_single_and_their_simpler_configuration() {
    let plan = matrix::plan(&MatrixOptions {
        models: vec!["gpt_moe".into(), "nested".into()],
        configs: vec!["*x*".into()],
        world_sizes: vec![4],
        steps: 3,
        ..MatrixOptions::default()
    })
    .unwrap();
    let result = matrix::run_quietly(&plan);
    assert_eq!(result.runs, plan.run_count());
    assert_eq!(result.failed_runs, 0);
    let find = |model: &str, config: &str, reference: &str| {
        result
            .rows
            .iter()
            .find(|r| r.model == model && r.config == config && r.reference == reference)
            .unwrap_or_else(|| panic!("no row {model} {config} vs {reference}"))
    };
    for (config, simpler, mode) in [
        ("fsdp_x_tp2@4", "tp.2@4", "bitwise"),
        ("hsdp_x_tp2@4", "tp.2.hybrid_order@4", "bitwise"),
        ("pp2_x_fsdp@4", "pp2_x_dp@4", "bitwise"),
        ("ep2_x_fsdp@4", "ep.2@4", "bitwise"),
    ] {
        let row = find("gpt_moe", config, simpler);
        assert_eq!(row.status, RowStatus::Pass, "{row:?}");
        assert_eq!(row.mode, mode, "{row:?}");
        let row = find("gpt_moe", config, "single@4");
        assert_eq!(row.status, RowStatus::Pass, "{row:?}");
    }
    let row = find("gpt_moe", "pp2_x_tp2@4", "single@4");
    assert_eq!(row.status, RowStatus::Pass, "{row:?}");
    let row = find("gpt_moe", "pp2_x_tp2_x_dp@4", "single@4");
    assert_eq!(row.status, RowStatus::Skip, "{row:?}");
    assert!(
        row.note.as_deref().is_some_and(|n| n.contains("dp ≥ 2")),
        "{row:?}"
    );
    // nested: no TP plan and no experts, so only the data and pipeline compositions run.
    assert_eq!(
        find("nested", "pp2_x_fsdp@4", "pp2_x_dp@4").status,
        RowStatus::Pass
    );
    let row = find("nested", "fsdp_x_tp2@4", "single@4");
    assert_eq!(row.status, RowStatus::Skip, "{row:?}");
    assert!(
        row.note.as_deref().is_some_and(|n| n.contains("nested")),
        "{row:?}"
    );
    assert!(result
        .rows
        .iter()
        .all(|r| r.status == RowStatus::Pass || r.status == RowStatus::Skip));
}

/// Every composition that names a simpler configuration names one that exists and that the
/// matrix launches beside compositions (a tensor/expert-parallel row or a composition), so
/// its row against it can never silently vanish.
#[test]
fn every_composition_reduces_to_a_known_launchable_configuration() {
    for c in configs::composition_configs() {
        let Some((name, _)) = c.reduces_to else {
            continue;
        };
        let simpler = Config::by_name(name)
            .unwrap_or_else(|| panic!("{} reduces to unknown `{name}`", c.name));
        assert_eq!(c.simpler(), Some(simpler));
        assert!(
            simpler.model_parallel_config().is_some() || simpler.composition_config().is_some(),
            "{} reduces to {name}, which the matrix does not launch as a reference",
            c.name
        );
    }
}

/// Exec'd ranks (`--exec-ranks`: each rank a fresh `lockstep rank` process, what NCCL runs
/// need) give the forked ranks' bits: every per-step value of every comparison is equal.
#[test]
fn exec_ranks_give_the_bits_of_forked_ranks() {
    let forked = Scratch::new("forked");
    let exec = Scratch::new("exec");
    let selection = [
        "--models",
        "mlp,gpt",
        "--configs",
        "ddp,fsdp.full_shard",
        "--world-size",
        "2",
        "--steps",
        "3",
    ];
    let a = matrix_into(&forked.0, &selection);
    let mut with_exec = selection.to_vec();
    with_exec.push("--exec-ranks");
    let b = matrix_into(&exec.0, &with_exec);
    assert_eq!(a.code, Some(0), "{}{}", a.stdout, a.stderr);
    assert_eq!(b.code, Some(0), "{}{}", b.stdout, b.stderr);
    let fork_report = read_json(&forked.0.join("report.json")).unwrap();
    let exec_report = read_json(&exec.0.join("report.json")).unwrap();
    assert!(!fork_report.steps.is_empty());
    assert_eq!(fork_report.steps, exec_report.steps);
}

/// On NCCL and `--device cuda` every configuration may be selected.
#[test]
fn nccl_and_cuda_plan_every_configuration() {
    // Every configuration's training code creates its tensors on its parameters' device
    // (tests/device_plumbing.rs), so planning refuses none on NCCL or `--device cuda`; whether
    // this machine can run them is `check_backend`'s question, asked before anything runs.
    for (backend, device) in [
        (
            lockstep_core::comm::Backend::Nccl,
            lockstep::device::ComputeDevice::Cuda,
        ),
        (
            lockstep_core::comm::Backend::Cpu,
            lockstep::device::ComputeDevice::Cuda,
        ),
    ] {
        let plan = matrix::plan(&MatrixOptions {
            backend,
            device,
            ..MatrixOptions::default()
        })
        .expect("every configuration plans on CUDA");
        assert_eq!(plan.configs.len(), Config::all().len());
    }
}

/// The verdict does not change with the machine: a representative slice of the matrix (the
/// models whose rounding compounds most, each kind of parallelism) over 20 steps passes with
/// libtorch's kernels switched to AVX2 and to its portable default, as it does on this
/// machine's own (the fp64 arbiter's envelope moves with each machine's rounding;
/// docs/parity.md). The run is a dev-profile binary, so the slice is kept small.
#[test]
fn the_slice_passes_on_other_cpu_kernels_over_20_steps_avx2() {
    the_slice_passes_on_other_cpu_kernels_over_20_steps("avx2");
}

/// [`the_slice_passes_on_other_cpu_kernels_over_20_steps_avx2`] on libtorch's portable
/// kernels: a test of its own (half a minute each), so the two run side by side.
#[test]
fn the_slice_passes_on_other_cpu_kernels_over_20_steps_portable() {
    the_slice_passes_on_other_cpu_kernels_over_20_steps("default");
}

fn the_slice_passes_on_other_cpu_kernels_over_20_steps(capability: &str) {
    let scratch = Scratch::new(&format!("capability_{capability}"));
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .env("ATEN_CPU_CAPABILITY", capability)
        .args([
            "matrix",
            "--out",
            scratch.0.to_str().unwrap(),
            "--models",
            "nested,transformer,gpt_moe",
            "--configs",
            "ddp,fsdp.full_shard,fsdp.hybrid_shard,tp.2,ep.2,pp.1f1b,pp.interleaved_1f1b,fsdp_x_tp2",
            "--world-size",
            "2,4",
            "--steps",
            "20",
            "--seed",
            "1",
        ])
        .output()
        .expect("run the lockstep binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!stdout.contains("FAIL"), "{stdout}");
    let report = std::fs::read_to_string(scratch.0.join("report.json")).unwrap();
    assert!(report.contains("\"mode\": \"arbiter\""), "no arbiter row");
}

/// Skipped comparisons reach the report files with their reasons, and pairs that cannot run
/// at all are counted, not listed: `moe` (no single-device reference) runs `ddp`, whose row
/// against `single` is skipped with why; `ep.4` cannot run at world 2 on either model.
#[test]
fn reports_list_skipped_rows_and_count_inapplicable_pairs() {
    let scratch = Scratch::new("skipped");
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "moe,gpt",
            "--configs",
            "ddp,ep.4",
            "--world-size",
            "2",
            "--steps",
            "2",
        ],
    );
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains("2 inapplicable pairs not listed"),
        "{}",
        run.stdout
    );
    assert!(!run.stdout.contains("ep.4@2"), "{}", run.stdout);
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    assert_eq!(report.summary.inapplicable, 2);
    let skipped: Vec<(&str, &str, &str)> = report
        .skipped
        .iter()
        .map(|k| (k.model.as_str(), k.config.as_str(), k.reference.as_str()))
        .collect();
    assert_eq!(skipped, [("moe", "ddp@2", "single@2")]);
    assert!(
        report.skipped[0].reason.contains("seeded per rank"),
        "{:?}",
        report.skipped[0]
    );
    let md = std::fs::read_to_string(scratch.0.join("report.md")).unwrap();
    assert!(md.contains("1 skipped (listed with why)"), "{md}");
    assert!(md.contains("| moe | ddp@2 | single@2 | skip |"), "{md}");
    let junit = std::fs::read_to_string(scratch.0.join("junit.xml")).unwrap();
    assert!(junit.contains("skipped=\"1\""), "{junit}");
    assert!(
        junit.contains("<skipped message=\"no single-device reference"),
        "{junit}"
    );
    let html = std::fs::read_to_string(scratch.0.join("report.html")).unwrap();
    assert!(
        html.contains(">skip</span>: no single-device reference"),
        "{html}"
    );
}

/// A `tp.2` report shows what the plan did: every tensor's placement (the split ones by
/// name, with their dimension) and the collectives each step issued, so a user sees their
/// layers split rather than silently replicated.
#[test]
fn a_tp2_report_lists_the_split_tensors_and_the_collectives_per_step() {
    let scratch = Scratch::new("tp2-plan");
    let report = gpt_report_at_world_2(&scratch.0, "tp.2");
    let c = &report.comparisons[0];
    let placement = |t: &str| placement_of(c, t);
    assert_eq!(
        placement("layers.0.attention.wq.weight"),
        Some("shard(dim 0) over tp=2")
    );
    assert_eq!(
        placement("layers.0.attention.wo.weight"),
        Some("shard(dim 1) over tp=2")
    );
    assert_eq!(placement("norm.weight"), Some("replicated"));
    let collectives = c
        .collectives_per_step
        .as_ref()
        .expect("counted collectives");
    assert!(
        collectives
            .iter()
            .any(|e| e.op == "all_reduce" && e.group == "tp[0,1]" && e.calls > 0),
        "{collectives:?}"
    );
    let md = std::fs::read_to_string(scratch.0.join("report.md")).unwrap();
    assert!(
        md.contains("`layers.0.attention.wq.weight` shard(dim 0) over tp=2"),
        "{md}"
    );
    assert!(md.contains("collectives per step (rank 0, step 0): all_reduce on tp[0,1]"));
    let html = std::fs::read_to_string(scratch.0.join("report.html")).unwrap();
    assert!(html.contains("<p class=\"plan\">plan: "), "{html}");
}

/// An FSDP report shows its units: every parameter with the unit that holds it and the ranks
/// it is sharded over (NO_SHARD: replicated); DDP and FSDP reports show each step's
/// collectives: per-layer FULL_SHARD gathers each of mlp's 4 units for forward and again for
/// backward and reduce-scatters each once, NO_SHARD and DDP all-reduce the one unit or bucket.
#[test]
fn an_fsdp_report_lists_each_parameters_unit() {
    let scratch = Scratch::new("fsdp-plan");
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "mlp",
            "--configs",
            "ddp,fsdp.full_shard.per_layer,fsdp.no_shard",
            "--world-size",
            "2",
            "--steps",
            "2",
        ],
    );
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    let placement = |config: &str, tensor: &str| {
        report
            .comparisons
            .iter()
            .find(|c| c.config == config)
            .and_then(|c| c.placements.iter().find(|p| p.tensor == tensor))
            .map(|p| p.placement.clone())
    };
    assert_eq!(
        placement("fsdp.full_shard.per_layer@2", "layers.2.weight").as_deref(),
        Some("FSDP unit `layers.2`, sharded over 2 ranks")
    );
    assert!(placement("fsdp.no_shard@2", "layers.2.weight")
        .is_some_and(|p| p.starts_with("replicated")));
    let calls = |config: &str| -> Vec<(String, u64)> {
        let c = report.comparisons.iter().find(|c| c.config == config);
        let entries = c.and_then(|c| c.collectives_per_step.clone());
        entries
            .expect("counted collectives")
            .into_iter()
            .map(|e| (format!("{} on {}", e.op, e.group), e.calls))
            .collect()
    };
    let on_world = |pairs: &[(&str, u64)]| -> Vec<(String, u64)> {
        pairs
            .iter()
            .map(|(op, n)| (format!("{op} on world"), *n))
            .collect()
    };
    assert_eq!(
        calls("fsdp.full_shard.per_layer@2"),
        on_world(&[("all_gather", 8), ("reduce_scatter", 4)])
    );
    assert_eq!(calls("fsdp.no_shard@2"), on_world(&[("all_reduce", 1)]));
    assert_eq!(calls("ddp@2"), on_world(&[("all_reduce", 1)]));
    let md = std::fs::read_to_string(scratch.0.join("report.md")).unwrap();
    assert!(
        md.contains("collectives per step (rank 0, step 0): all_gather on world: 8 calls"),
        "{md}"
    );
}

/// A pipeline report shows where each parameter ran: its stage and pipeline rank, a tied
/// weight on both stages with its gradient parts summed, and each step's point-to-point
/// traffic across the stage boundary beside the tied weight's all-reduce.
#[test]
fn a_pipeline_report_lists_each_parameters_stage() {
    let scratch = Scratch::new("pp-plan");
    let report = gpt_report_at_world_2(&scratch.0, "pp.1f1b");
    let c = &report.comparisons[0];
    let placement = |t: &str| placement_of(c, t);
    assert_eq!(
        placement("layers.0.attention.wq.weight"),
        Some("stage 0 (pipeline rank 0)")
    );
    assert_eq!(placement("norm.weight"), Some("stage 1 (pipeline rank 1)"));
    assert_eq!(
        placement("tok_embeddings.weight"),
        Some("tied: stage 0 (pipeline rank 0), stage 1 (pipeline rank 1), gradient parts summed")
    );
    let ops: Vec<String> = c
        .collectives_per_step
        .as_ref()
        .expect("counted collectives")
        .iter()
        .map(|e| format!("{} on {}", e.op, e.group))
        .collect();
    assert!(
        ops.contains(&"send on pp-edge[0,1]".to_owned())
            && ops.contains(&"recv on pp-grad[0,1]".to_owned())
            && ops.contains(&"all_reduce on pp-tied[0,1]".to_owned()),
        "{ops:?}"
    );
}

/// docs/matrix.md's configuration table says what each configuration is compared against;
/// the catalog's judging edges (`Config::edges`) decide it. Every selectable configuration has
/// a row, every edge's reference is named in its row (or the row it refers to with "as
/// `x`"), and no row denies an edge the catalog has.
#[test]
fn the_docs_table_names_every_judging_edge() {
    use lockstep::configs::Against;
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/matrix.md"))
        .expect("docs/matrix.md");
    let table = doc
        .split("| config | what runs | compared against |")
        .nth(1)
        .expect("the configuration table");
    let mut against: Vec<(Vec<String>, String)> = Vec::new();
    for line in table.lines().skip(2).take_while(|l| l.starts_with("| ")) {
        let cols: Vec<&str> = line.split(" | ").collect();
        let names = cols[0]
            .trim_start_matches("| ")
            .split("`, `")
            .map(|n| n.trim_matches(|c| c == '`' || c == ' ').to_owned())
            .collect();
        against.push((names, cols[2].trim_end_matches(" |").to_owned()));
    }
    let column = |name: &str| -> Option<String> {
        let mut text = against
            .iter()
            .find(|(n, _)| n.iter().any(|x| x == name))?
            .1
            .clone();
        // Follow "as `x`" to the row it refers to (at most a few hops).
        for _ in 0..3 {
            let Some(rest) = text.split("as `").nth(1) else {
                break;
            };
            let target = rest.split('`').next().unwrap_or_default().to_owned();
            let more = against
                .iter()
                .find(|(n, _)| n.contains(&target))
                .map(|(_, t)| t.clone())
                .unwrap_or_default();
            text = format!(
                "{}; {more}",
                text.replacen(&format!("as `{target}`"), "", 1)
            );
        }
        Some(text)
    };
    let mut problems = Vec::new();
    for config in Config::all() {
        let Some(text) = column(config.name()) else {
            problems.push(format!("`{}` has no row", config.name()));
            continue;
        };
        for edge in config.edges(4) {
            let wanted = match edge.against {
                Against::Repeat => "repeat".to_owned(),
                Against::Microbatched(_) => "`single.mbM@N`".to_owned(),
                other => format!("`{}`", other.at(config, 4).replace("@4", "@N")),
            };
            if !text.contains(&wanted) {
                problems.push(format!(
                    "`{}`: {wanted} not named in: {text}",
                    config.name()
                ));
            }
            if edge.against == Against::Single && text.contains("no row against `single@N`") {
                problems.push(format!(
                    "`{}` denies its row against single@N",
                    config.name()
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The report of `config` on `gpt` at world 2 over 2 steps, which must pass.
fn gpt_report_at_world_2(dir: &Path, config: &str) -> lockstep::harness::report::Report {
    let args = [
        "--models",
        "gpt",
        "--configs",
        config,
        "--world-size",
        "2",
        "--steps",
        "2",
    ];
    let run = matrix_into(dir, &args);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    read_json(&dir.join("report.json")).unwrap()
}

/// Where `tensor` lived in comparison `c`'s run, as its report says.
fn placement_of<'a>(c: &'a lockstep::harness::parity::Comparison, tensor: &str) -> Option<&'a str> {
    c.placements
        .iter()
        .find(|p| p.tensor == tensor)
        .map(|p| p.placement.as_str())
}

/// Every pipeline configuration and every composition with a pipeline, at world 2, 4 and 8,
/// with sends completing only once their receive is posted (NCCL's rendezvous): none relies
/// on buffered sends (docs/comm.md). An unknown mode is refused before anything runs.
#[test]
fn pipelines_and_compositions_run_under_rendezvous_point_to_point() {
    let scratch = Scratch::new("rendezvous");
    let run = matrix_into(
        &scratch.0,
        &[
            "--p2p",
            "rendezvous",
            "--world-size",
            "2,4,8",
            "--configs",
            "pp*,*pp2*",
            "--models",
            "mlp_wide,gpt",
        ],
    );
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains(" 0 failed, 0 skipped, 0 run errors"),
        "{}",
        run.stdout
    );
    let bad = Scratch::new("rendezvous-bad");
    refused(
        &["--p2p", "eager", "--models", "mlp"],
        &bad.0,
        &["eager", "buffered", "rendezvous"],
    );
}
