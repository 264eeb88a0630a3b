"""pytorch/torchtitan #4544 (2025): under context parallelism the labels were shifted for
next-token prediction after the sequence was sharded, inside each shard, so the token at
every shard boundary lost its label and each rank's loss covered one token fewer.

Mechanism: next-token labels are the sequence shifted by one; the shift must happen on the
whole sequence, before it is split over the context-parallel ranks. `--bug` shards first and
shifts each part. A token-wise language model (an embedding, a feed-forward block, a head):
the bug lives in the data path, not in attention.
"""

import torch
from torch import nn

from common import STEPS, lockstep_probe, main, mean_over, sgd, start
from common import token_loss as loss_fn

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at
VOCAB, WIDTH, SEQUENCE, ROWS = 11, 12, 8, 2


def build():
    torch.manual_seed(29)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU(),
                         nn.Linear(WIDTH, VOCAB))


def tokens(step):
    """The step's token sequences, one longer than the model reads (the last is a label)."""
    g = torch.Generator().manual_seed(700 + step)
    return torch.randint(VOCAB, (ROWS, SEQUENCE + 1), generator=g)


def part(t, rank, ranks, length):
    size = length // ranks
    return t[:, rank * size:(rank + 1) * size]


def train(out, bug):
    rank, world = start()
    model = build()
    opt = sgd(model.parameters())
    rec = lockstep_probe.Recorder(out / "run", model, name="lm", config=f"cp{world}",
                                  steps=STEPS, replicated_data=True)
    for step in range(STEPS):
        t = tokens(step)
        inputs, labels = t[:, :-1], t[:, 1:]  # shifted on the whole sequence
        if bug:
            mine = part(t[:, :-1], rank, world, SEQUENCE)  # sharded first...
            x, y = mine[:, :-1], mine[:, 1:]  # ...then shifted within the part
        else:
            x, y = part(inputs, rank, world, SEQUENCE), part(labels, rank, world, SEQUENCE)
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        for p in model.parameters():
            mean_over(None, p.grad)
        rec.step(loss, inputs, labels)
        opt.step()
    rec.finish()


if __name__ == "__main__":
    main(train, build, loss_fn, sgd)
