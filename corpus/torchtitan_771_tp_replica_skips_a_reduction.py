"""pytorch/torchtitan #771 and NVIDIA/Megatron-LM #7452 (2025): under tensor parallelism a
replicated parameter's gradient missed its reduction on one rank, so that rank's copy drifted
from the others' while rank 0's numbers looked right.

Mechanism: a parameter replicated over the TP ranks (a row-parallel layer's bias) has a
partial gradient on each rank that must be all-reduced; one rank left without it steps with
half its gradient. The job is `examples/torch_tp.py` (DTensor `parallelize_module`,
`loss_parallel`), whose `--bug replica-skips-reduce` halves one rank's gradient at step 1.
The recorder's copy check names the parameter and the ranks on each side after that step.
"""

from common import run_example

WORLD = 2
EXPECT_STEP = 1  # the step the judge first sees the bug at

if __name__ == "__main__":
    run_example("torch_tp.py", "replica-skips-reduce")
