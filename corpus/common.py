"""What every case of Lockstep's bug corpus shares (docs/bugs.md): the command line, the
process group, the step loop's bookkeeping. A case is one file: its header cites the bug
(issue or PR, date, mechanism), its default is the fixed job, `--bug` plants the bug, and its
`EXPECT` says where the judge must first see it. Written here from the public descriptions of
the bugs, not copied from the projects' code.

    python3 -m torch.distributed.run --nproc-per-node WORLD corpus/CASE.py train OUT [--bug]
    python3 corpus/CASE.py reference OUT
    lockstep judge --run OUT/run --reference OUT/reference --shadow OUT/shadow --out OUT/report
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import lockstep_probe  # noqa: E402,F401  (the cases import it from here)

STEPS = 3


def start():
    """The process group (gloo) and Lockstep's determinism settings for the job's life:
    (rank, world)."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    return dist.get_rank(), dist.get_world_size()


def batch(step, index, rows=4, features=8, classes=4):
    """The batch `index` (a rank's, a replica's) of `step`: inputs and class targets."""
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(rows, features, generator=g), torch.randint(classes, (rows,), generator=g)


def train_same_batch(out, model, loss_fn, optimizer, name, config, classes=4,
                     before_record=None, before_step=None):
    """The step loop of a job whose ranks all see the same batch (tensor parallelism alone):
    `before_record(step)` runs after backward (a gradient finalizer), `before_step(step)` after
    the record and before the optimizer (clipping)."""
    opt = optimizer(model.parameters())
    rec = lockstep_probe.Recorder(out / "run", model, name=name, config=config, steps=STEPS)
    for step in range(STEPS):
        x, y = batch(step, 0, classes=classes)
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        if before_record:
            before_record(step)
        rec.step(loss, x, y)
        if before_step:
            before_step(step)
        opt.step()
    rec.finish()


def sgd(params, lr=0.3):
    """The cases' optimizer: plain SGD, at 0.3 unless a case needs another rate."""
    return torch.optim.SGD(params, lr=lr)


def class_loss(model, x, y):
    """The cross-entropy of the model's class logits for `x` against `y`."""
    return nn.functional.cross_entropy(model(x), y)


def token_loss(model, x, y):
    """The mean token loss over the (whole or partial) sequences of `x`."""
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def part(t, rank, ranks):
    """This rank's contiguous part of every sequence of `t` (dimension 1)."""
    size = t.shape[1] // ranks
    return t[:, rank * size:(rank + 1) * size]


def mean_over(group, tensor):
    """`tensor` averaged over `group`'s ranks in place (a gradient's data-parallel mean)."""
    dist.all_reduce(tensor, group=group)
    tensor /= dist.get_world_size(group)


def main(train, build, loss_fn, optimizer, **reference_options):
    """The case's command line: `train OUT [--bug]` runs `train(out, bug)` (under torchrun),
    `reference OUT` trains the references from `build`, `loss_fn` and `optimizer`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "reference"])
    parser.add_argument("out")
    parser.add_argument("--bug", action="store_true", help="plant the published bug")
    args = parser.parse_args()
    if args.mode == "train":
        train(Path(args.out), args.bug)
        dist.destroy_process_group()
    else:
        lockstep_probe.train_references(build, loss_fn, optimizer, Path(args.out) / "run",
                                        args.out, **reference_options)


def run_example(example, bug):
    """Runs `examples/EXAMPLE` as the case's job, its `--bug` being the example's `--bug BUG`:
    for published bugs an example of Lockstep's already reproduces by mechanism (its header
    says how)."""
    import runpy

    path = Path(__file__).resolve().parent.parent / "examples" / example
    args = [a for a in sys.argv[1:] if a != "--bug"]
    if "--bug" in sys.argv[1:]:
        args += ["--bug", bug]
    sys.argv = [str(path), *args]
    runpy.run_path(str(path), run_name="__main__")
