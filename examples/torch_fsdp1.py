"""A PyTorch job on the first FSDP (`FullyShardedDataParallel`) judged by Lockstep
(docs/judge.md).

    # the job, under torchrun (gloo on the CPU; NCCL works the same on GPUs)
    python3 -m torch.distributed.run --nproc-per-node 2 examples/torch_fsdp1.py train OUT
    # its single-device references from the same start and batches (one process)
    python3 examples/torch_fsdp1.py reference OUT
    # the verdict
    lockstep judge --run OUT/run --reference OUT/reference --shadow OUT/shadow --out OUT/report

Each linear layer is an FSDP unit (`ModuleWrapPolicy`), FULL_SHARD, `use_orig_params=True`
(the recorder reads whole gradients through `summon_full_params(with_grads=True)`, which needs
it). The job clips its gradients to a global norm of 0.5 with FSDP's own
`model.clip_grad_norm_`, and the references clip theirs the same (`max_grad_norm`).

`--precision bf16` trains under FSDP's `MixedPrecision(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)`, its references in the same precision.

`--bug local-clip` plants the classic FSDP1 pitfall: `torch.nn.utils.clip_grad_norm_` on the
wrapped model's parameters, which are each rank's flat shards. Every rank computes the norm
of its own shard only and scales by its own factor, so the update is wrong while the loss
looks as plausible as a correct run's.

`--hybrid` (an even world of at least 4) uses HYBRID_SHARD on a replicate x shard mesh: each
parameter is sharded over pairs of ranks, and the pairs are replicas whose flat shards must
stay bit-identical. `--bug replica-shard-drifts` halves the last rank's shard of one gradient
at step 1: every full tensor rank 0 gathers (from its own replica) looks right, and the
recorder's copy check names the tensor and the ranks on each side.

The three lines that hand the job to Lockstep are marked `# lockstep`.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import lockstep_probe  # noqa: E402

STEPS = 5
SEED = 13
MAX_GRAD_NORM = 0.5
PRECISIONS = {"bf16": torch.bfloat16}


def build_model():
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Linear(8, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
        nn.Linear(32, 4),
    )


def batch(rank, step):
    """Rank `rank`'s batch at `step`: the same on every run."""
    g = torch.Generator().manual_seed(SEED * 10_000 + step * 100 + rank)
    return torch.randn(8, 8, generator=g), 2 * torch.randn(8, 4, generator=g)


def loss_fn(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train(out, bug, precision, hybrid=False):
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    # `--precision bf16`: bf16 compute, fp32 gradient reduction and optimizer.
    narrow = PRECISIONS.get(precision)
    policy = MixedPrecision(param_dtype=narrow, reduce_dtype=torch.float32) if narrow else None

    with lockstep_probe.deterministic("cpu"):
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        if hybrid:
            # HYBRID_SHARD: each parameter sharded over pairs of ranks, the pairs replicas.
            from torch.distributed.device_mesh import init_device_mesh

            if world < 4 or world % 2:
                sys.exit(f"--hybrid needs an even world of at least 4 ranks, not {world}")
            placement = dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                             device_mesh=init_device_mesh("cpu", (world // 2, 2),
                                                          mesh_dim_names=("replicate", "shard")))
        else:
            placement = dict(sharding_strategy=ShardingStrategy.FULL_SHARD)
        model = FullyShardedDataParallel(
            build_model(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True,
            mixed_precision=policy, device_id=torch.device("cpu"), **placement)
        config = f"fsdp1.hybrid{world // 2}x2" if hybrid else "fsdp1"
        opt = optimizer(model.parameters())
        rec = lockstep_probe.Recorder(Path(out) / "run", model, name="mlp",  # lockstep
                                      config=f"{config}.{precision}" if precision else config,
                                      seed=SEED, steps=STEPS)
        for step in range(STEPS):
            x, y = batch(rank, step)
            opt.zero_grad()
            loss = loss_fn(model, x, y)
            loss.backward()
            if bug == "replica-shard-drifts" and rank == world - 1 and step == 1:
                # The bug: one replica's copy of its flat shard of one gradient is halved.
                next(p for p in model.parameters() if p.grad is not None and p.numel()).grad.mul_(0.5)
            rec.step(loss, x, y)  # lockstep
            if bug == "local-clip":
                # The bug: each rank's norm is its own shard's.
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            else:
                model.clip_grad_norm_(MAX_GRAD_NORM)
            opt.step()
        rec.finish()  # lockstep
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "reference"])
    parser.add_argument("out")
    parser.add_argument("--bug", choices=["local-clip", "replica-shard-drifts"])
    parser.add_argument("--hybrid", action="store_true",
                        help="HYBRID_SHARD on a 2-D mesh (an even world of at least 4)")
    parser.add_argument("--precision", choices=["bf16"])
    args = parser.parse_args()
    if args.mode == "train":
        train(args.out, args.bug, args.precision, args.hybrid)
    else:
        lockstep_probe.train_references(build_model, loss_fn, optimizer, Path(args.out) / "run",
                                        args.out, max_grad_norm=MAX_GRAD_NORM,
                                        param_dtype=PRECISIONS.get(args.precision))


if __name__ == "__main__":
    main()
