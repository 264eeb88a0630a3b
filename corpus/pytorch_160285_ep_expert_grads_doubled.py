"""pytorch/pytorch #160285 (2025-08): expert parallelism at 2 ranks gave expert gradients
exactly 2x the single-device ones, with loss curves identical.

Mechanism: a rank's backward through the expert-parallel exchange brings its expert the
gradient of every rank's loss summed, while the objective is their mean; the expert
gradients must be divided by the expert-parallel size, as the replicated weights'
gradients are averaged. `--bug` leaves the experts' gradients undivided: the loss of step 0
is right, every expert gradient is twice the truth.
"""

from common import main, mean_over
from moe import MoE, loss_fn, sgd, train_ep

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at
EXPECT_FIRST = 'experts'  # in the failure the judge names first


def train(out, bug):
    def reduce(name, p, world):
        if name != "experts":
            mean_over(None, p.grad)
        elif not bug:
            p.grad /= world  # the sum of every rank's loss, to their mean

    train_ep(out, "ep2", reduce)


if __name__ == "__main__":
    main(train, MoE, loss_fn, sgd)
