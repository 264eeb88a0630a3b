"""Hugging Face transformers' Llama, parallelized by transformers' and PyTorch's own code,
judged by Lockstep (docs/judge.md). Nothing here defines the model or its parallel layout:
`LlamaForCausalLM` from a small random config (no weights downloaded), split by its own
`tp_plan` (`transformers.integrations.tensor_parallel.distribute_model`) or sharded by FSDP2.

    python3 -m torch.distributed.run --nproc-per-node 2 examples/hf_llama.py train OUT --parallel tp
    python3 examples/hf_llama.py reference OUT
    lockstep judge --run OUT/run --reference OUT/reference --shadow OUT/shadow --out OUT/report

`--parallel tp`: the model's `base_model_tp_plan` (q, k, v, gate and up projections
column-parallel, o and down row-parallel) over every rank; every rank trains on the same
batch (said to the recorder: `replicated_data=True`). `--parallel fsdp`: FSDP2's
`fully_shard` on every decoder layer and the model, each rank on its own batch.

`--bug loss-over-world` (under fsdp) divides the loss by the world size on top of the
gradient averaging FSDP already does: the gradients are a factor too small, while the loss
curve still falls.

Needs `transformers` (`pip install transformers`; CI installs it with `ci/setup-python-extras`).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import lockstep_probe  # noqa: E402

STEPS = 3
SEED = 11
VOCAB = 64
SEQUENCE = 8
BATCH = 2


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2 * SEQUENCE, attn_implementation="eager")
    return LlamaForCausalLM(config)


def batch(rank, step):
    """Rank `rank`'s token ids at `step` (the labels are the ids: the model shifts them)."""
    g = torch.Generator().manual_seed(SEED * 10_000 + step * 100 + rank)
    return (torch.randint(VOCAB, (BATCH, SEQUENCE), generator=g),)


def loss_fn(model, ids):
    return model(input_ids=ids, labels=ids).loss


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)


def train(out, parallel, bug):
    from torch.distributed.device_mesh import init_device_mesh

    with lockstep_probe.deterministic("cpu"):
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        if parallel == "tp":
            # transformers applies its tp_plan while it loads weights: the random model is
            # saved (no download) and loaded back with tp_plan="auto" on this mesh.
            from transformers import LlamaForCausalLM

            saved = Path(out) / "hf-model"
            if rank == 0:
                build_model().save_pretrained(saved)
            dist.barrier()
            model = LlamaForCausalLM.from_pretrained(saved, tp_plan="auto",
                                                     torch_dtype=torch.float32)
        else:
            model = build_model()
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = optimizer(model.parameters())
        rec = lockstep_probe.Recorder(Path(out) / "run", model, name="llama",  # lockstep
                                      config=f"hf.{parallel}{world}", seed=SEED, steps=STEPS,
                                      replicated_data=parallel == "tp")
        for step in range(STEPS):
            (ids,) = batch(0 if parallel == "tp" else rank, step)
            opt.zero_grad()
            loss = loss_fn(model, ids)
            if bug == "loss-over-world":
                (loss / world).backward()  # the bug: FSDP averages the gradients already
            else:
                loss.backward()
            rec.step(loss, ids)  # lockstep
            opt.step()
        rec.finish()  # lockstep
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "reference"])
    parser.add_argument("out")
    parser.add_argument("--parallel", choices=["tp", "fsdp"], default="tp")
    parser.add_argument("--bug", choices=["loss-over-world"])
    args = parser.parse_args()
    if args.mode == "train":
        train(args.out, args.parallel, args.bug)
    else:
        lockstep_probe.train_references(build_model, loss_fn, optimizer, Path(args.out) / "run",
                                        args.out)


if __name__ == "__main__":
    main()
