"""A job of Lockstep's own tests (tests/judge_pytorch.rs) for the recorder's data checks and
copy check: the same small classifier (a LayerNorm, then two linears) under DDP, under DTensor
tensor parallelism (its first linear column-parallel, its second row-parallel, the norm left
out of the plan), or under FSDP x TP on a 2 x 2 (dp, tp) mesh (the TP model sharded by
FSDP2 over dp), fed the right data for the parallelism (`--data right`: a batch per
data-parallel replica, shared by the TP ranks), one batch on every rank (`same`) or a batch
of its own on each (`own`), the right data but the second replica's loader stuck (`stuck`); or DDP over a (dp, cp) mesh whose cp ranks share a batch, said
with `--declare` as `replicated_data=mesh["cp"]` (`ddp-cp`); read through a `DistributedSampler` split over the replicas
(`sampler`) or seeded by each rank's number (`sampler-seeded`), and said to replicate its data (`--declare`) or not. `--resume`
records from its second step with its optimizer's momentum given to the recorder, as a job
resumed from a checkpoint (on FSDP x TP, a DTensor state on a 2-D mesh). `--loss-reduction
sum` (FSDP x TP): each rank's loss is its share of the global one and FSDP sums the replicas'
gradients, recorded with `loss_reduction="sum"`; `--bug declared-sum` records a job whose
ranks each hold their own mean with `loss_reduction="sum"`: its loss is recorded twice over,
its training right.

    python3 -m torch.distributed.run --nproc-per-node 2 tests/support/data_parallelism.py train OUT --parallel tp
    python3 -m torch.distributed.run --nproc-per-node 4 tests/support/data_parallelism.py train OUT --parallel fsdp-tp
    python3 tests/support/data_parallelism.py reference OUT

Tensor-parallel ranks compute on the same batch by design and need no declaration; DDP's
replicas on the same batch are a loader without a DistributedSampler, declared or not; a
declared job whose ranks receive different batches is caught by the declaration's check.
`--bug norm-drifts` (FSDP x TP): the second TP rank of each replica scales its norm's
gradient, so the copies of the norm the TP ranks hold (FSDP's shard of a parameter the TP
plan leaves out) part after the first update.
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
    return nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def loss_fn(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def batch(step, rank):
    g = torch.Generator().manual_seed(step * 10 + rank)
    return torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)


def loader(data, replica, replicas, rank):
    """The batches of a `DistributedSampler` over a dataset of 24 samples, 6 a batch, split
    over the data-parallel replicas (`sampler`), or seeded by each rank's own number
    (`sampler-seeded`, the bug: every rank shuffles the dataset its own way, so some samples
    go to two ranks an epoch and some to none)."""
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    g = torch.Generator().manual_seed(7)
    dataset = TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 3, generator=g))
    seed = rank if data == "sampler-seeded" else 0
    sampler = DistributedSampler(dataset, num_replicas=replicas, rank=replica, shuffle=True,
                                 seed=seed)
    sampler.set_epoch(0)
    return iter(DataLoader(dataset, batch_size=6, sampler=sampler))


def train(out, parallel, data, declare, bug, resume, loss_reduction):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build()
    # This rank's data-parallel replica, their number, and its place in TP.
    replica, replicas, tp_rank = rank, world, 0
    plan = {"1": ColwiseParallel(), "3": RowwiseParallel()}
    if parallel == "tp":
        model = parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
        replica, replicas, tp_rank = 0, 1, rank
    elif parallel == "fsdp-tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        model = fully_shard(parallelize_module(model, mesh["tp"], plan), mesh=mesh["dp"])
        if loss_reduction == "sum":
            model.set_gradient_divide_factor(1.0)  # FSDP sums the replicas' gradients
            model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        replica, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
        replicas = world // 2
    elif parallel == "ddp-cp":
        # DDP over a (dp, cp) mesh whose cp ranks share their batch, as context parallelism's
        # ranks do (each would compute a part of its sequence): said with the cp mesh.
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))
        model = DistributedDataParallel(model)
        replica, replicas = mesh["dp"].get_local_rank(), world // 2
        declare = mesh["cp"] if declare else False
    else:
        model = DistributedDataParallel(model)
    if loss_reduction == "sum" and parallel != "fsdp-tp":
        sys.exit("--loss-reduction sum: FSDP x TP only (DDP always averages)")
    # Each rank's loss: its own mean, or (summed over the replicas) its share of the mean.
    share = replicas if loss_reduction == "sum" else 1
    opt = sgd(model.parameters())
    if resume:
        # A step before recording begins, as a job resumed from a checkpoint holds its
        # optimizer's momentum: the recorder saves it and the references start from it.
        loss_fn(model, *batch(-1, replica)).backward()
        opt.step()
    rec = lockstep_probe.Recorder(Path(out) / "run", model, name="mlp", config=parallel,
                                  steps=STEPS, replicated_data=declare,
                                  loss_reduction=("sum" if bug == "declared-sum"
                                                  else loss_reduction),
                                  optimizer=opt if resume else None)
    batches = loader(data, replica, replicas, rank) if data.startswith("sampler") else None
    for step in range(STEPS):
        if batches is not None:
            x, y = next(batches)
        else:
            # `stuck`: the second replica's loader does not advance.
            at = 0 if data == "stuck" and replica == 1 else step
            x, y = batch(at, {"right": replica, "stuck": replica, "same": 0, "own": rank}[data])
        opt.zero_grad()
        loss = loss_fn(model, x, y) / share
        loss.backward()
        if bug == "norm-drifts" and tp_rank == 1:
            with torch.no_grad():
                model[0].weight.grad.mul_(1.01)
        rec.step(loss, x, y)
        opt.step()
    rec.finish()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "reference"])
    parser.add_argument("out")
    parser.add_argument("--parallel", choices=["ddp", "tp", "fsdp-tp", "ddp-cp"], default="tp")
    parser.add_argument("--data", choices=["right", "same", "own", "stuck", "sampler",
                                           "sampler-seeded"],
                        default="right")
    parser.add_argument("--bug", choices=["norm-drifts", "declared-sum"])
    parser.add_argument("--loss-reduction", choices=["mean", "sum"], default="mean",
                        help="each rank's loss its own mean, or its share (FSDP x TP)")
    parser.add_argument("--resume", action="store_true",
                        help="record from the second step, the optimizer's momentum given")
    parser.add_argument("--declare", action="store_true",
                        help="Recorder(replicated_data=True): every rank gets the same batch")
    args = parser.parse_args()
    if args.mode == "train":
        train(args.out, args.parallel, args.data, args.declare, args.bug, args.resume,
              args.loss_reduction)
    else:
        lockstep_probe.train_references(build, loss_fn, sgd, Path(args.out) / "run", args.out)


if __name__ == "__main__":
    main()
