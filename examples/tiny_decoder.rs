//! A decoder a user writes — not one of Lockstep's zoo models — parallelized by its own plan:
//! tensor parallelism (`tp.2`), with sequence parallelism (`tp.2.sp`), FSDP×TP
//! (`fsdp_x_tp2`), a tensor-parallel pipeline (`pp2_x_tp2`), context parallelism (`cp.2`,
//! `cp.4`, ring and all-gather, load-balanced and contiguous) and, for its mixture-of-experts
//! variant, expert parallelism (`ep.2`), each checked against one process training on the
//! same global batch.
//!
//! The model is written only against the public API. Its forward calls its parametrized
//! modules through the hooks it is given (`m.linear(path, x, w, b)`, `m.embedding(...)`,
//! `m.layer_norm(...)`, `m.moe(...)`, `m.cross_entropy(...)`) and its causal attention through
//! `m.attention(path, q, k, v)`: plainly they run the plain ops; under a plan they run split. Attention reshapes by head size (`-1` heads), so a
//! column-split q/k/v simply carries fewer heads. `parallel_plan` maps module paths to styles.
//!
//! ```sh
//! cargo run --example tiny_decoder      # runs the parity tests and prints the verdicts
//! ```

use lockstep::core::tensor_parallel::{train_tensor_parallel_with_plan, TpOptions};
use lockstep::models::{
    decisions, seed, Batch, LayerHooks, LayerKind, LayerRun, LayerSpec, Model, ModelError, MoeSpec,
    NoHooks, ParallelPlan, ParallelStyle, ParamStore,
};
use lockstep::parity_test::{ParityOutcome, ParityTest, ParityTestError};
use tch::{Device, Kind, Tensor};

const VOCAB: i64 = 16;
const DIM: i64 = 16;
const HEADS: i64 = 4;
const HIDDEN: i64 = 32;
const SEQ: i64 = 8;
const BATCH: i64 = 2;
const BLOCKS: usize = 2;
const EXPERTS: usize = 4;
const TOP_K: i64 = 2;

/// A pre-norm decoder: embedding → blocks (causal attention, then an MLP or a top-2 mixture
/// of 4 experts) → norm → an untied output head, with the mean next-token cross-entropy.
pub struct TinyDecoder {
    store: ParamStore,
    seed: u64,
    rank: usize,
    moe: bool,
}

impl TinyDecoder {
    /// Parameters from the run seed only, so every rank and the reference hold the same ones.
    pub fn new(run_seed: u64, rank: usize, moe: bool) -> Result<Self, ModelError> {
        let mut store = ParamStore::default();
        let f = (Kind::Float, Device::Cpu);
        let mut shapes: Vec<(String, Vec<i64>, bool)> =
            vec![("embed.weight".into(), vec![VOCAB, DIM], true)];
        let linear = |v: &mut Vec<(String, Vec<i64>, bool)>, p: &str, out: i64, inp: i64| {
            v.push((format!("{p}.weight"), vec![out, inp], true));
            v.push((format!("{p}.bias"), vec![out], false));
        };
        for b in 0..BLOCKS {
            let p = format!("blocks.{b}");
            shapes.push((format!("{p}.norm1.weight"), vec![DIM], false));
            shapes.push((format!("{p}.norm1.bias"), vec![DIM], false));
            for proj in ["q", "k", "v", "o"] {
                linear(&mut shapes, &format!("{p}.attn.{proj}"), DIM, DIM);
            }
            shapes.push((format!("{p}.norm2.weight"), vec![DIM], false));
            shapes.push((format!("{p}.norm2.bias"), vec![DIM], false));
            if moe {
                shapes.push((
                    format!("{p}.moe.router.weight"),
                    vec![EXPERTS as i64, DIM],
                    true,
                ));
                for e in 0..EXPERTS {
                    linear(&mut shapes, &format!("{p}.moe.experts.{e}.w1"), HIDDEN, DIM);
                    linear(&mut shapes, &format!("{p}.moe.experts.{e}.w2"), DIM, HIDDEN);
                }
            } else {
                linear(&mut shapes, &format!("{p}.mlp.up"), HIDDEN, DIM);
                linear(&mut shapes, &format!("{p}.mlp.down"), DIM, HIDDEN);
            }
        }
        shapes.push(("norm.weight".into(), vec![DIM], false));
        shapes.push(("norm.bias".into(), vec![DIM], false));
        shapes.push(("head.weight".into(), vec![VOCAB, DIM], true));
        let values = seed::seeded(seed::param_seed(run_seed), || {
            shapes
                .iter()
                .map(|(name, shape, random)| {
                    if *random {
                        Tensor::randn(shape.as_slice(), f) * 0.3
                    } else if name.contains("norm") && name.ends_with("weight") {
                        Tensor::ones(shape.as_slice(), f)
                    } else {
                        Tensor::zeros(shape.as_slice(), f)
                    }
                })
                .collect::<Vec<_>>()
        });
        for ((name, _, _), value) in shapes.iter().zip(values) {
            let _ = store.register_parameter(name, value);
            // Expert parameters are tagged, so expert parallelism can place them.
            if let Some(rest) = name.split(".experts.").nth(1) {
                let e = rest.split('.').next().and_then(|e| e.parse().ok());
                if let Some(e) = e {
                    store.tag_expert(name, e);
                }
            }
        }
        Ok(TinyDecoder {
            store,
            seed: run_seed,
            rank,
            moe,
        })
    }

    fn p(&self, name: &str) -> Result<Tensor, ModelError> {
        self.store
            .get(name)
            .ok_or_else(|| ModelError::InvalidConfig {
                model: self.name().to_owned(),
                reason: format!("no parameter {name}"),
            })
    }

    /// The linear at `path` through the hooks.
    fn linear(&self, m: &mut dyn LayerHooks, path: &str, x: &Tensor) -> Result<Tensor, ModelError> {
        let (w, b) = (
            self.p(&format!("{path}.weight"))?,
            self.p(&format!("{path}.bias")).ok(),
        );
        m.linear(path, x, &w, b.as_ref())
    }

    fn norm(&self, m: &mut dyn LayerHooks, path: &str, x: &Tensor) -> Result<Tensor, ModelError> {
        let (w, b) = (
            self.p(&format!("{path}.weight"))?,
            self.p(&format!("{path}.bias"))?,
        );
        m.layer_norm(path, x, &w, &b, 1e-5)
    }

    /// Causal attention; heads by head size, so split projections carry fewer of them.
    fn attention(&self, m: &mut dyn LayerHooks, p: &str, x: &Tensor) -> Result<Tensor, ModelError> {
        let hd = DIM / HEADS;
        let q = self.linear(m, &format!("{p}.q"), x)?;
        let (b, t) = (q.size()[0], q.size()[1]);
        let heads = |y: Tensor| y.f_view([b, t, -1, hd])?.f_transpose(1, 2);
        let q = heads(q)?;
        let k = heads(self.linear(m, &format!("{p}.k"), x)?)?;
        let v = heads(self.linear(m, &format!("{p}.v"), x)?)?;
        // Through the hooks: plainly softmax causal attention, under context parallelism
        // the ring (or an all-gather) bringing the other shards' keys and values.
        let out = m
            .attention(p, &q, &k, &v)?
            .f_transpose(1, 2)?
            .f_contiguous()?
            .f_view([b, t, -1])?;
        self.linear(m, &format!("{p}.o"), &out)
    }

    /// The mixture computed densely (every expert on every token, weighted by its gate):
    /// the single-device form expert parallelism distributes.
    fn dense_moe(&self, p: &str, x: &Tensor) -> Result<Tensor, ModelError> {
        let probs = x
            .f_linear::<Tensor>(&self.p(&format!("{p}.router.weight"))?, None)?
            .f_softmax(-1, None)?;
        let (top, idx) = decisions::topk(&probs, TOP_K)?;
        let top = top.f_div(&top.f_sum_dim_intlist(-1, true, None)?)?;
        let gates = probs.f_zeros_like()?.f_scatter(-1, &idx, &top)?;
        let mut out = x.f_zeros_like()?;
        for e in 0..EXPERTS {
            let ex = format!("{p}.experts.{e}");
            let w = |s: &str| self.p(&format!("{ex}.{s}"));
            let h = x
                .f_linear(&w("w1.weight")?, Some(&w("w1.bias")?))?
                .f_gelu("none")?;
            let y = h.f_linear(&w("w2.weight")?, Some(&w("w2.bias")?))?;
            out = out.f_add(&y.f_mul(&gates.f_narrow(-1, e as i64, 1)?)?)?;
        }
        Ok(out)
    }

    fn block(&self, m: &mut dyn LayerHooks, i: usize, h: &Tensor) -> Result<Tensor, ModelError> {
        let p = format!("blocks.{i}");
        let a = self.norm(m, &format!("{p}.norm1"), h)?;
        let h = h.f_add(&self.attention(m, &format!("{p}.attn"), &a)?)?;
        let f = self.norm(m, &format!("{p}.norm2"), &h)?;
        let ff = if self.moe {
            let spec = MoeSpec {
                experts: EXPERTS,
                top_k: TOP_K,
            };
            let path = format!("{p}.moe");
            m.moe(&path, &f, spec, &|x: &Tensor| self.dense_moe(&path, x))?
        } else {
            let up = self.linear(m, &format!("{p}.mlp.up"), &f)?.f_gelu("none")?;
            self.linear(m, &format!("{p}.mlp.down"), &up)?
        };
        Ok(h.f_add(&ff)?)
    }
}

impl Model for TinyDecoder {
    fn name(&self) -> &str {
        if self.moe {
            "tiny_decoder_moe"
        } else {
            "tiny_decoder"
        }
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn seed(&self) -> u64 {
        self.seed
    }
    fn store(&self) -> &ParamStore {
        &self.store
    }

    /// The layers FSDP may wrap and a pipeline may cut between.
    fn layers(&self) -> Vec<LayerSpec> {
        let names = self.store.named_parameters();
        let under = |prefix: &str| -> Vec<String> {
            names
                .iter()
                .filter(|(n, _)| n.starts_with(&format!("{prefix}.")))
                .map(|(n, _)| n.clone())
                .collect()
        };
        let spec = |name: &str, kind| LayerSpec {
            name: name.into(),
            kind,
            params: under(name),
        };
        let block = if self.moe {
            LayerKind::MoeDecoderBlock
        } else {
            LayerKind::DecoderBlock
        };
        let mut v = vec![spec("embed", LayerKind::Embedding)];
        v.extend((0..BLOCKS).map(|i| spec(&format!("blocks.{i}"), block)));
        v.push(spec("norm", LayerKind::LayerNorm));
        v.push(spec("head", LayerKind::OutputProjection));
        v
    }

    /// Sequences counting up by a stride from a random start: the next token is learnable.
    fn input(&self, rank: usize, step: usize) -> Result<Batch, ModelError> {
        let opts = (Kind::Int64, Device::Cpu);
        let (start, stride) = seed::seeded(seed::batch_seed(self.seed, rank, step), || {
            (
                Tensor::randint(VOCAB, [BATCH, 1], opts),
                Tensor::randint(3, [BATCH, 1], opts) + 1,
            )
        });
        let tokens = (Tensor::arange(SEQ + 1, opts).unsqueeze(0) * stride + start).remainder(VOCAB);
        Ok(Batch {
            inputs: vec![tokens.narrow(1, 0, SEQ)],
            target: Some(tokens.narrow(1, 1, SEQ)),
        })
    }

    fn forward(&self, batch: &Batch) -> Result<Tensor, ModelError> {
        self.forward_hooked(batch, &mut NoHooks)
    }

    fn supports_layer_hooks(&self) -> bool {
        true
    }

    /// Its attention and loss go through the hooks, and it has no positional embedding:
    /// context parallelism can split its sequences.
    fn context_parallel_blocker(&self) -> Option<String> {
        None
    }

    fn forward_hooked(
        &self,
        batch: &Batch,
        hooks: &mut dyn LayerHooks,
    ) -> Result<Tensor, ModelError> {
        let tokens = batch
            .inputs
            .first()
            .ok_or_else(|| ModelError::InvalidBatch {
                model: self.name().to_owned(),
                reason: "expected token ids".into(),
            })?;
        let embed = self.p("embed.weight")?;
        let mut run = LayerRun::new(hooks);
        let mut h = run.layer_hooked([tokens.shallow_clone()], |m, [ids]| {
            m.embedding("embed", &ids, &embed)
        })?;
        for i in 0..BLOCKS {
            h = run.layer_hooked([h], |m, [h]| self.block(m, i, &h))?;
        }
        let h = run.layer_hooked([h], |m, [h]| self.norm(m, "norm", &h))?;
        run.layer_hooked([h], |m, [h]| self.linear(m, "head", &h))
    }

    fn loss_of(&self, batch: &Batch, output: &Tensor) -> Result<Tensor, ModelError> {
        self.loss_of_hooked(batch, output, &mut NoHooks)
    }

    /// The loss through the `head` module's cross-entropy hook: loss parallel when the plan
    /// splits the head by vocabulary (then `output` is this rank's slice of the logits).
    fn loss_of_hooked(
        &self,
        batch: &Batch,
        output: &Tensor,
        hooks: &mut dyn LayerHooks,
    ) -> Result<Tensor, ModelError> {
        let target = batch
            .target
            .as_ref()
            .ok_or_else(|| ModelError::InvalidBatch {
                model: self.name().to_owned(),
                reason: "no target".into(),
            })?;
        let columns = output.size().last().copied().unwrap_or(VOCAB);
        hooks.cross_entropy(
            "head",
            &output.f_reshape([-1, columns])?,
            &target.f_reshape([-1])?,
        )
    }

    /// The plan: vocabulary-parallel embedding and head (loss parallel), attention split by
    /// heads, the MLP column- then row-wise, the mixture's experts spread by expert
    /// parallelism; under sequence parallelism the norms (and the token-wise mixture) run
    /// on sequence shards.
    fn parallel_plan(&self, sequence_parallel: bool) -> Option<ParallelPlan> {
        use ParallelStyle::*;
        let mut plan = ParallelPlan::new(sequence_parallel)
            .with_heads(HEADS)
            .rule("embed", Vocab)
            .rule("head", Vocab)
            .rule("blocks.*.attn.q", Colwise)
            .rule("blocks.*.attn.k", Colwise)
            .rule("blocks.*.attn.v", Colwise)
            .rule("blocks.*.attn.o", Rowwise);
        plan = if self.moe {
            plan.rule(
                "blocks.*.moe",
                if sequence_parallel { Sequence } else { Expert },
            )
        } else {
            plan.rule("blocks.*.mlp.up", Colwise)
                .rule("blocks.*.mlp.down", Rowwise)
        };
        if sequence_parallel {
            plan = plan
                .rule("blocks.*.norm1", Sequence)
                .rule("blocks.*.norm2", Sequence)
                .rule("norm", Sequence);
        }
        Some(plan)
    }
}

/// A plan a user passes instead of the model's own: only the attention split (whole heads per
/// rank), the MLP, embedding and head replicated (so the model's own loss applies).
pub fn attention_only_plan() -> ParallelPlan {
    ParallelPlan::new(false)
        .with_heads(HEADS)
        .rule("blocks.*.attn.q", ParallelStyle::Colwise)
        .rule("blocks.*.attn.k", ParallelStyle::Colwise)
        .rule("blocks.*.attn.v", ParallelStyle::Colwise)
        .rule("blocks.*.attn.o", ParallelStyle::Rowwise)
}

/// The dense decoder under `tp.2`, `tp.2.sp`, `fsdp_x_tp2` and `pp2_x_tp2` from its own plan,
/// and under TP 2 with [`attention_only_plan`] passed by the user, at world 4, each against
/// one process (the fp64 arbiter).
pub fn check_tensor_parallel(test: &str) -> Result<ParityOutcome, ParityTestError> {
    ParityTest::new(test)
        .model("tiny_decoder", |seed, rank| {
            TinyDecoder::new(seed, rank, false)
        })
        .config("tp.2")
        .config("tp.2.sp")
        .config("fsdp_x_tp2")
        .config("pp2_x_tp2")
        .custom_config("tp.2.attention_only", |ctx, model, cfg| {
            let opts = TpOptions {
                tp: 2,
                sequence_parallel: false,
                data_parallel: Default::default(),
                fault: None,
            };
            let plan = attention_only_plan();
            train_tensor_parallel_with_plan(model, ctx.world(), cfg, &opts, &plan)
                .map_err(|e| e.to_string())
        })
        .world_sizes(&[4])
        .steps(3)
        .run()
}

/// The mixture-of-experts variant under `ep.2` (and `tp.2`) at world 2, against one process.
pub fn check_expert_parallel(test: &str) -> Result<ParityOutcome, ParityTestError> {
    ParityTest::new(test)
        .model("tiny_decoder_moe", |seed, rank| {
            TinyDecoder::new(seed, rank, true)
        })
        .config("ep.2")
        .config("tp.2")
        .world_sizes(&[2])
        .steps(3)
        .run()
}

/// The decoder (`moe`: its mixture-of-experts variant) under context parallelism at world
/// 4: ring attention and the all-gather dispatcher, load-balanced and contiguous, over 2 ranks
/// (two replicas) and 4, against one process.
pub fn check_context_parallel(test: &str, moe: bool) -> Result<ParityOutcome, ParityTestError> {
    let name = if moe {
        "tiny_decoder_moe"
    } else {
        "tiny_decoder"
    };
    ParityTest::new(test)
        .model(name, move |seed, rank| TinyDecoder::new(seed, rank, moe))
        .config("cp.2")
        .config("cp.2.allgather")
        .config("cp.2.contiguous")
        .config("cp.4")
        .world_sizes(&[4])
        .steps(3)
        .run()
}

#[allow(dead_code)]
fn main() -> Result<(), ParityTestError> {
    for outcome in [
        check_tensor_parallel("tiny_decoder_tp")?,
        check_expert_parallel("tiny_decoder_ep")?,
        check_context_parallel("tiny_decoder_cp", false)?,
        check_context_parallel("tiny_decoder_moe_cp", true)?,
    ] {
        print!("{}", outcome.summary());
        outcome.assert_passed();
    }
    Ok(())
}
