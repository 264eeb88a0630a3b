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

from common import main, mean_over
from sequence import batch, build, loss_fn, part, sgd, train_sp

WORLD = 2
EXPECT_STEP = None  # the step the judge first sees the bug at
EXPECT_FIRST = 'evaluation'  # in the failure the judge names first


def train(out, bug):
    def sync(model, rank, world):
        for p in model.parameters():
            mean_over(None, p.grad)

    def evaluate(rec, model, step, rank, world):
        """Evaluation after each step, on a held-out batch, as the trainer reports it."""
        ex, ey = batch(100 + step)
        with torch.no_grad():
            model.eval()
            mine = loss_fn(model, part(ex, rank, world), part(ey, rank, world))
            model.train()
        dist.all_reduce(mine)
        rec.metric("eval_loss", mine if bug else mine / world, ex, ey)

    train_sp(out, "cp2", sync, after_step=evaluate)


if __name__ == "__main__":
    main(train, build, loss_fn, sgd, metrics={"eval_loss": loss_fn})
