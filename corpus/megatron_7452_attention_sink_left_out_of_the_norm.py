"""NVIDIA/Megatron-LM #7452, finding 8 (2026-09; fix proposed in PR #7530): the learnable
attention-sink offset (`softmax_type="learnable"`) is sized by each rank's own heads, so it is
split over the tensor-parallel ranks, but it was never marked tensor-parallel. The gradient
norm counts a parameter not marked so on TP rank 0 only (as a duplicate elsewhere), so the
other ranks' sink gradients never reach the norm and gradient clipping is weakened.

Mechanism: a head-sharded parameter treated as a TP duplicate by the norm that clipping uses.
Written with DTensor's `parallelize_module` for the column- and row-parallel linears (one head
of 8 features per rank), the sink as a `Shard(0)` DTensor of one offset per head, and the norm
computed as Megatron computes it (local squares, duplicates on TP rank 0 only, summed over TP),
then every gradient clipped by it. The references clip with the true global norm. `--bug`
leaves the sink unmarked: the gradients recorded before clipping are right, and the update
after step 0 is not, so the judge names the first tensor that update left wrong, at step 1.
The sink stands in for attention's: each head's softmax over its features and its learnable
offset (its logit scaled by 8, so that its gradient is a visible share of the norm), the
offset's share dropped.
"""

import torch
import torch.distributed as dist
from torch import nn

from common import main, sgd, start, train_same_batch
from common import class_loss as loss_fn

WORLD = 2
EXPECT_STEP = 1  # clipping follows the record of step 0: its update shows at step 1
HEADS, HEAD_DIM = 2, 2
MAX_GRAD_NORM = 0.05  # below every step's norm: clipping always acts
SINK_SCALE = 8.0  # the offset's logit scale: its gradient a visible share of the norm


class HeadSink(nn.Module):
    """Each head's features through a softmax that also holds the head's learnable offset."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(HEADS))

    def forward(self, h):
        from torch.distributed.tensor import DTensor

        offset = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        heads = h.unflatten(-1, (-1, HEAD_DIM))
        sink = (SINK_SCALE * offset)[:, None].expand(*heads.shape[:-1], 1)
        weights = torch.softmax(torch.cat([heads, sink], -1), -1)[..., :HEAD_DIM]
        return (weights * heads).flatten(-2)


def build():
    torch.manual_seed(44)
    model = nn.Sequential(nn.Linear(8, HEADS * HEAD_DIM), HeadSink(),
                          nn.Linear(HEADS * HEAD_DIM, 8), nn.Tanh(), nn.Linear(8, 4))
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([0.0, 0.0]))
    return model


def megatron_norm(model, tp_rank, sink_marked):
    """The global gradient norm as Megatron computes it: each rank's local squares, a
    parameter not marked tensor-parallel counted on TP rank 0 only, summed over TP."""
    from torch.distributed.tensor import DTensor

    squares = torch.zeros(())
    for name, p in model.named_parameters():
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        split = isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)
        marked = split and (sink_marked or name != "1.weight")
        if marked or tp_rank == 0:
            squares += grad.pow(2).sum()
    dist.all_reduce(squares)
    return squares.sqrt()


def train(out, bug):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    rank, world = start()
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(build(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def heads_split(name, module, mesh):
        module.weight = nn.Parameter(distribute_tensor(module.weight.data, mesh, [Shard(0)]))

    distribute_module(model[1], mesh, heads_split)

    def clip(step):
        norm = megatron_norm(model, rank, sink_marked=not bug)
        scale = torch.clamp(MAX_GRAD_NORM / (norm + 1e-6), max=1.0)
        for p in model.parameters():
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grad.mul_(scale)

    train_same_batch(out, model, loss_fn, sgd, "sink", f"tp{world}", before_step=clip)


if __name__ == "__main__":
    main(train, build, loss_fn, sgd, max_grad_norm=MAX_GRAD_NORM)
