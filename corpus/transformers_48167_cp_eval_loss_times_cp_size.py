"""huggingface/transformers PR #48167 (2025): under context parallelism the evaluation loss
was reported as `cp_size` times the true value; training was right, so no training curve or
gradient showed it.

Mechanism: each context-parallel rank computes the mean loss of its part of the sequences;
the evaluation loss over the whole sequences is their mean over the ranks, not their sum.
`--bug` all-reduces the evaluation loss with SUM and reports it undivided. The recorder
records the reported value (`rec.metric`) with every rank's evaluation batch, the references
compute the metric themselves, and the judge fails the job on its evaluation loss alone.
Simplified as corpus/sequence.py says.
"""

import torch
import torch.distributed as dist

from common import STEPS, lockstep_probe, main, mean_over, start
from sequence import batch, build, loss_fn, part, sgd

WORLD = 2
EXPECT_STEP = None  # the step the judge first sees the bug at
EXPECT_FIRST = 'evaluation'  # in the failure the judge names first


def train(out, bug):
    rank, world = start()
    model = build()
    opt = sgd(model.parameters())
    rec = lockstep_probe.Recorder(out / "run", model, name="tokens", config=f"cp{world}",
                                  steps=STEPS, replicated_data=True)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = loss_fn(model, part(x, rank, world), part(y, rank, world))
        loss.backward()
        for p in model.parameters():
            mean_over(None, p.grad)
        rec.step(loss, x, y)
        opt.step()
        # Evaluation after each step, on a held-out batch, as the trainer reports it.
        ex, ey = batch(100 + step)
        with torch.no_grad():
            model.eval()
            mine = loss_fn(model, part(ex, rank, world), part(ey, rank, world))
            model.train()
        dist.all_reduce(mine)
        reported = mine if bug else mine / world
        rec.metric("eval_loss", reported, ex, ey)
    rec.finish()


if __name__ == "__main__":
    main(train, build, loss_fn, sgd, metrics={"eval_loss": loss_fn})
