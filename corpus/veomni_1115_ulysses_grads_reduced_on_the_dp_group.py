"""ByteDance-Seed/VeOmni PR #1115 (2025): with Ulysses sequence parallelism at data-parallel
size 1, the gradient all-reduce ran on the data-parallel group, of one rank: a silent no-op,
so the sequence-parallel ranks each stepped with the gradient of their own part of the
sequence.

Mechanism: the weights' gradients must be averaged over every rank that computed a part of
the same batch (the data-parallel x sequence-parallel group), not over the data-parallel
group alone. `--bug` reduces over the data-parallel group (size 1 here). The ranks record the
whole batch they share (`replicated_data=True`). Simplified: the model computes each token on
its own (corpus/sequence.py), which leaves the reduction, where the bug lives, as it was.
"""

import torch.distributed as dist

from common import main, mean_over
from sequence import build, loss_fn, sgd, train_sp

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at


def train(out, bug):
    groups = []

    def sync(model, rank, world):
        if bug and not groups:
            # dp = 1: each rank its own data-parallel group (every rank creates every group,
            # in the same order, as new_group requires).
            groups.extend(dist.new_group([r]) for r in range(world))
        for p in model.parameters():
            mean_over(groups[rank] if bug else None, p.grad)

    train_sp(out, "sp2", sync)


if __name__ == "__main__":
    main(train, build, loss_fn, sgd)
