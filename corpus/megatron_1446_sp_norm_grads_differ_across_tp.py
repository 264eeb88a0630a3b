"""NVIDIA/Megatron-LM #1446 (2025-03): with tensor and sequence parallelism, the final
LayerNorm's gradients differed across the tensor-parallel ranks before the optimizer step.

Mechanism: under sequence parallelism each rank normalizes its own part of the sequence with
replicated weights, so its gradient of them is a partial sum over its tokens, to be summed
over the TP ranks. `--bug` leaves the norm out of the TP plan (a plain module on the local
part): its partial gradients are never summed. Written with DTensor's `parallelize_module`
(corpus/tp_sp.py).
"""

from common import main, sgd
from common import token_loss as loss_fn
from tp_sp import build, train_tp_sp

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at


def train(out, bug):
    train_tp_sp(out, "tp2.sp", norm_in_plan=not bug)


if __name__ == "__main__":
    main(train, build, loss_fn, sgd)
