"""NVIDIA/Megatron-LM PR #5956 (2025): expert gradients not divided by the expert-parallel
size, so under EP x DP every expert trained with a gradient EP times too large.

Mechanism: on a (dp, ep) mesh the experts are sharded over `ep` and replicated over `dp`;
their gradients must be averaged over `dp` (the expert-data-parallel group) and divided by
the `ep` size (each expert receives every `ep` rank's tokens' gradients summed), while the
replicated weights are averaged over every rank. `--bug` averages the experts over `dp`
only: every expert gradient is twice the truth from step 0, at world 4.
"""

from common import STEPS, batch, lockstep_probe, main, mean_over, start
from moe import MoE, loss_fn, sgd

WORLD = 4
EXPECT_STEP = 0  # the step the judge first sees the bug at
EXPECT_FIRST = 'experts'  # in the failure the judge names first


def train(out, bug):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank, world = start()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep"))
    model = MoE(mesh["ep"].get_group())
    model.experts = nn.Parameter(distribute_tensor(model.experts.data, mesh,
                                                   [Replicate(), Shard(0)]))
    opt = sgd(model.parameters())
    rec = lockstep_probe.Recorder(out / "run", model, name="moe", config="dp2.ep2", steps=STEPS)
    dp, ep_size = mesh["dp"].get_group(), mesh["ep"].size()
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        for name, p in model.named_parameters():
            if name == "experts":
                local = p.grad._local_tensor
                mean_over(dp, local)  # the expert-data-parallel mean
                if not bug:
                    local /= ep_size  # each expert got every ep rank's tokens, summed
            else:
                mean_over(None, p.grad)
        rec.step(loss, x, y)
        opt.step()
    rec.finish()


if __name__ == "__main__":
    main(train, MoE, loss_fn, sgd)
