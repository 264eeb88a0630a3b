"""A PyTorch DDP training job judged by Lockstep (docs/judge.md).

    # the job, under torchrun (gloo on the CPU; NCCL works the same on GPUs)
    python3 -m torch.distributed.run --nproc-per-node 2 examples/torch_ddp.py train OUT
    # its single-device references from the same start and batches (one process)
    python3 examples/torch_ddp.py reference OUT
    # the verdict
    lockstep judge --run OUT/run --reference OUT/reference --shadow OUT/shadow --out OUT/report

The recorder takes the DDP wrapper itself: it records the wrapped module, under the names the
single-device references use. `--compile` compiles the model with `torch.compile` before DDP
wraps it (TorchInductor's fused kernels against the eager references: did compiling change the
math?); the recorder unwraps the compiled module too.

`--accumulate 2` accumulates gradients over two microbatches, skipping DDP's all-reduce on the
first with `no_sync()`, as the DDP documentation shows (it must pass). Three planted bugs, each
a classic of DDP jobs:

- `--bug no-sync-always`: every microbatch under `no_sync()`, the last one too, so gradients
  are never averaged. Each rank steps with its own gradients and the replicas part, while
  the loss looks as plausible as a correct run's. The recorder's copy check names the first
  parameter whose replicas differ.
- `--bug loss-over-world`: the loss divided by the world size "to average it", on top of the
  averaging DDP already does, so every gradient is 1/N of what it should be.
- `--bug no-zero-grad`: `zero_grad` never called, so from the second step on every gradient
  carries all the earlier steps' too, while every module's output, and the gradient backward
  brings to it, stays right at that step.

`--precision fp16` trains under fp16 autocast with a `torch.amp.GradScaler` (its gradients
unscaled before `rec.step`, then clipped to norm 1), whose first step overflows and is
skipped: the recorder records the scale of each step and the skipped step, the references
replay both. `--bug clip-before-unscale` (fp16) clips the gradients while they are still
scaled, the classic mistake the AMP documentation warns of: clipped far too hard.

The three lines that hand the job to Lockstep are marked `# lockstep`.
"""

import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import lockstep_probe  # noqa: E402

STEPS = 5
SEED = 11
CLASSES = 5
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}
# fp16: the GradScaler starts far too high (the first step overflows and is skipped, as real
# jobs' first steps often are) and backs off fast.
SCALER = {"init_scale": 2.0**24, "backoff_factor": 2.0**-8}
MAX_NORM = 1.0


def build_model():
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, CLASSES),
    )


def batch(rank, step):
    """Rank `rank`'s batch at `step`: the same on every run."""
    g = torch.Generator().manual_seed(SEED * 10_000 + step * 100 + rank)
    return torch.randn(8, 16, generator=g), torch.randint(CLASSES, (8,), generator=g)


def loss_fn(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def optimizer(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def train(out, bug, accumulate, precision, compile, activations=None):
    with lockstep_probe.deterministic("cpu"):
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        # `--compile`: the model compiled by TorchInductor (its own fused kernels), then wrapped.
        model = build_model()
        model = DistributedDataParallel(torch.compile(model) if compile else model)
        opt = optimizer(model.parameters())
        config = "ddp" + (".compiled" if compile else "")
        config += f".autocast-{precision}" if precision else ""
        fp16 = precision == "fp16"
        scaler = torch.amp.GradScaler("cpu", **SCALER) if fp16 else None
        rec = lockstep_probe.Recorder(Path(out) / "run", model, name="classifier",  # lockstep
                                      config=config, seed=SEED, steps=STEPS, precision=precision,
                                      scaler=scaler, activations=activations)
        # `--precision bf16`: the forward under autocast (matmuls in bf16), which the
        # recorder cannot see: `precision=` tells it.
        narrow = PRECISIONS.get(precision)
        autocast = torch.autocast("cpu", dtype=narrow) if narrow else contextlib.nullcontext()
        for step in range(STEPS):
            x, y = batch(rank, step)
            if bug != "no-zero-grad":  # the bug: gradients pile up over the steps
                opt.zero_grad()
            losses = []
            parts = list(zip(x.chunk(accumulate), y.chunk(accumulate)))
            for i, (mx, my) in enumerate(parts):
                last = i == len(parts) - 1
                # Right: skip the all-reduce on every microbatch but the last.
                skip = bug == "no-sync-always" or not last
                with model.no_sync() if skip else contextlib.nullcontext():
                    with autocast:
                        part = loss_fn(model, mx, my) / accumulate
                    if bug == "loss-over-world":
                        part = part / world  # the bug: DDP averages over the ranks already
                    (scaler.scale(part) if fp16 else part).backward()
                losses.append(part.detach())
            if fp16:
                if bug == "clip-before-unscale":
                    # the bug: clipped while still scaled, so clipped far too hard
                    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                scaler.unscale_(opt)
            rec.step(sum(losses), x, y)  # lockstep
            if fp16:
                if bug != "clip-before-unscale":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                scaler.step(opt)  # skipped when the gradients overflowed
                scaler.update()
            else:
                opt.step()
        rec.finish()  # lockstep
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "reference"])
    parser.add_argument("out")
    parser.add_argument("--bug", choices=["no-sync-always", "loss-over-world",
                                          "clip-before-unscale", "no-zero-grad"])
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--precision", choices=list(PRECISIONS))
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--activations", type=lambda v: [int(s) for s in v.split(",") if s],
                        help="the steps whose module outputs are recorded, e.g. 0,3 "
                             "(the recorder's default: the first 16)")
    args = parser.parse_args()
    if args.bug == "clip-before-unscale":
        args.precision = "fp16"
    if args.bug == "no-sync-always" and args.accumulate == 1:
        args.accumulate = 2
    if args.mode == "train":
        train(args.out, args.bug, args.accumulate, args.precision, args.compile,
              args.activations)
    else:
        lockstep_probe.train_references(
            build_model, loss_fn, optimizer, Path(args.out) / "run", args.out,
            autocast=PRECISIONS.get(args.precision),
            max_grad_norm=MAX_NORM if args.precision == "fp16" else None)


if __name__ == "__main__":
    main()
