"""A token-wise model for the corpus's sequence- and context-parallel cases: every token
computed on its own (an embedding, a feed-forward block, a classifier), so splitting a
sequence over ranks changes nothing of the math, and the bugs these cases plant (in how the
ranks' gradients, losses and metrics are reduced) are the only difference. Attention, which
mixes tokens, is what these parallelisms exist for; the published bugs below live in the
reductions around it, not in it.

Each rank of the sequence-parallel group takes its contiguous part of every sequence; its
loss is the mean over its tokens; the global loss is the mean over the ranks (equal parts),
so the weights' gradients are averaged over the group."""

import torch
from torch import nn

from common import part, sgd
from common import token_loss as loss_fn

FEATURES, CLASSES, SEQUENCE, ROWS = 8, 5, 8, 2


def build():
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, CLASSES))


def batch(step):
    """The step's sequences, the same on every rank of a sequence-parallel group."""
    g = torch.Generator().manual_seed(500 + step)
    return (torch.randn(ROWS, SEQUENCE, FEATURES, generator=g),
            torch.randint(CLASSES, (ROWS, SEQUENCE), generator=g))


def train_sp(out, config, sync, after_step=None):
    """A sequence-parallel job of the token-wise model at the world's size, recorded: each
    rank trains on its part of the step's sequences and records the whole batch the ranks
    share; `sync(model, rank, world)` reduces the gradients between backward and `rec.step`
    (the case's reduction, right or planted); `after_step(rec, model, step, rank, world)` runs
    after the update (a case's evaluation)."""
    from common import STEPS, lockstep_probe, start

    rank, world = start()
    model = build()
    opt = sgd(model.parameters())
    rec = lockstep_probe.Recorder(out / "run", model, name="tokens", config=config,
                                  steps=STEPS, replicated_data=True)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = loss_fn(model, part(x, rank, world), part(y, rank, world))
        loss.backward()
        sync(model, rank, world)
        rec.step(loss, x, y)
        opt.step()
        if after_step is not None:
            after_step(rec, model, step, rank, world)
    rec.finish()
