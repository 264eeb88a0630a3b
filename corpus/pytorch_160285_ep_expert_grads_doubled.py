"""pytorch/pytorch #160285 (2025-08): expert parallelism at 2 ranks gave expert gradients
exactly 2x the single-device ones, with loss curves identical.

Mechanism: a rank's backward through the expert-parallel exchange brings its expert the
gradient of every rank's loss summed, while the objective is their mean; the expert
gradients must be divided by the expert-parallel size, as the replicated weights'
gradients are averaged. `--bug` leaves the experts' gradients undivided: the loss of step 0
is right, every expert gradient is twice the truth.
"""

from common import STEPS, batch, lockstep_probe, main, mean_over, start
from moe import MoE, loss_fn, sgd, shard_experts

WORLD = 2
EXPECT_STEP = 0  # the step the judge first sees the bug at
EXPECT_FIRST = 'experts'  # in the failure the judge names first


def train(out, bug):
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = start()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    model = shard_experts(MoE(mesh.get_group()), mesh)
    opt = sgd(model.parameters())
    rec = lockstep_probe.Recorder(out / "run", model, name="moe", config=f"ep{world}", steps=STEPS)
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        for name, p in model.named_parameters():
            if name == "experts":
                if not bug:
                    p.grad /= world  # the sum of every rank's loss, to their mean
            else:
                mean_over(None, p.grad)
        rec.step(loss, x, y)
        opt.step()
    rec.finish()


if __name__ == "__main__":
    main(train, MoE, loss_fn, sgd)
