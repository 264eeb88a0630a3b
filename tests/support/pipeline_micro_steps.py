"""A pipelining job of Lockstep's own tests (tests/judge_pytorch.rs): gradient accumulation
over two `schedule.step` calls a step whose sequences differ in length (3 and 5), as padded or
packed batches of a sequence model do. Stage 0 embeds each position and averages them
(its outputs' shapes follow the sequence), stage 1 classifies.

    python3 -m torch.distributed.run --nproc-per-node 2 tests/support/pipeline_micro_steps.py train OUT [--bug scale-grads]
    python3 tests/support/pipeline_micro_steps.py reference OUT

`--bug scale-grads` keeps the schedule's `scale_grads=True`: it divides every gradient the
stage holds by the microbatches' count after each `schedule.step`, the earlier micro-step's
accumulated gradients again, so the first micro-step weighs half the second.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "python"))
import lockstep_probe  # noqa: E402

MICROBATCH, MICROBATCHES, LENGTHS, STEPS = 2, 2, (3, 5), 2


class MeanOverSequence(nn.Module):
    def forward(self, h):
        return h.mean(dim=1)


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), MeanOverSequence(), nn.Linear(16, 6))


def loss_fn(model, *batch):
    """The step's loss: the mean of its micro-steps' losses, each micro-step run on its own
    (their sequences cannot be stacked into one batch)."""
    pairs = list(zip(batch[0::2], batch[1::2]))
    return sum(nn.functional.cross_entropy(model(x), y) for x, y in pairs) / len(pairs)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def batch(step):
    """The step's micro-steps, one (inputs, targets) pair each, flattened."""
    g = torch.Generator().manual_seed(step)
    rows = MICROBATCH * MICROBATCHES
    return [t for n in LENGTHS for t in (torch.randn(rows, n, 8, generator=g),
                                       torch.randint(6, (rows,), generator=g))]


def train(out, bug):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = build()
    module = model[0:3] if rank == 0 else model[3:]
    if rank == 0:
        shapes = dict(input_args=(torch.empty(MICROBATCH, LENGTHS[0], 8),),
                      output_args=torch.empty(MICROBATCH, 16),
                      output_grads=torch.empty(MICROBATCH, 16))
    else:
        shapes = dict(input_args=(torch.empty(MICROBATCH, 16, requires_grad=True),),
                      output_args=torch.empty(MICROBATCH, 6),
                      input_grads=(torch.empty(MICROBATCH, 16),))
    stage = PipelineStage(module, rank, 2, torch.device("cpu"), **shapes)
    if bug == "scale-grads":
        share = len(LENGTHS)
    else:
        share = MICROBATCHES * len(LENGTHS)  # each microbatch's share of the step's loss
    pipe = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, scale_grads=bug == "scale-grads",
                         loss_fn=lambda y_hat, y: nn.functional.cross_entropy(y_hat, y) / share)
    opt = sgd(module.parameters())
    rec = lockstep_probe.Recorder(Path(out) / "run", module, name="seq", config="pp2.gpipe",
                                  steps=STEPS, stages=True)
    for step in range(STEPS):
        parts = batch(step)
        opt.zero_grad()
        losses = []
        for x, y in zip(parts[0::2], parts[1::2]):
            mine = []  # the schedule empties the list it is given
            if rank == 0:
                pipe.step(x)
            else:
                pipe.step(target=y, losses=mine)
            losses += mine
        if losses and bug == "scale-grads":
            loss = sum(losses) / MICROBATCHES
        else:
            loss = sum(losses) if losses else None
        rec.step(loss, *parts)
        opt.step()
    rec.finish()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "reference"])
    parser.add_argument("out")
    parser.add_argument("--bug", choices=["scale-grads"])
    args = parser.parse_args()
    if args.mode == "train":
        train(args.out, args.bug)
    else:
        lockstep_probe.train_references(build, loss_fn, sgd, Path(args.out) / "run", args.out)


if __name__ == "__main__":
    main()
