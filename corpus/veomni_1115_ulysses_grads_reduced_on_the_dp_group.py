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

from common import STEPS, lockstep_probe, main, mean_over, start
from sequence import batch, build, loss_fn, part, sgd

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at


def train(out, bug):
    rank, world = start()
    # dp = 1: each rank its own data-parallel group (every rank creates every group, in
    # the same order, as new_group requires).
    dp_group = [dist.new_group([r]) for r in range(world)][rank]
    model = build()
    opt = sgd(model.parameters())
    rec = lockstep_probe.Recorder(out / "run", model, name="tokens", config=f"sp{world}",
                                  steps=STEPS, replicated_data=True)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = loss_fn(model, part(x, rank, world), part(y, rank, world))
        loss.backward()
        for p in model.parameters():
            mean_over(dp_group if bug else None, p.grad)
        rec.step(loss, x, y)
        opt.step()
    rec.finish()


if __name__ == "__main__":
    main(train, build, loss_fn, sgd)
