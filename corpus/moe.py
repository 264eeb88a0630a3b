"""A Mixture-of-Experts layer for the corpus's expert-parallel cases, written over
`all_gather` and `all_reduce` as hand-written expert parallelism is: one expert per rank of
the expert-parallel group, every rank's tokens gathered to every expert, each expert's
outputs summed back over the group, each rank keeping its own tokens' rows.

The single-device model is the same layer with every expert local. Under expert
parallelism a rank's backward brings each expert the gradient of the sum of every rank's
loss, while the objective is their mean: the experts' gradients must be divided by the
group's size, and the replicated weights' (embedding, router, head) averaged over it."""

import torch
import torch.distributed as dist
from torch import nn

from common import class_loss as loss_fn  # noqa: F401  (the cases import it from here)
from common import sgd as common_sgd

EXPERTS, FEATURES, CLASSES = 2, 8, 4


class GatherRows(torch.autograd.Function):
    """Every rank's rows of `x`, in rank order (an all-gather); backward: the gradient of each
    rank's rows summed over the group (every rank's experts used them), this rank's kept.
    Written here: `torch.distributed.nn.functional.all_gather`'s backward names its sources
    by group rank where it wants global ones, and fails on a sub-group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        rows = grad.shape[0] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * rows:(rank + 1) * rows], None


class SumOver(torch.autograd.Function):
    """`x` summed over the group (an all-reduce); backward: the gradient summed likewise."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class MoE(nn.Module):
    """Embedding, a top-1 router over `EXPERTS` experts (each a square matrix, stacked in one
    parameter), a classifier head. `ep_group`: the expert-parallel group, whose rank `r` holds
    expert `r` (the parameter then holds that expert alone); `None`: every expert here."""

    def __init__(self, ep_group=None):
        super().__init__()
        torch.manual_seed(7)
        self.embed = nn.Linear(FEATURES, FEATURES)
        self.router = nn.Linear(FEATURES, EXPERTS)
        self.experts = nn.Parameter(torch.randn(EXPERTS, FEATURES, FEATURES) / FEATURES ** 0.5)
        self.head = nn.Linear(FEATURES, CLASSES)
        self.ep_group = ep_group

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        if self.ep_group is None:
            return self.head(h + self._experts(h, torch.arange(EXPERTS), self.experts))
        group, rank = self.ep_group, dist.get_rank(self.ep_group)
        every = GatherRows.apply(h, group)  # every rank's tokens, in rank order
        local = self.experts.to_local() if hasattr(self.experts, "to_local") else self.experts
        mine = self._experts(every, torch.tensor([rank]), local)
        summed = SumOver.apply(mine, group)  # every expert's outputs, every token
        rows = h.shape[0]
        return self.head(h + summed[rank * rows:(rank + 1) * rows])

    def _experts(self, h, which, weights):
        """The experts `which` (with `weights`, one matrix each) applied to the tokens routed
        to them, scaled by their gate; zero for the other tokens."""
        gates = torch.softmax(self.router(h), dim=-1)
        choice = gates.argmax(dim=-1)
        out = torch.zeros_like(h)
        for e, w in zip(which.tolist(), weights):
            routed = (choice == e).unsqueeze(-1)
            out = out + routed * gates[:, e:e + 1] * torch.tanh(h @ w)
        return out


def shard_experts(model, mesh):
    """`model.experts` as a DTensor sharded over `mesh` (expert `r` on rank `r`), so the
    recorder gathers the whole stack."""
    from torch.distributed.tensor import Shard, distribute_tensor

    model.experts = nn.Parameter(distribute_tensor(model.experts.data, mesh, [Shard(0)]))
    return model


def sgd(params):
    return common_sgd(params, lr=0.2)


def train_ep(out, config, reduce, before_update=None):
    """An expert-parallel job of `MoE` at the world's size (one expert per rank), recorded:
    `reduce(name, p, world)` reduces each parameter's gradient between backward and
    `rec.step` (the case's reduction, right or planted); `before_update(model, group)` runs
    between `rec.step` and the update (clipping)."""
    from torch.distributed.device_mesh import init_device_mesh

    from common import STEPS, batch, lockstep_probe, start

    rank, world = start()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    model = shard_experts(MoE(mesh.get_group()), mesh)
    opt = sgd(model.parameters())
    rec = lockstep_probe.Recorder(out / "run", model, name="moe", config=config, steps=STEPS)
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        for name, p in model.named_parameters():
            reduce(name, p, world)
        rec.step(loss, x, y)
        if before_update is not None:
            before_update(model, mesh.get_group())
        opt.step()
    rec.finish()
