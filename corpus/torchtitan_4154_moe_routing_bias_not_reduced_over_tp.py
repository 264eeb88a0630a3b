"""pytorch/torchtitan PR #4154 (2026): MoE under tensor (and sequence) parallelism updated its
load-balancing routing bias from each rank's own token counts, not summed over the
tensor-parallel ranks, so the ranks' routing biases parted and each routed by its own.

Mechanism: with auxiliary-loss-free load balancing the router adds a bias per expert, moved
before each optimizer step towards the experts that received fewer tokens; under sequence
parallelism each TP rank routes its own part of the sequence, so the tokens each expert
received must be summed over the TP ranks before the update. `--bug` uses the local counts.
The bias is state the forward keeps between steps, not a parameter: step 0 is right and the
judge names the first tensor the parted bias changed, at step 1. The ranks share
their weights and each routes its part of every sequence; all experts on every rank.
"""

import torch
import torch.distributed as dist
from torch import nn

from common import STEPS, lockstep_probe, main, mean_over, start
from common import token_loss as loss_fn

WORLD = 2
EXPECT_STEP = 1  # the step the judge first sees the bug at
FEATURES, WIDTH, EXPERTS, CLASSES, SEQUENCE, ROWS = 6, 8, 4, 5, 8, 2
BIAS_RATE = 0.5
MODELS = []  # the models built, for the optimizer's bias update


class BalancedMoE(nn.Module):
    """Embedding, a top-1 router whose choice adds a load-balancing bias, `EXPERTS` experts,
    a classifier per token. The router's choices are counted per expert while training."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(47)
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.Parameter(torch.randn(EXPERTS, WIDTH, WIDTH) / WIDTH ** 0.5)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.register_buffer("expert_bias", torch.zeros(EXPERTS))
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS), persistent=False)
        MODELS.append(self)

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        scores = self.router(h)
        choice = (scores + self.expert_bias).argmax(dim=-1)
        if torch.is_grad_enabled():
            with torch.no_grad():
                self.tokens_per_expert += torch.bincount(choice.flatten(), minlength=EXPERTS)
        gate = torch.softmax(scores, dim=-1).gather(-1, choice.unsqueeze(-1))
        expert_out = torch.einsum("bsd,bsde->bse", h, self.experts[choice])
        return self.head(h + gate * torch.tanh(expert_out))


def update_bias(model, group=None, local_only=False):
    """The load-balancing update: each expert's bias moved towards the experts that received
    fewer tokens than the mean, from the counts summed over `group` (`local_only`: not)."""
    counts = model.tokens_per_expert.clone()
    if group is not None and not local_only:
        dist.all_reduce(counts, group=group)
    with torch.no_grad():
        model.expert_bias += BIAS_RATE * torch.sign(counts.mean() - counts)
        model.tokens_per_expert.zero_()


def sgd(params):
    """The optimizer, the bias updated before each of its steps (as torchtitan registers it)."""
    opt = torch.optim.SGD(params, lr=0.3)
    model = MODELS[-1]
    opt.register_step_pre_hook(lambda *_: update_bias(model))
    return opt


def batch(step):
    g = torch.Generator().manual_seed(800 + step)
    return (torch.randn(ROWS, SEQUENCE, FEATURES, generator=g),
            torch.randint(CLASSES, (ROWS, SEQUENCE), generator=g))


def train(out, bug):
    rank, world = start()
    model = BalancedMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    opt.register_step_pre_hook(lambda *_: update_bias(model, dist.group.WORLD, bug))
    rec = lockstep_probe.Recorder(out / "run", model, name="moe", config=f"tp{world}.sp",
                                  steps=STEPS, replicated_data=True)
    size = SEQUENCE // world
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        part = slice(rank * size, (rank + 1) * size)
        loss = loss_fn(model, x[:, part], y[:, part])
        loss.backward()
        for p in model.parameters():
            mean_over(None, p.grad)
        rec.step(loss, x, y)
        opt.step()
    rec.finish()


if __name__ == "__main__":
    main(train, BalancedMoE, loss_fn, sgd)
