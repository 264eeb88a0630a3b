"""huggingface/transformers #48687 (2026-09): under expert parallelism with
`experts_implementation="batched_mm"`, the router got the wrong gradient while the loss was
right: the routing weights of the experts another rank holds were zeroed on each rank, so
each rank's router gradient was a partial sum over its own experts, and it was never summed
over the expert-parallel ranks. Reproduced by its reporter on CPU with gloo too.

Mechanism: a replicated router scoring experts that live on other ranks gets, on each rank,
the gradient through its own experts only; the ranks' partial gradients must be summed (and
divided as the objective's mean over the ranks requires), like every replicated weight's.
`--bug` leaves the router's gradient as each rank computed it. Hand-written expert
parallelism over `all_gather`/`all_reduce` (corpus/moe.py), at EP 2.
"""

from common import main, mean_over
from moe import MoE, loss_fn, sgd, train_ep

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at
EXPECT_FIRST = 'router'  # in the failure the judge names first


def train(out, bug):
    def reduce(name, p, world):
        if name == "experts":
            p.grad /= world
        elif not (bug and name.startswith("router.")):
            mean_over(None, p.grad)

    train_ep(out, "ep2", reduce)


if __name__ == "__main__":
    main(train, MoE, loss_fn, sgd)
