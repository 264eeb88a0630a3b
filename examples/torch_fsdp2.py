"""A PyTorch FSDP2 training job judged by Lockstep (docs/judge.md).

    # the job, under torchrun (gloo on the CPU; NCCL works the same on GPUs)
    python3 -m torch.distributed.run --nproc-per-node 2 examples/torch_fsdp2.py train OUT
    # its single-device references from the same start and batches (one process)
    python3 examples/torch_fsdp2.py reference OUT
    # the verdict
    lockstep judge --run OUT/run --reference OUT/reference --shadow OUT/shadow --out OUT/report

`--device cuda` runs it on GPUs (NCCL, one GPU per rank) under Lockstep's determinism
settings, and trains the reference on a GPU and the float64 shadow on the CPU.

`bench OUT` times the steps with the recorder (`bench none`: without it), and the time inside
`rec.step` and `finish()`, for its overhead (`ci/bench-recorder` runs several launches of
each); `--steps N` trains N steps, `--every k` records the full gradients every k-th step.

`--bug accumulation-zeroes` plants a bug of the kind NeMo Automodel#3530 reported: gradient
accumulation over two microbatches that zeroes the gradients between them, so only the
second microbatch's survives; the loss still looks plausible. `--accumulate 2` is the same
accumulation done right (it must pass).

`--mesh hsdp` (an even world of at least 4) shards each parameter over pairs of ranks and
replicates the shards across the pairs (HSDP: a 2-D mesh, replicate x shard). Each
replicate group's copies of a shard must stay bit-identical; `--bug replica-shard-drifts`
plants a bug that gathering full tensors cannot see: the last rank's shard of one gradient is
halved, so its copy drifts from its replica's while every full tensor rank 0 gathers (from
its own replica) looks right. The recorder compares the copies and names the tensor.

`--bug same-batch-everywhere` gives every rank rank 0's batch (a data loader without a
`DistributedSampler`), and `--bug loader-stuck` repeats each rank's batch of step 1 from then
on: the numbers of both match their references (trained on the same wrong data), and the
recorder's data checks fail them with their own finding.

`--precision bf16` trains under FSDP2's `MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)`, its references in the same precision; `--bug
bf16-master-weights` then keeps the parameters themselves in bf16 (no fp32 master weights).
`--compile` compiles each layer in place before the linear ones are sharded, as torchtitan
does its blocks (the recorder drops the compiled modules' `_orig_mod` from the names).

The three lines that hand the job to Lockstep are marked `# lockstep`.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import lockstep_probe  # noqa: E402

STEPS = 5
SEED = 7
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
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def loss_fn(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def device_mesh(kind, world, device):
    """FSDP's 1-D mesh, or HSDP's 2-D one (replicate x shard pairs); its config name."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "fsdp":
        return init_device_mesh(device.type, (world,)), "fsdp2"
    if world < 4 or world % 2:
        sys.exit(f"--mesh hsdp needs an even world of at least 4 ranks, not {world}")
    mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    return mesh, f"hsdp{world // 2}x2"


def train(args, record=True):
    """The job under `args`' options; the seconds of each step, of each `rec.step` in it
    and of `finish()`."""
    with lockstep_probe.deterministic(args.device):
        return train_deterministically(args, record)


def train_deterministically(args, record):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    bug, accumulate = args.bug, args.accumulate
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model().to(device)
    if bug == "bf16-master-weights":
        model.to(torch.bfloat16)  # the bug: as loaded with torch_dtype=bfloat16; no fp32 master
    mesh, config = device_mesh(args.mesh, world, device)
    # bf16 compute, fp32 gradient reduction and optimizer (`--precision bf16`).
    policy = MixedPrecisionPolicy(param_dtype=PRECISIONS.get(args.precision),
                                  reduce_dtype=torch.float32)
    for i, layer in enumerate(model):
        if args.compile:
            # Each layer compiled in place, the linear ones then sharded, as torchtitan
            # compiles its blocks before sharding them.
            model[i] = torch.compile(layer)
        if isinstance(layer, nn.Linear):
            fully_shard(model[i], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = optimizer(model.parameters())
    config += ".compiled" if args.compile else ""
    config += f".{args.precision}" if args.precision else ""
    rec = lockstep_probe.Recorder(Path(args.out) / "run", model, name="mlp",  # lockstep
                                  config=config, seed=SEED, steps=args.steps,
                                  every=args.every,
                                  activations=args.activations) if record else None
    step_seconds, recorder_seconds = [], []
    for step in range(args.steps):
        started = time.perf_counter()
        if bug == "same-batch-everywhere":
            x, y = batch(0, step)  # the bug: no DistributedSampler; every rank reads rank 0's
        elif bug == "loader-stuck":
            x, y = batch(rank, min(step, 1))  # the bug: the loader stops advancing at step 1
        else:
            x, y = batch(rank, step)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        if accumulate == 1:
            loss = loss_fn(model, x, y)
            loss.backward()
        else:
            losses = []
            for mx, my in zip(x.chunk(accumulate), y.chunk(accumulate)):
                if bug == "accumulation-zeroes":
                    opt.zero_grad()  # the bug: the earlier microbatches' gradients are lost
                part = loss_fn(model, mx, my) / accumulate
                part.backward()
                losses.append(part.detach())
            loss = sum(losses)
        if bug == "replica-shard-drifts" and rank == world - 1 and step == 1:
            model[0].weight.grad.to_local().mul_(0.5)  # the bug: one copy of one shard
        if rec:
            inside = time.perf_counter()
            rec.step(loss, x, y)  # lockstep
            recorder_seconds.append(time.perf_counter() - inside)
        opt.step()
        dist.barrier()  # a step ends when every rank's has
        step_seconds.append(time.perf_counter() - started)
    started = time.perf_counter()
    if rec:
        rec.finish()  # lockstep
    finish_seconds = time.perf_counter() - started
    dist.destroy_process_group()
    return step_seconds, recorder_seconds, finish_seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "reference", "bench"])
    parser.add_argument("out")
    parser.add_argument("--bug", choices=["accumulation-zeroes", "replica-shard-drifts",
                                          "bf16-master-weights", "same-batch-everywhere",
                                          "loader-stuck"])
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--mesh", choices=["fsdp", "hsdp"], default="fsdp")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["bf16"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--steps", type=int, default=STEPS,
                        help="steps to train (the references read the run's count)")
    parser.add_argument("--every", type=int, default=1,
                        help="record the full gradients every k-th step (Recorder(every=k))")
    parser.add_argument("--activations", type=lambda v: [int(s) for s in v.split(",") if s],
                        help="the steps whose module outputs are recorded, e.g. 0,3 or '' "
                             "for none (the recorder's default: the first 16)")
    args = parser.parse_args()
    if args.bug == "accumulation-zeroes" and args.accumulate == 1:
        args.accumulate = 2
    if args.mode == "train":
        train(args)
    elif args.mode == "bench":
        record = args.out != "none"
        steps, inside, finish = train(args, record=record)
        if os.environ.get("RANK", "0") == "0":
            # The first step warms up (allocations, and the module outputs the recorder
            # keeps at step 0): the median of the others.
            def median_ms(seconds):
                return statistics.median(seconds[1:] or seconds) * 1e3

            print(f"{'recorded' if record else 'plain'}: {median_ms(steps):.2f} ms per step "
                  f"(median of {max(len(steps) - 1, 1)}), rec.step "
                  f"{median_ms(inside) if inside else 0:.2f} ms, finish {finish * 1e3:.1f} ms")
    else:
        lockstep_probe.train_references(build_model, loss_fn, optimizer, Path(args.out) / "run",
                                        args.out, device=args.device, shadow_device="cpu",
                                        param_dtype=PRECISIONS.get(args.precision))


if __name__ == "__main__":
    main()
