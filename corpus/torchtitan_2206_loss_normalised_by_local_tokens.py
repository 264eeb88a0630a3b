"""pytorch/torchtitan PR #2206 (2026-01, fixing #1842): the loss was normalised per rank (and
per microbatch) by the rank's own valid tokens, so when ranks held different numbers of
valid tokens the gradient weighted their tokens unequally.

Mechanism: each valid token of the step must weigh the same: a rank's loss is its summed
token loss over the valid tokens of every rank (summed with an all-reduce), and the ranks'
gradients are summed, not averaged. `--bug` divides by the rank's own valid tokens and
averages the gradients (the mean of the ranks' means): rank 0 holds 9 valid tokens and rank 1
holds 6, so rank 1's tokens weigh one and a half times rank 0's.
"""

import torch
import torch.distributed as dist

from common import STEPS, lockstep_probe, main, sgd, start
from padded import batch, build, reference_loss, summed_loss, valid

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at


def train(out, bug):
    rank, world = start()
    model = build()
    opt = sgd(model.parameters())
    rec = lockstep_probe.Recorder(out / "run", model, name="tokens", config=f"dp{world}.tokens",
                                  steps=STEPS, loss_reduction="mean" if bug else "sum")
    for step in range(STEPS):
        x, y = batch(step, rank)
        counts = torch.tensor([valid(y)])
        dist.all_reduce(counts)  # the step's valid tokens over every rank
        opt.zero_grad()
        loss = summed_loss(model, x, y) / (valid(y) if bug else int(counts))
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            if bug:
                p.grad /= world  # the mean of the ranks' own means
        rec.step(loss, x, y)
        opt.step()
    rec.finish()


if __name__ == "__main__":
    main(train, build, reference_loss(WORLD), sgd)
