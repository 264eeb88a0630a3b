"""NVIDIA/Megatron-LM #1464 (2025): the backward of context-parallel attention computed
wrong gradients for the keys and values (dK, dV) while the forward was right, so the loss
matched and the attention weights trained wrong.

Mechanism: every rank's queries attend to a rank's keys and values, so the gradient of a
part's keys and values is the sum of every rank's contribution and must be sent back to the
rank that holds the part; a hand-written backward that keeps only the local contribution
drops the others. `--bug` does that. The forward is untouched: the judge names the first
gradient that left its envelope at step 0, and the module whose backward went wrong.
"""

from attention import Attention, loss_fn, sgd, train_cp
from common import main

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at


def train(out, bug):
    train_cp(out, "cp2.ring", sum_grads=not bug)


if __name__ == "__main__":
    main(train, Attention, loss_fn, sgd)
