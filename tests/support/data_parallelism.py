"""A two-rank job of Lockstep's own tests (tests/judge_pytorch.rs) for the recorder's data
checks: the same small classifier under DDP or under DTensor tensor parallelism (its first
linear column-parallel, its second row-parallel), fed either one batch on every rank or a
batch of its own on each, and said to replicate its data (`--declare`) or not.

    python3 -m torch.distributed.run --nproc-per-node 2 tests/support/data_parallelism.py train OUT --parallel tp --data same
    python3 tests/support/data_parallelism.py reference OUT

Tensor-parallel ranks compute on the same batch by design and need no declaration; DDP's
replicas on the same batch are a loader without a DistributedSampler, declared or not; a
declared job whose ranks receive different batches is caught by the declaration's check.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "python"))
import lockstep_probe  # noqa: E402

STEPS = 2


def build():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def loss_fn(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def batch(step, rank):
    g = torch.Generator().manual_seed(step * 10 + rank)
    return torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)


def train(out, parallel, data, declare):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = build()
    if parallel == "tp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    else:
        model = DistributedDataParallel(model)
    opt = sgd(model.parameters())
    rec = lockstep_probe.Recorder(Path(out) / "run", model, name="mlp", config=parallel,
                                  steps=STEPS, replicated_data=declare)
    for step in range(STEPS):
        x, y = batch(step, 0 if data == "same" else rank)
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        rec.step(loss, x, y)
        opt.step()
    rec.finish()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "reference"])
    parser.add_argument("out")
    parser.add_argument("--parallel", choices=["ddp", "tp"], default="tp")
    parser.add_argument("--data", choices=["same", "own"], default="same")
    parser.add_argument("--declare", action="store_true",
                        help="Recorder(replicated_data=True): every rank gets the same batch")
    args = parser.parse_args()
    if args.mode == "train":
        train(args.out, args.parallel, args.data, args.declare)
    else:
        lockstep_probe.train_references(build, loss_fn, sgd, Path(args.out) / "run", args.out)


if __name__ == "__main__":
    main()
