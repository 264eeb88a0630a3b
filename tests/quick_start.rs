//! The README's quick start, verbatim between the markers: a parity test for a model of your
//! own. `readme_shows_this_file` keeps the README's copy identical to the code that runs.

// quick-start begin
use lockstep::models::{seed, Batch, LayerSpec, Model, ModelError, ParamStore};
use lockstep::parity_test::ParityTest;
use tch::{Device, Kind, Tensor};

/// Your model: `fc2(tanh(fc1(x)))` with a mean squared error.
struct TwoLayer {
    store: ParamStore,
    seed: u64,
    rank: usize,
}

impl TwoLayer {
    fn new(seed: u64, rank: usize) -> Result<Self, ModelError> {
        let f = (Kind::Float, Device::Cpu);
        // Parameters from the seed only: every rank and the reference draw the same ones.
        let (w1, w2) = seed::seeded(seed::param_seed(seed), || {
            (Tensor::randn([16, 4], f), Tensor::randn([1, 16], f))
        });
        let mut store = ParamStore::default();
        let _ = store.register_parameter("fc1.weight", w1); // PyTorch's names
        let _ = store.register_parameter("fc2.weight", w2);
        Ok(TwoLayer { store, seed, rank })
    }

    fn weight(&self, name: &str) -> Result<Tensor, ModelError> {
        let missing = || ModelError::InvalidConfig {
            model: "two_layer".into(),
            reason: format!("no {name}"),
        };
        self.store.get(name).ok_or_else(missing)
    }
}

impl Model for TwoLayer {
    fn name(&self) -> &str {
        "two_layer"
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
    fn layers(&self) -> Vec<LayerSpec> {
        Vec::new() // list them (and run them between hooks) for per-layer FSDP or pipelines
    }
    /// Rank `rank`'s batch at `step`: the same in every process that asks.
    fn input(&self, rank: usize, step: usize) -> Result<Batch, ModelError> {
        let f = (Kind::Float, Device::Cpu);
        let (x, y) = seed::seeded(seed::batch_seed(self.seed, rank, step), || {
            (Tensor::randn([8, 4], f), Tensor::randn([8, 1], f))
        });
        Ok(Batch {
            inputs: vec![x],
            target: Some(y),
        })
    }
    fn forward(&self, batch: &Batch) -> Result<Tensor, ModelError> {
        let h = batch.inputs[0].f_linear::<Tensor>(&self.weight("fc1.weight")?, None)?;
        Ok(h.f_tanh()?
            .f_linear::<Tensor>(&self.weight("fc2.weight")?, None)?)
    }
    fn loss_of(&self, batch: &Batch, output: &Tensor) -> Result<Tensor, ModelError> {
        let target = batch.target.as_ref().ok_or(ModelError::InvalidBatch {
            model: "two_layer".into(),
            reason: "no target".into(),
        })?;
        Ok(output.f_mse_loss(target, tch::Reduction::Mean)?)
    }
}

#[test]
fn two_layer_under_ddp_and_fsdp() {
    ParityTest::new("two_layer_under_ddp_and_fsdp") // reports: target/lockstep/<this name>/
        .model("two_layer", TwoLayer::new)
        .config("ddp")
        .config("fsdp.full_shard")
        .world_sizes(&[2, 4])
        .steps(3)
        .assert_parity(); // against one process on the same global batch
}
// quick-start end

#[test]
fn readme_shows_this_file() {
    let this = include_str!("quick_start.rs");
    let code = |text: &str| -> Option<String> {
        let start = text.find("// quick-start begin\n")? + "// quick-start begin\n".len();
        let end = text.find("// quick-start end")?;
        Some(text[start..end].to_owned())
    };
    let readme = include_str!("../README.md");
    let expected = code(this).expect("markers in this file");
    assert!(
        readme.contains(&expected),
        "README.md's quick start differs from tests/quick_start.rs; paste this into its \
         ```rust block:\n{expected}"
    );
}

/// Per-layer FSDP needs a model that runs its layers between hooks; one without them
/// (`TwoLayer` above) is refused with the reason, not run with every unit gathered before
/// forward under a per-layer name.
#[test]
fn per_layer_fsdp_without_layer_hooks_is_refused() {
    let err = ParityTest::new("per_layer_fsdp_without_layer_hooks_is_refused")
        .model("two_layer", TwoLayer::new)
        .config("fsdp.full_shard.per_layer")
        .run()
        .expect_err("refused before anything runs");
    let text = err.to_string();
    assert!(
        text.contains("fsdp.full_shard.per_layer") && text.contains("supports_layer_hooks"),
        "{text}"
    );
}
