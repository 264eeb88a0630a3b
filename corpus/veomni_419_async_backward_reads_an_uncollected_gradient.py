"""ByteDance-Seed/VeOmni PR #419 (2025): the asynchronous backward of Ulysses sequence
parallelism used a gradient before its collective had completed, so a rank computed with its
own partial gradient instead of the group's.

Mechanism: a collective launched with `async_op=True` writes its result only once waited
for; a reader before `wait()` sees the rank's own contribution. `--bug` takes the gradient
for the update before waiting (deterministically: the value the buffer held when the
collective was launched), as the race lets it. Simplified as corpus/sequence.py says.
"""

import torch.distributed as dist

from common import main
from sequence import build, loss_fn, sgd, train_sp

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at


def train(out, bug):
    def sync(model, rank, world):
        pending = []
        for p in model.parameters():
            reduced = p.grad.clone()  # the collective's buffer
            pending.append((p, reduced, dist.all_reduce(reduced, async_op=True)))
        for p, reduced, work in pending:
            if not bug:
                work.wait()
                p.grad.copy_(reduced)
            # Under the bug the gradient is read before wait(): what the buffer held when the
            # collective was launched, this rank's own (the race's outcome, made
            # deterministic).
            p.grad /= world
        for _, _, work in pending:
            work.wait()  # under the bug, its result lands where nothing reads it

    train_sp(out, "sp2.async", sync)


if __name__ == "__main__":
    main(train, build, loss_fn, sgd)
