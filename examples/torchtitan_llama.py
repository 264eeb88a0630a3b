"""torchtitan's own Llama 3 and its own `parallelize_llama`, judged by Lockstep (docs/judge.md):
code nobody here wrote, on a tiny config built in place (nothing downloaded).

    # torchtitan 0.3.0 and its few pure-Python needs: ci/setup-python-extras
    PYTHONPATH=$EXTRAS:$TORCH python3 -m torch.distributed.run --nproc-per-node 2 \\
        examples/torchtitan_llama.py train OUT --parallel fsdp     # or tp
    PYTHONPATH=$EXTRAS:$TORCH python3 examples/torchtitan_llama.py reference OUT
    lockstep judge --run OUT/run --reference OUT/reference --shadow OUT/shadow --out OUT/report

`--parallel fsdp` shards every block over the 2 ranks (torchtitan's `apply_fsdp`: data
parallel, each rank its own rows); `--parallel tp` splits attention and MLP over them
(torchtitan's `apply_tp`, sequence parallel on; FSDP at degree 1 around it, as torchtitan
always wraps), every rank on the same rows.

torchtitan's FSDP sums the ranks' gradients (`gradient_divide_factor=1`): each rank divides
its summed token losses by the tokens of the whole step, so the sum over ranks is the global
mean. The recorder is told (`loss_reduction="sum"`). `--bug local-token-mean` divides by
the rank's own tokens instead, the normalisation mistake this convention invites: every
gradient is `world` times too large.

Three things torchtitan 0.3.0 needs on a CPU, done here before it is used, none changing its
model or parallelization: its device is forced to "cpu" (it falls back to "cuda" when no
accelerator is found); `torchtitan.trainer`, imported only for an isinstance check, is
stubbed (the real one needs torchdata); FSDP reduces by SUM (gloo has no PREMUL_SUM). The
SPMD backend is `partial_dtensor` (its default, `spmd_types`, needs a `fully_shard` that
torch 2.13 does not have), and attention is torchtitan's SDPA (its flex attention needs
`torch.compile`).
"""

import argparse
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import lockstep_probe  # noqa: E402

STEPS = 3
SEED = 5
DIM, LAYERS, HEADS, VOCAB, SEQ, ROWS = 64, 2, 4, 128, 16, 2


def prepare_torchtitan():
    """The three CPU workarounds (module docstring), before torchtitan's modules load."""
    stub = types.ModuleType("torchtitan.trainer")
    stub.Trainer = type("Trainer", (), {"Config": type("Config", (), {})})
    sys.modules.setdefault("torchtitan.trainer", stub)
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type, titan_utils.device_module = "cpu", torch.cpu


def model_config():
    """torchtitan's Llama 3 config, tiny."""
    prepare_torchtitan()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, Llama3Model,
                                          _build_llama3_layers, _output_linear_init)

    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, hidden_dim=4 * DIM, fuse_qkv=True,
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000,
                                    scaling="none"),
            attn_backend="flex"))
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def build_model():
    """The model on one device, as torchtitan initializes it."""
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = model_config().build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def batch(row, step):
    """`ROWS` rows of tokens from `row` on: inputs and next-token labels."""
    g = torch.Generator().manual_seed(SEED * 10_000 + step * 100 + row)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(model, inputs, labels):
    """One rank's mean token loss (the references' objective)."""
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1),
                           reduction="sum") / labels.numel()


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def train(out, parallel, bug):
    prepare_torchtitan()
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as titan_dist
    from torchtitan.models.llama3 import parallelize_llama

    torch.autograd.set_multithreading_enabled(False)  # as torchtitan's init_distributed does
    with lockstep_probe.deterministic("cpu"):
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        titan_dist.set_spmd_backend("partial_dtensor")
        parallelism = ParallelismConfig(
            data_parallel_shard_degree=-1,
            tensor_parallel_degree=world if parallel == "tp" else 1,
            spmd_backend="partial_dtensor")
        config = model_config()
        config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
        dims = ParallelDims.from_config(parallelism, world)
        dims.build_mesh()
        torch.manual_seed(SEED)
        with torch.device("meta"):
            model = config.build()
        model = parallelize_llama(
            model, parallel_dims=dims, parallelism=parallelism, compile_config=CompileConfig(),
            ac_config=None, dump_folder=str(Path(out) / "titan"),
            training=TrainingConfig(mixed_precision_param="float32", local_batch_size=ROWS,
                                    seq_len=SEQ))
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        opt = optimizer(model.parameters())
        data_parallel = parallel == "fsdp"
        rec = lockstep_probe.Recorder(  # lockstep
            Path(out) / "run", model, name="titan-llama3", config=f"torchtitan.{parallel}{world}",
            seed=SEED, steps=STEPS, replicated_data=not data_parallel,
            loss_reduction="sum" if data_parallel else "mean")
        context = titan_dist.get_spmd_context(parallel_dims=dims)
        for step in range(STEPS):
            inputs, labels = batch(rank * ROWS if data_parallel else 0, step)
            opt.zero_grad()
            with context():
                total = cross_entropy_loss(model(inputs), labels, global_vocab_size=VOCAB)
                # torchtitan's normalisation: the step's tokens over every data rank.
                tokens = labels.numel() * (world if data_parallel else 1)
                if bug == "local-token-mean":
                    tokens = labels.numel()  # the bug: this rank's tokens only
                loss = total / tokens
                loss.backward()
            rec.step(loss, inputs, labels)  # lockstep
            opt.step()
        rec.finish()  # lockstep
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "reference"])
    parser.add_argument("out")
    parser.add_argument("--parallel", choices=["fsdp", "tp"], default="fsdp")
    parser.add_argument("--bug", choices=["local-token-mean"])
    args = parser.parse_args()
    if args.mode == "train":
        train(args.out, args.parallel, args.bug)
    else:
        lockstep_probe.train_references(build_model, loss_fn, optimizer, Path(args.out) / "run",
                                        args.out)


if __name__ == "__main__":
    main()
