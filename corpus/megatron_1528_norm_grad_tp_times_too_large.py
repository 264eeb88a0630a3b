"""NVIDIA/Megatron-LM #1528 (2025-04): with tensor and context parallelism, the LayerNorm
weight's gradient came out TP-size times the single-device one: it was summed over the
tensor-parallel ranks once more after it was already whole.

Mechanism: a replicated weight's gradient is summed over the TP ranks exactly once
(DTensor's `SequenceParallel()` style does it in backward); a finalizer that all-reduces it
again multiplies it by the TP size. `--bug` adds that second sum. Written with DTensor's
`parallelize_module` (corpus/tp_sp.py).
"""

import torch.distributed as dist

from common import main, sgd
from common import token_loss as loss_fn
from tp_sp import build, train_tp_sp

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at
EXPECT_FIRST = 'gradient'  # in the failure the judge names first


def sum_norm_grads_again(model, mesh):
    for p in model[0].parameters():
        dist.all_reduce(p.grad._local_tensor, group=mesh.get_group())


def train(out, bug):
    train_tp_sp(out, "tp2.sp", after_backward=sum_norm_grads_again if bug else None)


if __name__ == "__main__":
    main(train, build, loss_fn, sgd)
