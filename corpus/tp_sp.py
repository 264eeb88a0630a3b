"""A tensor- and sequence-parallel block for the corpus's norm cases, written with DTensor's
`parallelize_module`: a LayerNorm on each rank's part of the sequence (sequence parallel),
a column-parallel and a row-parallel linear. Under sequence parallelism the norm's weights
are replicated while each rank normalizes its own tokens, so each rank's gradient of them is
a partial sum that must be summed over the tensor-parallel ranks, once: DTensor's
`SequenceParallel()` style does it."""

import torch
from torch import nn

from common import sgd
from common import token_loss as loss_fn

FEATURES, CLASSES, SEQUENCE, ROWS = 8, 5, 4, 2


def build():
    torch.manual_seed(37)
    return nn.Sequential(nn.LayerNorm(FEATURES), nn.Linear(FEATURES, 16), nn.Tanh(),
                         nn.Linear(16, CLASSES))


def batch(step):
    g = torch.Generator().manual_seed(300 + step)
    return (torch.randn(ROWS, SEQUENCE, FEATURES, generator=g),
            torch.randint(CLASSES, (ROWS, SEQUENCE), generator=g))


def train_tp_sp(out, config, norm_in_plan=True, after_backward=None):
    """The block under TP x SP at the world's size, recorded: each rank feeds its part of the
    sequence; `norm_in_plan=False` leaves the norm out of the plan (a plain module on the
    local part); `after_backward(model, mesh)` runs between backward and `rec.step` (a
    finalizer's reductions)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    from common import STEPS, lockstep_probe, start

    rank, world = start()
    mesh = init_device_mesh("cpu", (world,))
    plan = {"1": ColwiseParallel(input_layouts=Shard(1)),
            "3": RowwiseParallel(output_layouts=Replicate())}
    if norm_in_plan:
        plan["0"] = SequenceParallel()
    model = parallelize_module(build(), mesh, plan)
    opt = sgd(model.parameters())
    rec = lockstep_probe.Recorder(out / "run", model, name="block", config=config, steps=STEPS)
    part = SEQUENCE // world
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = loss_fn(model, x[:, rank * part:(rank + 1) * part], y)
        loss.backward()
        if after_backward is not None:
            after_backward(model, mesh)
        rec.step(loss, x, y)
        opt.step()
    rec.finish()
