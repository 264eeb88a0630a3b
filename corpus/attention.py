"""A one-head attention model for the corpus's context-parallel cases, written over
`all_gather` as hand-written context parallelism is: each rank of the context-parallel group
holds a contiguous part of every sequence, computes its queries, keys and values, gathers
every rank's keys and values, and attends with its own queries over the whole sequence (no
mask). `GatherSequence` is the exchange: its backward sums every rank's gradient of a part's
keys and values (every rank's queries attended to them) and keeps this rank's part.

The single-device model is the same layer over the whole sequence. Each rank's loss is the
mean over its tokens; the weights' gradients are averaged over the group."""

import torch
import torch.distributed as dist
from torch import nn

from common import part, sgd
from common import token_loss as loss_fn

FEATURES, WIDTH, CLASSES, SEQUENCE, ROWS = 6, 8, 5, 8, 2


class GatherSequence(torch.autograd.Function):
    """Every rank's part of `x` along dimension 1, in rank order. `sum_grads=False` is the bug
    of a hand-written backward that keeps this rank's own gradient of its part without
    summing the others' (their queries attended to it too)."""

    @staticmethod
    def forward(ctx, x, group, sum_grads):
        ctx.group, ctx.sum_grads = group, sum_grads
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        if ctx.sum_grads:
            dist.all_reduce(grad, group=ctx.group)
        size = grad.shape[1] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[:, rank * size:(rank + 1) * size], None, None


class Attention(nn.Module):
    """Embedding, one attention head with a residual, a classifier per token. `cp_group`: the
    context-parallel group (this rank holds its part of each sequence); `gather`: whether keys
    and values are gathered over it (False: the bug of attention over the local part only);
    `sum_grads`: whether the exchange's backward sums the ranks' gradients."""

    def __init__(self, cp_group=None, gather=True, sum_grads=True):
        super().__init__()
        torch.manual_seed(19)
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.out = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.cp_group, self.gather, self.sum_grads = cp_group, gather, sum_grads

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        q, k, v = self.q(h), self.k(h), self.v(h)
        if self.cp_group is not None and self.gather:
            k = GatherSequence.apply(k, self.cp_group, self.sum_grads)
            v = GatherSequence.apply(v, self.cp_group, self.sum_grads)
        weights = torch.softmax(q @ k.transpose(1, 2) / WIDTH ** 0.5, dim=-1)
        return self.head(h + self.out(weights @ v))


def batch(step):
    """The step's sequences, the same on every rank of a context-parallel group."""
    g = torch.Generator().manual_seed(900 + step)
    return (torch.randn(ROWS, SEQUENCE, FEATURES, generator=g),
            torch.randint(CLASSES, (ROWS, SEQUENCE), generator=g))


def train_cp(out, config, gather=True, sum_grads=True, report=None):
    """A context-parallel job of `Attention` at the world's size, recorded; `report(rec, loss,
    x, y, rank, world)` called before each `rec.step` (a case's logged metric)."""
    from common import STEPS, lockstep_probe, mean_over, start

    rank, world = start()
    model = Attention(dist.group.WORLD, gather=gather, sum_grads=sum_grads)
    opt = sgd(model.parameters())
    rec = lockstep_probe.Recorder(out / "run", model, name="attention", config=config,
                                  steps=STEPS, replicated_data=True)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = loss_fn(model, part(x, rank, world), part(y, rank, world))
        loss.backward()
        for p in model.parameters():
            mean_over(None, p.grad)
        if report is not None:
            report(rec, loss, x, y, rank, world)
        rec.step(loss, x, y)
        opt.step()
    rec.finish()
