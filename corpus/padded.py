"""Token batches with padding for the corpus's loss-normalisation cases: every rank's
sequences carry some padded tokens (label -100, which the loss ignores), a different number
on each rank but the same total every step, as packed or padded batches of real text do.
The step's objective is the mean over every valid token of every rank (each token weighs
the same), not the mean of the ranks' own means."""

import torch
from torch import nn

FEATURES, CLASSES, SEQUENCE, ROWS, PADDING = 6, 5, 6, 2, -100
PADDED = [(0, 1, 2), (0, 4, 5, 7, 9, 10)]  # flat positions padded on rank 0, on rank 1


def build():
    torch.manual_seed(41)
    return nn.Sequential(nn.Linear(FEATURES, 12), nn.GELU(), nn.Linear(12, CLASSES))


def batch(step, rank):
    """A rank's sequences and labels at `step`, its padded positions labelled `PADDING`."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(ROWS, SEQUENCE, FEATURES, generator=g)
    y = torch.randint(CLASSES, (ROWS, SEQUENCE), generator=g)
    y.view(-1)[list(PADDED[rank % len(PADDED)])] = PADDING
    return x, y


def valid(y):
    return int((y != PADDING).sum())


def summed_loss(model, x, y):
    """The summed loss of `x`'s valid tokens."""
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(),
                                       ignore_index=PADDING, reduction="sum")


def global_valid(world):
    """Every rank's valid tokens of a step, summed (the same at every step)."""
    return sum(valid(batch(0, r)[1]) for r in range(world))


def reference_loss(world):
    """The references' `loss_fn` for a world of `world` ranks: their mean over the ranks must
    be the step's mean over every valid token, so each rank's is its summed loss over the
    step's valid tokens, times the ranks."""
    total = global_valid(world)

    def loss_fn(model, x, y):
        return summed_loss(model, x, y) * world / total
    return loss_fn
