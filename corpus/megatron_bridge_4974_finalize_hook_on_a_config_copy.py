"""NVIDIA-NeMo/Megatron-Bridge PR #4974 (2025): the hook that finalizes the gradients
(their division by the step's token count) was installed on a deep copy of the training
config, so the loop never called it and the gradients went unnormalised (PP 1, CP 2).

Mechanism: under context parallelism with per-token losses, each rank backpropagates its
tokens' summed loss, the ranks' gradients are summed, and a finalize step divides them by
the step's tokens over every rank. The loop calls the hook its config holds. `--bug` installs
the hook on `copy.deepcopy(config)`: the gradients stay summed over every token, the reported
loss (computed apart, as the job logs it) stays right. Simplified as corpus/sequence.py says.
"""

import copy
from types import SimpleNamespace

import torch.distributed as dist

from common import STEPS, lockstep_probe, main, start
from sequence import batch, build, loss_fn, part, sgd
from torch import nn

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at


def install_finalize(config, model, tokens):
    """The job's finalize step: every gradient divided by the step's tokens over the ranks."""
    def finalize():
        for p in model.parameters():
            p.grad /= tokens
    config.finalize_grads = finalize


def train(out, bug):
    rank, world = start()
    model = build()
    opt = sgd(model.parameters())
    config = SimpleNamespace(finalize_grads=None)
    x0, _ = batch(0)
    tokens = x0.shape[0] * x0.shape[1]  # the step's tokens over every rank
    install_finalize(copy.deepcopy(config) if bug else config, model, tokens)
    rec = lockstep_probe.Recorder(out / "run", model, name="tokens", config=f"cp{world}",
                                  steps=STEPS, replicated_data=True, loss_reduction="sum")
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        logits = model(part(x, rank, world))
        summed = nn.functional.cross_entropy(logits.flatten(0, 1), part(y, rank, world).flatten(),
                                             reduction="sum")
        summed.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # summed over the ranks' tokens
        if config.finalize_grads is not None:
            config.finalize_grads()
        rec.step(summed.detach() / tokens, x, y)  # this rank's share of the step's mean
        opt.step()
    rec.finish()


if __name__ == "__main__":
    main(train, build, loss_fn, sgd)
