"""pytorch/torchtitan #3280 (2025): under context parallelism (with TP) the logged training
loss was reduced over the tensor-parallel ranks but not over the context-parallel ones, so
each rank logged the loss of its own part of the sequences.

Mechanism: a rank's loss is the mean over its part of every sequence; the step's loss is
their mean over the context-parallel group. `--bug` logs rank 0's own part's loss. The
training is right; the logged value is recorded as a metric (`rec.metric("train_loss", ...)`,
before `rec.step`: the state before the step's update), and the judge fails it alone.
"""

import torch.distributed as dist

from attention import Attention, loss_fn, sgd, train_cp
from common import main

WORLD = 2
EXPECT_STEP = None  # the step the judge first sees the bug at
EXPECT_FIRST = 'evaluation'  # in the failure the judge names first


def train(out, bug):
    def report(rec, loss, x, y, rank, world):
        logged = loss.detach().clone()
        if not bug:
            dist.all_reduce(logged)
            logged /= world
        dist.broadcast(logged, 0)  # the job logs rank 0's value
        rec.metric("train_loss", logged, x, y)

    train_cp(out, "cp2", report=report)


if __name__ == "__main__":
    main(train, Attention, loss_fn, sgd, metrics={"train_loss": loss_fn})
