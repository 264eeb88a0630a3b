//! The zoo's contract: deterministic parameters and batches, PyTorch's names, tied weights
//! that are one tensor, lossless safetensors round trips and load errors that name keys.

use lockstep_models::{zoo, LayerHooks, LayerKind, Model, ModelError, NoHooks};
use std::path::PathBuf;
use tch::{Kind, Tensor};

fn build(name: &str, seed: u64, rank: usize) -> Box<dyn Model> {
    zoo::build(name, seed, rank).expect("zoo model builds")
}

fn names(m: &dyn Model) -> Vec<String> {
    m.named_parameters().into_iter().map(|(n, _)| n).collect()
}

fn bitwise_eq(a: &Tensor, b: &Tensor) -> bool {
    a.size() == b.size() && a.kind() == b.kind() && a.equal(b)
}

fn temp_file(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "lockstep-models-{}-{tag}.safetensors",
        std::process::id()
    ))
}

#[test]
fn zoo_lists_every_model_and_rejects_unknown_names() {
    assert_eq!(
        zoo::names(),
        [
            "nested",
            "transformer",
            "transformer_bn",
            "moe",
            "mlp",
            "mlp_wide",
            "gpt",
            "gpt_moe",
            "gpt_dropout"
        ]
    );
    let err = zoo::build("resnet", 0, 0)
        .err()
        .expect("unknown name fails");
    let msg = err.to_string();
    assert!(matches!(err, ModelError::UnknownModel { .. }));
    assert!(
        msg.contains("resnet") && msg.contains("nested, transformer"),
        "{msg}"
    );
}

#[test]
fn same_seed_same_params_and_only_rank_local_params_differ_across_ranks() {
    for name in zoo::names() {
        let a = build(name, 0, 0);
        let b = build(name, 0, 0);
        let other_rank = build(name, 0, 1);
        let other_seed = build(name, 1, 0);
        let tags = a.tags();
        let mut seed_changed_something = false;
        for (((n, pa), (_, pb)), ((_, pr), (_, ps))) in a
            .named_parameters()
            .iter()
            .zip(b.named_parameters().iter())
            .zip(
                other_rank
                    .named_parameters()
                    .iter()
                    .zip(other_seed.named_parameters().iter()),
            )
        {
            assert!(bitwise_eq(pa, pb), "{name}: {n} differs between two builds");
            if tags.is_rank_local(n) {
                assert!(
                    !pa.equal(pr),
                    "{name}: rank-local {n} is the same on ranks 0 and 1"
                );
            } else {
                assert!(
                    bitwise_eq(pa, pr),
                    "{name}: shared {n} differs between ranks"
                );
            }
            seed_changed_something |= !pa.equal(ps);
        }
        assert!(
            seed_changed_something,
            "{name}: the run seed changes nothing"
        );
    }
}

#[test]
fn inputs_depend_on_rank_and_step_only() {
    for name in zoo::names() {
        let m = build(name, 0, 0);
        let other = build(name, 0, 3);
        let a = m.input(1, 2).expect("input");
        let b = other.input(1, 2).expect("input");
        for (x, y) in a.inputs.iter().zip(&b.inputs) {
            assert!(
                bitwise_eq(x, y),
                "{name}: batch depends on the building rank"
            );
        }
        let r = m.input(2, 2).expect("input");
        let s = m.input(1, 3).expect("input");
        assert!(
            !a.inputs[0].equal(&r.inputs[0]),
            "{name}: ranks share a batch"
        );
        assert!(
            !a.inputs[0].equal(&s.inputs[0]),
            "{name}: steps share a batch"
        );
    }
}

#[test]
fn parameter_names_and_counts_follow_pytorch() {
    let nested = build("nested", 0, 0);
    assert_eq!(
        names(nested.as_ref()),
        [
            "module.0.weight",
            "module.0.bias",
            "module.1.0.weight",
            "module.1.0.bias",
            "module.1.1.weight",
            "module.1.1.bias",
            "module.2.weight",
            "module.2.bias",
            "module.3.weight",
            "module.3.bias"
        ]
    );
    assert_eq!(nested.num_parameters(), 496);

    // Counts and names checked against torch 2.13's nn.Transformer.
    let t = build("transformer", 0, 0);
    let tn = names(t.as_ref());
    assert_eq!(tn.len(), 66);
    assert_eq!(t.num_parameters(), 8423);
    assert_eq!(tn[0], "embed_tokens.weight");
    assert_eq!(
        tn[1],
        "transformer.encoder.layers.0.self_attn.in_proj_weight"
    );
    assert_eq!(tn[65], "output_proj.bias");
    for n in [
        "transformer.encoder.layers.1.linear2.bias",
        "transformer.encoder.norm.weight",
        "transformer.decoder.layers.1.multihead_attn.out_proj.weight",
        "transformer.decoder.layers.0.norm3.bias",
        "transformer.decoder.norm.bias",
    ] {
        assert!(tn.iter().any(|x| x == n), "missing {n}");
    }
    assert!(
        !tn.iter().any(|x| x == "output_proj.weight"),
        "tied weight listed twice"
    );
    let bufs: Vec<_> = t
        .named_buffers()
        .into_iter()
        .map(|(n, b)| (n, b.kind()))
        .collect();
    assert_eq!(
        bufs,
        [
            ("vocab_bias".to_owned(), Kind::Float),
            ("long_buffer".to_owned(), Kind::Int64)
        ]
    );
    let bn = build("transformer_bn", 0, 0);
    assert_eq!(bn.num_parameters(), 8427);
    let bn_bufs: Vec<_> = bn.named_buffers().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        bn_bufs,
        [
            "vocab_bias",
            "long_buffer",
            "bn.running_mean",
            "bn.running_var",
            "bn.num_batches_tracked"
        ]
    );

    let moe = build("moe", 0, 0);
    assert_eq!(moe.num_parameters(), 799);
    let tags = moe.tags();
    let experts: Vec<_> = tags.experts.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(experts, ["module.2.weight", "module.2.bias"]);
    assert_eq!(tags.rank_local, ["module.2.weight", "module.2.bias"]);

    let mlp = build("mlp", 0, 0);
    assert_eq!(mlp.num_parameters(), 719);
    assert_eq!(names(mlp.as_ref())[6], "layers.6.weight");

    let gpt = build("gpt", 0, 0);
    assert_eq!(gpt.num_parameters(), 6848);
    let gn = names(gpt.as_ref());
    assert!(gn.contains(&"layers.1.attention.wq.weight".to_owned()));
    assert!(gn.contains(&"layers.0.feed_forward.w1.weight".to_owned()));
    let gpt_moe = build("gpt_moe", 0, 0);
    assert_eq!(gpt_moe.num_parameters(), 20000);
    let gt = gpt_moe.tags();
    assert_eq!(gt.experts.len(), 2 * 8 * 4);
    assert!(gt.is_expert("layers.1.moe.experts.7.w2.bias"));
    assert!(!gt.is_expert("layers.1.moe.router.weight"));
    assert!(gt.rank_local.is_empty());
}

#[test]
fn initial_losses_match_pytorch() {
    // Values printed by torch 2.13 (CPU) for PyTorch's own modules, seed 0, rank data
    // seeded 1 + rank: the init order and the math are PyTorch's.
    let cases: [(&str, usize, f64); 5] = [
        ("nested", 0, 0.180_690_914_392_471_3),
        ("nested", 1, 0.153_003_990_650_177),
        ("moe", 0, 0.208_889_812_231_063_84),
        ("moe", 1, 0.318_128_526_210_784_9),
        ("transformer", 0, 5.747_796_535_491_943),
    ];
    for (name, rank, expected) in cases {
        let m = build(name, 0, rank);
        let loss = m
            .loss(&m.input(rank, 0).expect("input"))
            .expect("loss")
            .double_value(&[]);
        let err = (loss - expected).abs();
        assert!(
            err <= 1e-5 + 1e-5 * expected.abs(),
            "{name} rank {rank}: {loss} vs PyTorch {expected}"
        );
    }
}

#[test]
fn tied_weight_is_one_tensor_fed_by_both_uses() {
    for (name, canonical, alias) in [
        ("transformer", "embed_tokens.weight", "output_proj.weight"),
        ("gpt", "tok_embeddings.weight", "output.weight"),
    ] {
        let m = build(name, 0, 0);
        let store = m.store();
        let (a, b) = (
            store.get(canonical).expect("canonical"),
            store.get(alias).expect("alias"),
        );
        assert_eq!(a.data_ptr(), b.data_ptr(), "{name}: alias is a copy");
        assert_eq!(m.tags().canonical(alias), canonical);
        let output_layer = m.layers().into_iter().last().expect("layers");
        assert!(output_layer.params.iter().any(|p| p == alias));

        let batch = m.input(0, 0).expect("input");
        m.loss(&batch).expect("loss").backward();
        let grad = a.grad();
        // Rows the batch never looks up get gradient only through the output projection;
        // rows it looks up get both contributions.
        let used = batch
            .inputs
            .iter()
            .map(|t| t.flatten(0, -1))
            .collect::<Vec<_>>();
        let used = Tensor::cat(&used, 0);
        let vocab = a.size()[0];
        let mut unused_rows = 0;
        for row in 0..vocab {
            let g = grad.get(row).abs().sum(Kind::Float).double_value(&[]);
            assert!(
                g > 0.0,
                "{name}: row {row} of the tied weight got no gradient"
            );
            if used.eq(row).any().int64_value(&[]) == 0 {
                unused_rows += 1;
            }
        }
        if name == "transformer" {
            assert!(
                unused_rows > 0,
                "test batch should leave some vocabulary unused"
            );
        }
    }
}

#[test]
fn layers_cover_every_parameter_once() {
    for name in zoo::names() {
        let m = build(name, 0, 0);
        let tags = m.tags();
        let mut seen: Vec<String> = Vec::new();
        for layer in m.layers() {
            for p in &layer.params {
                assert!(
                    m.store().get(p).is_some(),
                    "{name}: layer {} names unknown {p}",
                    layer.name
                );
                if tags.canonical(p) == p.as_str() {
                    assert!(!seen.contains(p), "{name}: {p} in two layers");
                    seen.push(p.clone());
                }
            }
        }
        // Layers follow forward order, parameters registration order (BatchNorm runs
        // first but is registered last): compare as sets.
        let mut all = names(m.as_ref());
        all.sort();
        seen.sort();
        assert_eq!(seen, all, "{name}: layers miss or invent parameters");
    }
}

#[test]
fn safetensors_round_trip_is_bitwise() {
    for name in zoo::names() {
        let original = build(name, 0, 1);
        // Run a step so BatchNorm statistics and counters are non-trivial.
        original
            .loss(&original.input(0, 0).expect("input"))
            .expect("loss")
            .backward();
        let path = temp_file(name);
        original.save(&path).expect("save");
        let mut restored = build(name, 7, 0);
        restored.load(&path).expect("load");
        for ((n, a), (_, b)) in original
            .named_parameters()
            .iter()
            .chain(original.named_buffers().iter())
            .zip(
                restored
                    .named_parameters()
                    .iter()
                    .chain(restored.named_buffers().iter()),
            )
        {
            assert!(bitwise_eq(a, b), "{name}: {n} changed in the round trip");
        }
        let _ = std::fs::remove_file(&path);
    }
}

#[test]
fn load_names_missing_misshaped_and_unexpected_keys() {
    let m = build("nested", 0, 0);
    let mut state: Vec<(String, Tensor)> = m
        .named_parameters()
        .into_iter()
        .filter(|(n, _)| n != "module.0.bias")
        .map(|(n, t)| (n, t.detach()))
        .collect();
    for (n, t) in state.iter_mut() {
        if n == "module.2.weight" {
            *t = Tensor::zeros([3, 3], (Kind::Float, tch::Device::Cpu));
        }
    }
    state.push((
        "module.9.weight".into(),
        Tensor::zeros([1], (Kind::Float, tch::Device::Cpu)),
    ));
    let path = temp_file("broken");
    Tensor::write_safetensors(&state, &path).expect("write");
    let mut target = build("nested", 5, 0);
    let before = target.named_parameters()[0].1.detach_copy();
    let err = target.load(&path).expect_err("broken state fails");
    let msg = err.to_string();
    match &err {
        ModelError::StateMismatch {
            missing,
            misshaped,
            unexpected,
            ..
        } => {
            assert_eq!(missing, &["module.0.bias"]);
            assert_eq!(misshaped.len(), 1);
            assert_eq!(misshaped[0].name, "module.2.weight");
            assert_eq!(unexpected, &["module.9.weight"]);
        }
        other => panic!("unexpected error {other}"),
    }
    assert!(msg.contains("[4, 16]") && msg.contains("[3, 3]"), "{msg}");
    assert!(
        target.named_parameters()[0].1.equal(&before),
        "failed load changed the model"
    );

    // A whole different model is refused too.
    let mut transformer = build("transformer", 0, 0);
    assert!(matches!(
        transformer.load(&path),
        Err(ModelError::StateMismatch { .. })
    ));
    let _ = std::fs::remove_file(&path);
}

#[test]
fn load_accepts_pytorch_style_tied_duplicates_only_when_equal() {
    let m = build("transformer", 0, 0);
    let mut state: Vec<(String, Tensor)> = m
        .named_parameters()
        .into_iter()
        .chain(m.named_buffers())
        .map(|(n, t)| (n, t.detach()))
        .collect();
    let embed = m
        .store()
        .get("embed_tokens.weight")
        .expect("embed")
        .detach();
    state.push(("output_proj.weight".into(), embed.detach_copy()));
    let path = temp_file("tied");
    Tensor::write_safetensors(&state, &path).expect("write");
    let mut fresh = build("transformer", 3, 0);
    fresh.load(&path).expect("consistent duplicate loads");

    let last = state.len() - 1;
    state[last].1 = embed.zeros_like();
    Tensor::write_safetensors(&state, &path).expect("write");
    assert!(matches!(
        fresh.load(&path),
        Err(ModelError::TiedMismatch { .. })
    ));
    let _ = std::fs::remove_file(&path);
}

#[test]
fn load_refuses_a_truncated_file_in_words_and_changes_nothing() {
    let m = build("nested", 0, 0);
    let path = temp_file("truncated");
    m.save(&path).expect("save");
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).expect("truncate");
    let mut other = build("nested", 1, 0);
    let before: Vec<Tensor> = other
        .named_parameters()
        .into_iter()
        .map(|(_, t)| t.detach_copy())
        .collect();
    let err = other.load(&path).expect_err("a truncated file");
    assert!(
        matches!(err, ModelError::UnreadableState { .. }) && err.to_string().contains("truncated"),
        "{err}"
    );
    for ((name, t), b) in other.named_parameters().into_iter().zip(&before) {
        assert!(t.equal(b), "{name} changed");
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn only_per_rank_models_refuse_the_single_device_reference() {
    for name in zoo::names() {
        let m = build(name, 0, 0);
        let refused = m.check_single_device_reference().is_err();
        assert_eq!(refused, matches!(name, "moe" | "transformer_bn"), "{name}");
    }
}

/// One hook call, as a recording hook saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HookCall {
    Pre(usize),
    Post(usize),
}

/// Records every hook call and the kinds of the inputs each layer was given.
#[derive(Default)]
struct Recorder {
    calls: Vec<HookCall>,
    input_kinds: Vec<Vec<Kind>>,
}

impl LayerHooks for Recorder {
    fn pre_forward(
        &mut self,
        index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        self.calls.push(HookCall::Pre(index));
        self.input_kinds
            .push(inputs.iter().map(|t| t.kind()).collect::<Vec<_>>());
        Ok(inputs)
    }

    fn post_forward(&mut self, index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        self.calls.push(HookCall::Post(index));
        Ok(output)
    }
}

#[test]
fn every_zoo_model_calls_its_hooks_once_per_layer_in_order() {
    for name in zoo::names() {
        let m = build(name, 0, 0);
        assert!(m.supports_layer_hooks(), "{name}: no layer hooks");
        let layers = m.layers();
        let batch = m.input(0, 0).expect("input");
        let mut rec = Recorder::default();
        let _ = m.forward_hooked(&batch, &mut rec).expect("hooked forward");
        // Exactly `Pre(i), Post(i)` for every layer in order: once each, pre before post,
        // never nested or interleaved.
        let expected: Vec<HookCall> = (0..layers.len())
            .flat_map(|i| [HookCall::Pre(i), HookCall::Post(i)])
            .collect();
        assert_eq!(rec.calls, expected, "{name}: hook calls");
        for (layer, kinds) in layers.iter().zip(&rec.input_kinds) {
            assert!(!kinds.is_empty(), "{name}: {} got no inputs", layer.name);
            let ids = layer.kind == LayerKind::Embedding;
            for k in kinds {
                assert_eq!(
                    *k == Kind::Int64,
                    ids,
                    "{name}: {} got a {k:?} input",
                    layer.name
                );
            }
        }
        let decoder_inputs: Vec<usize> = layers
            .iter()
            .zip(&rec.input_kinds)
            .filter(|(l, _)| l.kind == LayerKind::DecoderLayer)
            .map(|(_, k)| k.len())
            .collect();
        assert!(
            decoder_inputs.iter().all(|&n| n == 2),
            "{name}: decoder layers take (tgt, memory): {decoder_inputs:?}"
        );

        // The loss runs the same hooks.
        let mut rec = Recorder::default();
        let hooked = m.loss_hooked(&batch, &mut rec).expect("hooked loss");
        assert_eq!(rec.calls, expected, "{name}: loss_hooked hook calls");
        assert!(
            bitwise_eq(&hooked, &m.loss(&batch).expect("loss")),
            "{name}"
        );
    }
}

/// Hooks that replace every input and output by an equal tensor.
struct Replacing;

impl LayerHooks for Replacing {
    fn pre_forward(
        &mut self,
        _index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        Ok(inputs.iter().map(Tensor::copy).collect())
    }

    fn post_forward(&mut self, _index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        Ok(output.f_mul_scalar(1.0)?)
    }
}

/// Hooks whose post-forward hands back a copy of the output.
struct Cloning;

impl LayerHooks for Cloning {
    fn post_forward(&mut self, _index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        Ok(output.copy())
    }
}

#[test]
fn hooked_forward_is_bitwise_the_plain_forward() {
    for name in zoo::names() {
        for rank in 0..2 {
            let m = build(name, 3, rank);
            let batch = m.input(rank, 1).expect("input");
            let plain = m.forward(&batch).expect("forward");
            let none = m.forward_hooked(&batch, &mut NoHooks).expect("NoHooks");
            assert!(bitwise_eq(&plain, &none), "{name}: NoHooks changes forward");
            let replaced = m.forward_hooked(&batch, &mut Replacing).expect("Replacing");
            assert!(
                bitwise_eq(&plain, &replaced),
                "{name}: replacing inputs and outputs by equal tensors changes forward"
            );
            let cloned = m.forward_hooked(&batch, &mut Cloning).expect("Cloning");
            assert!(
                bitwise_eq(&plain, &cloned),
                "{name}: cloned outputs change forward"
            );
        }
    }
}

/// A hook that behaves as FSDP freeing parameters: outside layer `i`'s window every
/// parameter not in layer `i` is NaN, so a read outside its layer's window poisons the
/// output. `Drop` is not relied on: [`ParamWindow::restore_all`] puts values back.
struct ParamWindow {
    /// Canonical parameter names of every layer, in `layers()` order.
    layers: Vec<Vec<String>>,
    /// (canonical name, saved value, the model's own tensor).
    params: Vec<(String, Tensor, Tensor)>,
}

impl ParamWindow {
    fn new(m: &dyn Model) -> Self {
        let tags = m.tags();
        let layers = m
            .layers()
            .iter()
            .map(|l| {
                l.params
                    .iter()
                    .map(|p| tags.canonical(p).to_owned())
                    .collect()
            })
            .collect();
        let params = m
            .named_parameters()
            .into_iter()
            .map(|(n, t)| (n, t.detach_copy(), t))
            .collect();
        ParamWindow { layers, params }
    }

    fn set(&self, index: Option<usize>, restore: bool) -> Result<(), ModelError> {
        tch::no_grad(|| {
            for (name, saved, live) in &self.params {
                let in_layer = match index {
                    Some(i) => self.layers[i].contains(name),
                    None => true,
                };
                if in_layer {
                    let mut live = live.shallow_clone();
                    if restore {
                        live.f_copy_(saved)?;
                    } else {
                        let _ = live.f_fill_(f64::NAN)?;
                    }
                }
            }
            Ok(())
        })
    }

    fn poison_all(&self) {
        self.set(None, false).expect("poison");
    }

    fn restore_all(&self) {
        self.set(None, true).expect("restore");
    }
}

impl LayerHooks for ParamWindow {
    fn pre_forward(
        &mut self,
        index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        self.set(Some(index), true)?;
        Ok(inputs)
    }

    fn post_forward(&mut self, index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        self.set(Some(index), false)?;
        Ok(output)
    }
}

#[test]
fn parameters_are_read_only_inside_their_layers_window() {
    for name in zoo::names() {
        let m = build(name, 0, 1);
        let batch = m.input(1, 0).expect("input");
        let plain = m.forward(&batch).expect("forward");
        let before: Vec<Tensor> = m
            .named_parameters()
            .iter()
            .map(|(_, t)| t.detach_copy())
            .collect();
        let mut window = ParamWindow::new(m.as_ref());
        window.poison_all();
        let windowed = m.forward_hooked(&batch, &mut window);
        window.restore_all();
        for ((n, t), b) in m.named_parameters().iter().zip(&before) {
            assert!(bitwise_eq(t, b), "{name}: {n} not restored");
        }
        let windowed = windowed.expect("windowed forward");
        assert!(
            windowed.isfinite().all().int64_value(&[]) == 1,
            "{name}: a parameter is read outside its layer's window"
        );
        assert!(
            bitwise_eq(&plain, &windowed),
            "{name}: output differs under the parameter window"
        );
        // The poison itself is seen: with every parameter NaN, the output is NaN.
        window.poison_all();
        let poisoned = m.forward_hooked(&batch, &mut NoHooks);
        window.restore_all();
        let poisoned = poisoned.expect("poisoned forward");
        assert!(
            poisoned.isnan().any().int64_value(&[]) == 1,
            "{name}: NaN parameters do not reach the output"
        );
    }
}

/// Hands back one input fewer than it was given.
struct DroppingInput;

impl LayerHooks for DroppingInput {
    fn pre_forward(
        &mut self,
        _index: usize,
        mut inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        let _ = inputs.pop();
        Ok(inputs)
    }
}

#[test]
fn a_hook_returning_the_wrong_inputs_is_an_error_not_a_panic() {
    for name in zoo::names() {
        let m = build(name, 0, 0);
        let batch = m.input(0, 0).expect("input");
        let err = m
            .forward_hooked(&batch, &mut DroppingInput)
            .expect_err("missing input fails");
        assert!(matches!(err, ModelError::Hook(_)), "{name}: {err}");
        assert!(err.to_string().contains("layer 0"), "{name}: {err}");
    }
}
