"""ByteDance-Seed/VeOmni PR #419 (2025): the asynchronous backward of Ulysses sequence
parallelism used a gradient before its collective had completed, so a rank computed with its
own partial gradient instead of the group's.

Mechanism: a collective launched with `async_op=True` writes its result only once waited
for; a reader before `wait()` sees the rank's own contribution. `--bug` takes the gradient
for the update before waiting (deterministically: the value the buffer held when the
collective was launched), as the race lets it. Simplified as corpus/sequence.py says.
"""

import torch.distributed as dist

from common import STEPS, lockstep_probe, main, start
from sequence import batch, build, loss_fn, part, sgd

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at


def train(out, bug):
    rank, world = start()
    model = build()
    opt = sgd(model.parameters())
    rec = lockstep_probe.Recorder(out / "run", model, name="tokens", config=f"sp{world}.async",
                                  steps=STEPS, replicated_data=True)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = loss_fn(model, part(x, rank, world), part(y, rank, world))
        loss.backward()
        pending = []
        for p in model.parameters():
            reduced = p.grad.clone()  # the collective's buffer
            pending.append((p, reduced, dist.all_reduce(reduced, async_op=True)))
        for p, reduced, work in pending:
            if bug:
                # Read before wait(): what the buffer held when the collective was launched,
                # this rank's own gradient (the race's outcome, made deterministic).
                pass
            else:
                work.wait()
                p.grad.copy_(reduced)
            p.grad /= world
        for _, _, work in pending:
            work.wait()  # under the bug, its result lands where nothing reads it
        rec.step(loss, x, y)
        opt.step()
    rec.finish()


if __name__ == "__main__":
    main(train, build, loss_fn, sgd)
