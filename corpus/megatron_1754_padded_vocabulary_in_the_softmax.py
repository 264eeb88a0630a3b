"""NVIDIA/Megatron-LM #1754 (2025): with tensor parallelism and a vocabulary not divisible by
the TP size, the output layer is padded to a multiple of it, and the padded rows' logits
entered the softmax, so the loss and every gradient were off.

Mechanism: the column-parallel output layer holds `VOCAB` rounded up to the TP size; the
padded logits are not tokens and must be left out of the cross-entropy. `--bug` computes the
cross-entropy over every logit, padding included. Written with DTensor's
`parallelize_module` (column-parallel, row-parallel, and the padded column-parallel head).
"""

import torch
from torch import nn

from common import main, start, train_same_batch

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at
VOCAB, PADDED = 9, 10  # 9 classes, padded to a multiple of the TP size


def build():
    torch.manual_seed(13)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(),
                         nn.Linear(8, PADDED))


def logits_of(model, x):
    out = model(x)
    return out.full_tensor() if hasattr(out, "full_tensor") else out


def loss_fn(model, x, y):
    """The cross-entropy over the vocabulary's real logits."""
    return nn.functional.cross_entropy(logits_of(model, x)[:, :VOCAB], y)


def padded_loss(model, x, y):
    """The bug: the cross-entropy over every logit, padding included."""
    return nn.functional.cross_entropy(logits_of(model, x), y)


def sgd(params):
    return torch.optim.SGD(params, lr=0.2)


def train(out, bug):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    rank, world = start()
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(build(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                               "4": ColwiseParallel(use_local_output=False)})
    train_same_batch(out, model, padded_loss if bug else loss_fn, sgd, "lm", f"tp{world}.padded",
                     classes=VOCAB)


if __name__ == "__main__":
    main(train, build, loss_fn, sgd)
