"""PyTorch Lightning's own `Trainer`, judged by Lockstep (docs/judge.md): Lightning runs the
loop, wraps the module in DDP (its `ddp` strategy, gloo on the CPU), puts a
`DistributedSampler` on the training loader, calls `set_epoch`, and accumulates gradients
(`accumulate_grad_batches=2`, dividing each micro-step's loss by 2 and skipping DDP's
all-reduce on all but the last). Nothing here reimplements any of it; the recorder sits in
two of Lightning's own hooks.

    python3 -m torch.distributed.run --nproc-per-node 2 examples/lightning_trainer.py train OUT
    python3 examples/lightning_trainer.py reference OUT
    lockstep judge --run OUT/run --reference OUT/reference --shadow OUT/shadow --out OUT/report

The recorder is created in `on_train_start` (after Lightning wrapped the module) and records
each optimizer step in `on_before_optimizer_step` (after the last micro-step's backward,
before the update), with the step's micro-batches put back together and its loss.

`--bug sampler-per-rank`: the loader brings its own `DistributedSampler`, seeded by each
rank's number, and Lightning is told not to replace it (`use_distributed_sampler=False`):
every rank shuffles the dataset its own way, so in an epoch some samples are trained on
twice and some never, while no two ranks' batches are alike and the numbers match the
references (which train on the batches the ranks received). The recorder's sample check
names it.

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
ACCUMULATE = 2
MICRO = 4  # rows per micro-batch on each rank
SEED = 23


def build_model():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                         nn.Linear(24, 1))


def loss_fn(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def dataset():
    g = torch.Generator().manual_seed(SEED)
    rows = 48
    return torch.utils.data.TensorDataset(torch.randn(rows, 6, generator=g),
                                          torch.randn(rows, 1, generator=g))


def train(out, bug):
    import lightning.pytorch as pl

    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_model()
            self.micro, self.losses, self.rec = [], [], None

        def on_train_start(self):
            self.rec = lockstep_probe.Recorder(  # lockstep
                Path(out) / "run", self.net, name="mlp",
                config=f"lightning.ddp{self.trainer.world_size}", seed=SEED, steps=STEPS)

        def training_step(self, batch, _index):
            x, y = batch
            loss = loss_fn(self.net, x, y)
            self.micro.append((x, y))
            self.losses.append(loss.detach() / ACCUMULATE)
            return loss

        def on_before_optimizer_step(self, _optimizer):
            # The step's last backward is done and DDP has averaged the gradients.
            self.rec.step(sum(self.losses), torch.cat([m[0] for m in self.micro]),  # lockstep
                          torch.cat([m[1] for m in self.micro]))
            self.micro, self.losses = [], []

        def on_train_end(self):
            self.rec.finish()  # lockstep

        def configure_optimizers(self):
            return optimizer(self.parameters())

    data = dataset()
    if bug == "sampler-per-rank":
        # The bug: each rank's own sampler, seeded by its rank (the loader is built before
        # Lightning starts the process group, so the ranks are read from torchrun's variables).
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        sampler = torch.utils.data.distributed.DistributedSampler(
            data, num_replicas=world, rank=rank, seed=rank)
        loader = torch.utils.data.DataLoader(data, batch_size=MICRO, sampler=sampler)
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=True)
    with lockstep_probe.deterministic("cpu"):
        trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")),
                             strategy="ddp",
                             accumulate_grad_batches=ACCUMULATE, max_steps=STEPS, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False,
                             use_distributed_sampler=bug != "sampler-per-rank")
        trainer.fit(Regressor(), loader)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "reference"])
    parser.add_argument("out")
    parser.add_argument("--bug", choices=["sampler-per-rank"])
    args = parser.parse_args()
    if args.mode == "train":
        train(args.out, args.bug)
    else:
        lockstep_probe.train_references(build_model, loss_fn, optimizer, Path(args.out) / "run",
                                        args.out)


if __name__ == "__main__":
    main()
