"""A PyTorch DTensor tensor-parallel job judged by Lockstep (docs/judge.md).

    python3 -m torch.distributed.run --nproc-per-node 2 examples/torch_tp.py train OUT
    python3 examples/torch_tp.py reference OUT
    lockstep judge --run OUT/run --reference OUT/reference --shadow OUT/shadow --out OUT/report

The classifier's first linear is column-parallel, its second row-parallel
(`parallelize_module`), so the row-parallel bias is replicated on every rank; its output
layer is column-parallel too and leaves its logits sharded over the classes, and the
cross-entropy is computed on the shards (`loss_parallel`), as a vocabulary-parallel LM head
is. `--bug replica-skips-reduce` plants the
kind of bug Megatron-LM#7452 and torchtitan#771 describe: on one rank a replicated
parameter's gradient misses its reduction (here halved, as a partial sum left unreduced
would be), so that rank's copy of the bias drifts from the others' while rank 0's numbers
look right. The recorder compares every replicated copy bit for bit after every step, and
the verdict names the tensor, the step and the ranks on each side.

`--bug bias-grad-unreduced` plants Megatron's classic: every rank keeps only its own rows'
part of the replicated bias's gradient (the partial sum a sequence-parallel layer leaves),
never summed over the group, so every rank steps the bias by a wrong gradient.

`--bug bias-before-reduce` plants a forward bug: every rank adds the row-parallel layer's
bias to its partial sum before the all-reduce, so layer `2`'s output carries the bias once
per rank. The gradients first show it at the output layer; the recorder's module outputs
(step 0) name layer `2`, where it happened.

`--bug input-grad-reduced-twice` plants a backward bug: the output layer's input gradient is
all-reduced once more after its own reduction (Megatron's `f` operator's backward doubled up),
so the gradient leaving layer `4` backward is `world` times too large. The forward is right;
the gradients first show it at layer `2`'s parameters; the gradients the recorder keeps at
the module outputs (step 0) name layer `4`, whose backward it is.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import lockstep_probe  # noqa: E402

STEPS = 4
SEED = 11


CLASSES = 12


def build_model():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(),
                         nn.Linear(16, CLASSES))


def batch(step):
    """The step's batch: every rank of a TP group computes on the same one."""
    g = torch.Generator().manual_seed(SEED * 10_000 + step)
    return torch.randn(8, 8, generator=g), torch.randint(CLASSES, (8,), generator=g)


def loss_fn(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train(out, bug):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   loss_parallel, parallelize_module)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = build_model()
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {
        "0": ColwiseParallel(),
        "2": RowwiseParallel(),
        # Logits stay sharded over the classes for `loss_parallel`.
        "4": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    hidden = {}  # the row-parallel layer's output, for the planted bias bug
    model[2].register_forward_hook(lambda _m, _i, out: hidden.update(out=out))
    if bug == "bias-before-reduce":
        # The bug: every rank adds the row-parallel layer's bias to its partial sum before the
        # all-reduce, so the output carries the bias `world` times (a forward bug in `2`).
        model[2].register_forward_hook(
            lambda m, _i, out: out + (world - 1) * m.bias.to_local())
    if bug == "input-grad-reduced-twice":
        # The bug: the gradient layer 4's backward sends to its input (layer 3's output) is
        # summed over the ranks once more, though every rank already holds the full sum.
        model[3].register_forward_hook(
            lambda _m, _i, out: out.register_hook(lambda g: g * world) and None)
    opt = optimizer(model.parameters())
    # Every TP rank computes on the same batch, on purpose: the recorder sees from the weights
    # each holds that they are not data-parallel replicas, so nothing needs saying.
    rec = lockstep_probe.Recorder(Path(out) / "run", model, name="mlp",  # lockstep
                                  config=f"tp{world}", seed=SEED, steps=STEPS)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        logits = model(x)
        if bug == "bias-grad-unreduced":
            hidden["out"].retain_grad()
        with loss_parallel():
            loss = nn.functional.cross_entropy(logits, y)
            loss.backward()
        if bug == "replica-skips-reduce" and rank == 1 and step == 1:
            model[2].bias.grad.to_local().mul_(0.5)  # the bug: this rank's partial sum
        if bug == "bias-grad-unreduced":
            # The bug: the bias's gradient from this rank's rows only, never all-reduced.
            rows = x.shape[0] // world
            d_out = hidden["out"].grad
            model[2].bias.grad.to_local().copy_(d_out[rank * rows:(rank + 1) * rows].sum(0))
        rec.step(loss, x, y)  # lockstep
        opt.step()
    rec.finish()  # lockstep
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "reference"])
    parser.add_argument("out")
    parser.add_argument("--bug", choices=["replica-skips-reduce", "bias-grad-unreduced",
                                          "bias-before-reduce", "input-grad-reduced-twice"])
    args = parser.parse_args()
    if args.mode == "train":
        train(args.out, args.bug)
    else:
        lockstep_probe.train_references(build_model, loss_fn, optimizer, Path(args.out) / "run",
                                        args.out)


if __name__ == "__main__":
    main()
