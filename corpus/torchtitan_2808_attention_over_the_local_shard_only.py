"""pytorch/torchtitan #2808 (2025): with context parallelism enabled, the inputs were sharded
by sequence but the context-parallel attention was never applied, so each rank attended over
its own part of the sequence only. The loss still fell.

Mechanism: under context parallelism a rank's queries must attend to every rank's keys and
values (gathered, or passed around a ring); attention over the local part alone is another
model. `--bug` skips the exchange. Hand-written context parallelism over `all_gather`
(corpus/attention.py).
"""

from attention import Attention, loss_fn, sgd, train_cp
from common import main

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at


def train(out, bug):
    train_cp(out, "cp2", gather=not bug)


if __name__ == "__main__":
    main(train, Attention, loss_fn, sgd)
