"""pytorch/torchtitan PR #4054 (2025): MoE under tensor parallelism without expert
parallelism computed its router with `local_map`, whose input-gradient placements defaulted
to `Replicate`, so the tensor-parallel all-reduce of the router's gradient (each rank's being
a partial sum) was skipped: every rank stepped with its own partial gradient.

Mechanism: a replicated weight applied to a TP-sharded activation inside `local_map` gets a
partial gradient on each rank; `in_grad_placements` must say `Partial()` so DTensor sums it.
`--bug` leaves the default. Written with DTensor: `parallelize_module` (column- and
row-parallel linears) and `local_map` for the router.
"""

import torch
import torch.distributed as dist
from torch import nn

from common import main, sgd, start, train_same_batch
from common import class_loss as loss_fn

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at


class RoutedMLP(nn.Module):
    """A column-parallel and a row-parallel linear, and a router reading the hidden
    activation (its scores added to the head's logits). `mesh`: the TP mesh (the router then
    runs under `local_map` on each rank's slice of the activation); `grad_partial`: whether
    its weight's gradient is declared a partial sum."""

    def __init__(self, mesh=None, grad_partial=True):
        super().__init__()
        torch.manual_seed(31)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.router = nn.Parameter(torch.randn(16, 4) / 4)
        self.head = nn.Linear(8, 4)
        self.mesh, self.grad_partial = mesh, grad_partial

    def forward(self, x):
        h = torch.tanh(self.up(x))
        return self.head(torch.tanh(self.down(h))) + self._route(h)

    def _route(self, h):
        if self.mesh is None:
            return h @ self.router
        from torch.distributed.tensor import Partial, Replicate, Shard
        from torch.distributed.tensor.experimental import local_map

        def scores(h_local, router):
            width = h_local.shape[-1]
            rank = dist.get_rank()
            return h_local @ router[rank * width:(rank + 1) * width]

        router_grad = Partial() if self.grad_partial else Replicate()
        routed = local_map(scores, out_placements=[Partial()],
                           in_placements=([Shard(1)], [Replicate()]),
                           in_grad_placements=([Shard(1)], [router_grad]),
                           device_mesh=self.mesh)
        return routed(h, self.router).full_tensor()


def train(out, bug):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    rank, world = start()
    mesh = init_device_mesh("cpu", (world,))
    model = RoutedMLP(mesh, grad_partial=not bug)
    model.router = nn.Parameter(distribute_tensor(model.router.data, mesh, [Replicate()]))
    parallelize_module(model, mesh, {"up": ColwiseParallel(use_local_output=False),
                                     "down": RowwiseParallel(input_layouts=None)})
    train_same_batch(out, model, loss_fn, sgd, "routed", f"tp{world}")


if __name__ == "__main__":
    main(train, RoutedMLP, loss_fn, sgd)
