"""NVIDIA/Megatron-LM #7452, finding 11 (2026-09): GatedDeltaNet's output norm has one weight
shared by every head and replicated over the tensor-parallel ranks, while each rank applies it
to its own heads, so each rank's gradient of it is a partial sum; the gradient finalizer
summed it over TP only when sequence parallelism was on.

Mechanism: a replicated weight applied to a TP-split activation gets a partial gradient on
each rank, to be summed over TP whatever the sequence layout. `--bug` sums it only under
sequence parallelism (off here). Written with DTensor's `parallelize_module` for the
column- and row-parallel linears (one head of 8 features per rank) and the shared per-head
RMS norm in between, applied to each rank's local head.
"""

import torch
import torch.distributed as dist
from torch import nn

from common import main, sgd, start, train_same_batch
from common import class_loss as loss_fn

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at
HEADS, HEAD_DIM = 2, 8


class HeadNorm(nn.Module):
    """An RMS norm over each head's features with one weight shared by every head."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HEAD_DIM))

    def forward(self, h):
        heads = h.unflatten(-1, (-1, HEAD_DIM))
        normed = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * self.weight).flatten(-2)


def build():
    torch.manual_seed(43)
    return nn.Sequential(nn.Linear(8, HEADS * HEAD_DIM), HeadNorm(), nn.Linear(HEADS * HEAD_DIM, 8),
                         nn.Tanh(), nn.Linear(8, 4))


def train(out, bug):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    rank, world = start()
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(build(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    sequence_parallel = False

    def finalize(step):
        # The finalizer: the shared norm's partial gradients summed over TP.
        if sequence_parallel or not bug:
            dist.all_reduce(model[1].weight.grad)

    train_same_batch(out, model, loss_fn, sgd, "gdn", f"tp{world}", before_record=finalize)


if __name__ == "__main__":
    main(train, build, loss_fn, sgd)
