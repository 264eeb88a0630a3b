"""Hugging Face accelerate's own training loop, judged by Lockstep (docs/judge.md): its
`Accelerator` picks the backend (gloo on the CPU), wraps the model in DDP, shards the data
loader over the ranks (its own `BatchSamplerShard`, not a `DistributedSampler`) and runs
gradient accumulation (`accumulate`, `backward`, which divides the loss by the accumulation
steps, and an optimizer that steps only when the gradients are synchronised). Nothing here
reimplements any of it; the job is written as accelerate's documentation writes one.

    python3 -m torch.distributed.run --nproc-per-node 2 examples/accelerate_ddp.py train OUT
    python3 examples/accelerate_ddp.py reference OUT
    lockstep judge --run OUT/run --reference OUT/reference --shadow OUT/shadow --out OUT/report

Each optimizer step is recorded once, after its last micro-step's backward (when
`accelerator.sync_gradients`), with the step's whole batch (its micro-batches put back
together) and loss (the micro-steps' scaled losses summed).

`--bug plain-backward` calls `loss.backward()` instead of `accelerator.backward(loss)`, a
common slip when porting a loop to accelerate: the loss is no longer divided by the
accumulation steps, so every gradient is twice the truth while the loss curve looks the
same.

Needs `accelerate` (`pip install accelerate`; CI installs it with `ci/setup-python-extras`).
"""

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import lockstep_probe  # noqa: E402

STEPS = 3
ACCUMULATE = 2
MICRO = 4  # rows per micro-batch on each rank
SEED = 17


def build_model():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5))


def loss_fn(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)


def dataset():
    g = torch.Generator().manual_seed(SEED)
    rows = 64
    return torch.utils.data.TensorDataset(torch.randn(rows, 8, generator=g),
                                          torch.randint(5, (rows,), generator=g))


def train(out, bug):
    from accelerate import Accelerator

    with lockstep_probe.deterministic("cpu"):
        accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE, cpu=True)
        model, opt = build_model(), None
        opt = optimizer(model.parameters())
        loader = torch.utils.data.DataLoader(dataset(), batch_size=MICRO, shuffle=False)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        rec = lockstep_probe.Recorder(Path(out) / "run", model, name="mlp",  # lockstep
                                      config=f"accelerate.ddp{accelerator.num_processes}",
                                      seed=SEED, steps=STEPS)
        micro, losses = [], []
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = loss_fn(model, x, y)
                if bug == "plain-backward":
                    loss.backward()  # the bug: the loss is not divided by the micro-steps
                else:
                    accelerator.backward(loss)
                micro.append((x, y))
                losses.append(loss.detach() / ACCUMULATE)
                if accelerator.sync_gradients:  # the step's last micro-step
                    rec.step(sum(losses), torch.cat([m[0] for m in micro]),  # lockstep
                             torch.cat([m[1] for m in micro]))
                    micro, losses = [], []
                opt.step()
                opt.zero_grad()
            if len(rec.losses) == STEPS:
                break
        rec.finish()  # lockstep
        accelerator.end_training()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "reference"])
    parser.add_argument("out")
    parser.add_argument("--bug", choices=["plain-backward"])
    args = parser.parse_args()
    if args.mode == "train":
        train(args.out, args.bug)
    else:
        lockstep_probe.train_references(build_model, loss_fn, optimizer, Path(args.out) / "run",
                                        args.out)


if __name__ == "__main__":
    main()
