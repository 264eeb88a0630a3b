"""NVIDIA/Megatron-LM #7452, finding 03 (2026-09): the multi-token-prediction loss was
normalised per token with each data-parallel rank's own valid-token count, while the main
loss used the count over every rank, so with uneven valid tokens across ranks the MTP
gradient was off (14/3 where the global per-token reference gives 4, at 4 ranks).

Mechanism: every per-token loss of a step must be divided by the valid tokens of every rank
(summed with an all-reduce) when the ranks' gradients are summed. `--bug` divides the MTP
head's loss by the rank's own count. A token-wise model with a main head and an MTP head
(predicting another label of each token), padded tokens uneven across 4 ranks
(corpus/padded.py).
"""

import torch
import torch.distributed as dist
from torch import nn

from common import STEPS, lockstep_probe, main, sgd, start
from padded import CLASSES, PADDING, batch, global_valid, valid

WORLD = 4
EXPECT_STEP = 0  # the step the judge first sees the bug at
EXPECT_FIRST = 'mtp_head'  # in the failure the judge names first


class WithMtp(nn.Module):
    """A token-wise body, a main head and a multi-token-prediction head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(53)
        self.body = nn.Sequential(nn.Linear(6, 12), nn.GELU())
        self.main_head, self.mtp_head = nn.Linear(12, CLASSES), nn.Linear(12, CLASSES)

    def forward(self, x):
        h = self.body(x)
        return self.main_head(h), self.mtp_head(h)


def sums(model, x, y):
    """The main and MTP heads' summed losses over the valid tokens (the MTP head predicts the
    label rolled by one within each sequence, padding kept where it is)."""
    main_logits, mtp_logits = model(x)
    mtp_labels = torch.where(y == PADDING, y, y.roll(1, dims=1).clamp(min=0))
    ce = lambda logits, labels: nn.functional.cross_entropy(  # noqa: E731
        logits.flatten(0, 1), labels.flatten(), ignore_index=PADDING, reduction="sum")
    return ce(main_logits, y), ce(mtp_logits, mtp_labels)


def reference_loss(model, x, y):
    """A rank's loss whose mean over the ranks is the step's per-token loss of both heads."""
    main_sum, mtp_sum = sums(model, x, y)
    return (main_sum + mtp_sum) * WORLD / global_valid(WORLD)


def train(out, bug):
    rank, world = start()
    model = WithMtp()
    opt = sgd(model.parameters())
    rec = lockstep_probe.Recorder(out / "run", model, name="mtp", config=f"dp{world}.mtp",
                                  steps=STEPS, loss_reduction="sum")
    for step in range(STEPS):
        x, y = batch(step, rank)
        counts = torch.tensor([valid(y)])
        dist.all_reduce(counts)
        total = int(counts)
        opt.zero_grad()
        main_sum, mtp_sum = sums(model, x, y)
        loss = main_sum / total + mtp_sum / (valid(y) if bug else total)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # summed: each rank's loss is its share
        rec.step(loss, x, y)
        opt.step()
    rec.finish()


if __name__ == "__main__":
    main(train, WithMtp, reference_loss, sgd)
