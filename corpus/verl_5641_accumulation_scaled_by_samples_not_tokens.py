"""verl-project/verl PR #5641 (2026-03, issue #5625): with token-mean loss aggregation,
gradient accumulation scaled each micro-batch's token mean by its share of the samples, not
of the tokens, so micro-batches with fewer valid tokens weighed too much.

Mechanism: the accumulated objective is the step's mean over every valid token; a
micro-batch's token mean must be scaled by its share of the step's valid tokens. `--bug`
scales it by its share of the samples (rows). Two micro-batches a step under DDP-style
averaging over two ranks, each rank holding the same valid tokens in all (so the ranks' means
average to the token mean).
"""

from common import STEPS, lockstep_probe, main, mean_over, sgd, start
from padded import PADDED, batch, build, summed_loss, valid

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at


def loss_fn(model, x, y):
    """A rank's loss: its step's token mean (every rank holds the same valid tokens)."""
    return summed_loss(model, x, y) / valid(y)


def rank_batch(step, rank):
    """A rank's step: the two padding patterns as its two micro-batches (rows 0-1, 2-3), so
    every rank holds the same valid tokens and its micro-batches differ in them."""
    import torch

    first, second = batch(step, 2 * rank), batch(step, 2 * rank + 1)
    return torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]])


def train(out, bug):
    rank, world = start()
    model = build()
    opt = sgd(model.parameters())
    rec = lockstep_probe.Recorder(out / "run", model, name="tokens", config=f"dp{world}.accum",
                                  steps=STEPS)
    assert len(PADDED) == 2
    for step in range(STEPS):
        x, y = rank_batch(step, rank)
        rows = x.shape[0] // 2
        micro = [(x[:rows], y[:rows]), (x[rows:], y[rows:])]
        total_tokens, total_rows = valid(y), x.shape[0]
        opt.zero_grad()
        loss = 0.0
        for mx, my in micro:
            mean = summed_loss(model, mx, my) / valid(my)
            share = my.shape[0] / total_rows if bug else valid(my) / total_tokens
            (mean * share).backward()
            loss = loss + float(mean * share)
        for p in model.parameters():
            mean_over(None, p.grad)
        rec.step(loss, x, y)
        opt.step()
    rec.finish()


if __name__ == "__main__":
    main(train, build, loss_fn, sgd)
