"""A PyTorch `torch.distributed.pipelining` job judged by Lockstep (docs/judge.md).

    python3 -m torch.distributed.run --nproc-per-node 2 examples/torch_pipeline.py train OUT [--schedule 1f1b]
    python3 -m torch.distributed.run --nproc-per-node 4 examples/torch_pipeline.py train OUT --dp 2
    python3 examples/torch_pipeline.py reference OUT
    lockstep judge --run OUT/run --reference OUT/reference --shadow OUT/shadow --out OUT/report

The classifier is cut into two stages, one per rank, and trained by GPipe or 1F1B over four
microbatches of the global batch. `--dp N` (world 2N) runs N such pipelines on a dp x pp
mesh, each stage sharded over its replicas with FSDP2 (PP x FSDP, as torchtitan composes
them), each pipeline on its own batch. Some rows are padding (target -100, ignored by the loss),
and the microbatches hold unequal numbers of real rows, as packed or padded sequences do.
The loss the non-pipelined model minimizes is the mean over the batch's real rows, so each
microbatch's loss is its rows' sum over the whole batch's count of real rows, summed over
the microbatches (`scale_grads=False`).

Two planted bugs:
- `--bug per-microbatch-mean`: each microbatch's own mean, scaled by 1/M (`scale_grads`),
  the pipelining default; with unequal microbatches that weighs a row of a short microbatch
  more than one of a full microbatch, so the gradients are not the model's;
- `--bug unscaled-grads` (torchtitan#2972): each microbatch's mean, summed rather than
  averaged, so the pipeline's gradients are about four times the non-pipelined run's, which
  the loss does not show at the first step;
- `--bug input-without-grad`: stage 1's input declared without `requires_grad`, so backward
  stops at stage 1's first module and stage 0 is sent no gradient: the judge names that
  module's backward;
- `--bug tied-unsynced` (with `--tied`): each stage keeps its own part of the tied weight's
  gradient.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import lockstep_probe  # noqa: E402

STEPS = 4
SEED = 5
MICROBATCHES = 4
BATCH = 8
CLASSES = 6
PADDING = -100  # cross_entropy's ignore_index
PADDED_ROWS = [3, 5, 7]  # microbatches of 2, 1, 1 and 1 real rows


def build_model(tied=False):
    """The classifier; `tied`: its hidden linear used twice, once on each stage (index 2 and
    index 4 are one module, as an output head tied to an embedding is one weight)."""
    torch.manual_seed(SEED)
    if tied:
        shared = nn.Linear(16, 16)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), shared, nn.Tanh(), shared, nn.Tanh(),
                             nn.Linear(16, CLASSES))
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, CLASSES))


# Under --tied, stage 1 holds the shared linear as index 4; the model lists it as index 2.
TIED_ALIASES = {"4.weight": "2.weight", "4.bias": "2.bias"}


def batch(step, replica=0):
    """The step's global batch of data-parallel replica `replica` (each of its pipeline's
    stages is given it; the first feeds the inputs, the last the targets), its padded rows'
    targets set to `PADDING`."""
    g = torch.Generator().manual_seed(SEED * 10_000 + step * 100 + replica)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randint(CLASSES, (BATCH,), generator=g)
    y[PADDED_ROWS] = PADDING
    return x, y


def loss_fn(model, x, y):
    """The model's loss: the mean over the batch's real rows."""
    return nn.functional.cross_entropy(model(x), y, ignore_index=PADDING)


def microbatch_loss(bug, real_rows):
    """The pipeline's loss of one microbatch: its real rows' share of the batch mean (their sum
    over the batch's count `real_rows[0]`), or, planted, the microbatch's own mean."""
    if bug:
        return lambda out, y: nn.functional.cross_entropy(out, y, ignore_index=PADDING)
    return lambda out, y: nn.functional.cross_entropy(
        out, y, ignore_index=PADDING, reduction="sum") / real_rows[0]


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def stage_of(model, rank, group=None, input_grad=True):
    """This rank's stage (`rank` in its pipeline, whose process group is `group`), and what
    crosses its edges per microbatch (given, so no stage probes shapes at run time); a later
    stage's input must require its gradient (`input_grad=False` plants the bug where it does
    not, and backward never reaches the earlier stage)."""
    from torch.distributed.pipelining import PipelineStage

    mb = BATCH // MICROBATCHES
    cut = 4 if len(model) == 7 else 2  # the tied model's stage 0 ends after the shared linear
    if rank == 0:
        module, shapes = model[0:cut], dict(input_args=(torch.empty(mb, 8),),
                                          output_args=torch.empty(mb, 16),
                                          output_grads=torch.empty(mb, 16))
    else:
        module, shapes = model[cut:], dict(input_args=(torch.empty(mb, 16, requires_grad=input_grad),),
                                         output_args=torch.empty(mb, CLASSES),
                                         input_grads=(torch.empty(mb, 16),))
    return module, PipelineStage(module, rank, 2, torch.device("cpu"), group=group, **shapes)


def meshes(replicas):
    """This rank's place: (its stage, its pipeline's group, its replica, the dp mesh) on a
    `replicas` x 2 mesh (data-parallel x pipeline), or one pipeline without one."""
    from torch.distributed.device_mesh import init_device_mesh

    if replicas == 1:
        return dist.get_rank(), None, 0, None
    world = dist.get_world_size()
    if world != 2 * replicas:
        sys.exit(f"--dp {replicas} needs {2 * replicas} ranks (two stages each), not {world}")
    mesh = init_device_mesh("cpu", (replicas, 2), mesh_dim_names=("dp", "pp"))
    return (mesh["pp"].get_local_rank(), mesh["pp"].get_group(), mesh["dp"].get_local_rank(),
            mesh["dp"])


def train(out, schedule, bug, replicas=1, tied=False):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, pipeline, replica, dp_mesh = meshes(replicas)
    if tied and replicas != 1:
        sys.exit("--tied runs one pipeline (--dp 1)")
    module, stage = stage_of(build_model(tied), rank, pipeline,
                             input_grad=bug != "input-without-grad")
    if dp_mesh is not None:
        fully_shard(module, mesh=dp_mesh)  # each stage sharded over its replicas (PP x FSDP)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    real_rows = [0]
    scaled = bug in ("per-microbatch-mean", "unscaled-grads")
    pipe = kind(stage, n_microbatches=MICROBATCHES,
                loss_fn=microbatch_loss(bug if scaled else None, real_rows),
                scale_grads=bug == "per-microbatch-mean")
    opt = optimizer(module.parameters())
    config = f"pp2.{schedule}" if replicas == 1 else f"pp2.fsdp{replicas}.{schedule}"
    config += ".tied" if tied else ""
    rec = lockstep_probe.Recorder(Path(out) / "run", module, name="mlp", config=config,  # lockstep
                                  seed=SEED, steps=STEPS, stages=True, data=(replica, replicas),
                                  tied=TIED_ALIASES if tied else None)
    shared = (module[2] if rank == 0 else module[0]) if tied else None  # the tied linear
    for step in range(STEPS):
        x, y = batch(step, replica)
        opt.zero_grad()
        losses = []
        if rank == 0:
            pipe.step(x)
        else:
            real_rows[0] = int((y != PADDING).sum())
            pipe.step(target=y, losses=losses)
        if tied and bug != "tied-unsynced":
            # Each stage holds its own copy of the tied linear: its gradient is the sum of both
            # stages' parts (the bug leaves each stage with its own part).
            for p in shared.parameters():
                dist.all_reduce(p.grad, group=pipeline)
        scaled = bug in ("per-microbatch-mean", "unscaled-grads")
        loss = (sum(losses) / len(losses) if scaled else sum(losses)) if losses else None
        rec.step(loss, x, y)  # lockstep
        opt.step()
    rec.finish()  # lockstep
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "reference"])
    parser.add_argument("out")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument("--bug", choices=["per-microbatch-mean", "unscaled-grads",
                                          "tied-unsynced", "input-without-grad"])
    parser.add_argument("--tied", action="store_true",
                        help="a linear shared by both stages (a weight tied across stages)")
    parser.add_argument("--dp", type=int, default=1,
                        help="data-parallel replicas of the pipeline (FSDP over each stage)")
    args = parser.parse_args()
    if args.mode == "train":
        train(args.out, args.schedule, args.bug, args.dp, args.tied)
    else:
        lockstep_probe.train_references(lambda: build_model(args.tied), loss_fn, optimizer,
                                        Path(args.out) / "run", args.out)


if __name__ == "__main__":
    main()
