"""pytorch/torchtitan #2972 (2025): under pipeline parallelism each microbatch's mean loss
was summed over the microbatches rather than averaged, so the gradients were about as many
times too large as there are microbatches, which the loss of the first step did not show.

Mechanism: the schedule's loss is per microbatch; the step's objective is their mean
(`scale_grads=True`, or each microbatch's loss divided by their count). The job is
`examples/torch_pipeline.py` (`torch.distributed.pipelining`, GPipe, two stages), whose
`--bug unscaled-grads` sums them.
"""

from common import run_example

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at

if __name__ == "__main__":
    run_example("torch_pipeline.py", "unscaled-grads")
