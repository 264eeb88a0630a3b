"""Lightning Fabric's `ModelParallelStrategy`, judged by Lockstep (docs/judge.md): Fabric
builds the device mesh (`data_parallel` x `tensor_parallel`), calls the job's parallelize
function on it, sets up the optimizer and puts a `DistributedSampler` on the loader
(`setup_dataloaders`); the job writes the loop as Fabric's documentation does
(`fabric.backward`). Nothing here reimplements any of it.

    python3 -m torch.distributed.run --nproc-per-node 2 examples/lightning_fabric.py train OUT --parallel fsdp
    python3 examples/lightning_fabric.py reference OUT
    lockstep judge --run OUT/run --reference OUT/reference --shadow OUT/shadow --out OUT/report

`--parallel fsdp`: FSDP2 (`fully_shard` on each linear and the model) over the data-parallel
mesh, each rank its own samples; `--parallel tp`: the first linear column-parallel and the
second row-parallel over the tensor-parallel mesh, every rank the same batch (the recorder
sees from the weights they hold that the ranks are not replicas, so nothing is declared).

`--bug own-sampler` (under fsdp) tells Fabric to keep the loader's sampler
(`use_distributed_sampler=False`), as a job that brings its own loader does: every rank then
reads the whole dataset in the same order, the same batch on every rank, and the numbers
still match the references. The recorder's data check names it.

Needs `lightning` (`pip install lightning`; CI installs it with `ci/setup-python-extras`).
"""

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import lockstep_probe  # noqa: E402

STEPS = 3
ROWS = 4  # rows per batch on each rank
SEED = 29


def build_model():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(),
                         nn.Linear(8, 3))


def loss_fn(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def optimizer(params):
    return torch.optim.Adam(params, lr=1e-2)


def dataset():
    g = torch.Generator().manual_seed(SEED)
    rows = 32
    return torch.utils.data.TensorDataset(torch.randn(rows, 8, generator=g),
                                          torch.randint(3, (rows,), generator=g))


def parallelize(parallel):
    """Fabric's parallelize function for `parallel`: called with the model and Fabric's mesh."""
    def apply(model, mesh):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        if parallel == "tp":
            return parallelize_module(model, mesh["tensor_parallel"],
                                      {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh["data_parallel"])
        return fully_shard(model, mesh=mesh["data_parallel"])
    return apply


def train(out, parallel, bug):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    with lockstep_probe.deterministic("cpu"):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        sizes = dict(data_parallel_size=1, tensor_parallel_size=world) if parallel == "tp" \
            else dict(data_parallel_size=world, tensor_parallel_size=1)
        strategy = ModelParallelStrategy(parallelize_fn=parallelize(parallel), **sizes)
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        model = fabric.setup_module(build_model())
        opt = fabric.setup_optimizers(optimizer(model.parameters()))
        shuffle = parallel != "tp"  # TP ranks read one batch in one order
        loader = torch.utils.data.DataLoader(dataset(), batch_size=ROWS, shuffle=shuffle)
        if parallel == "tp":
            loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
        else:
            loader = fabric.setup_dataloaders(loader,
                                              use_distributed_sampler=bug != "own-sampler")
        rec = lockstep_probe.Recorder(Path(out) / "run", model, name="mlp",  # lockstep
                                      config=f"fabric.{parallel}{fabric.world_size}",
                                      seed=SEED, steps=STEPS)
        for _, (x, y) in zip(range(STEPS), loader):
            opt.zero_grad()
            loss = loss_fn(model, x, y)
            fabric.backward(loss)
            rec.step(loss, x, y)  # lockstep
            opt.step()
        rec.finish()  # lockstep


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "reference"])
    parser.add_argument("out")
    parser.add_argument("--parallel", choices=["fsdp", "tp"], default="fsdp")
    parser.add_argument("--bug", choices=["own-sampler"])
    args = parser.parse_args()
    if args.mode == "train":
        train(args.out, args.parallel, args.bug)
    else:
        lockstep_probe.train_references(build_model, loss_fn, optimizer, Path(args.out) / "run",
                                        args.out)


if __name__ == "__main__":
    main()
