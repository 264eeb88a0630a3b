"""NVIDIA-NeMo/Automodel #3530 (2025): gradient accumulation zeroed the gradients between
micro-batches, so only the last micro-batch's gradients survived; the loss looked right.

Mechanism: under FSDP2 with accumulation, `zero_grad` belongs before the step's first
micro-batch only. The job is `examples/torch_fsdp2.py` (FSDP2, two micro-batches a step),
whose `--bug accumulation-zeroes` zeroes between them.
"""

from common import run_example

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at

if __name__ == "__main__":
    run_example("torch_fsdp2.py", "accumulation-zeroes")
