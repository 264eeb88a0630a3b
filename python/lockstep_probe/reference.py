"""The references a PyTorch run is judged against, trained on one device from the run's own
initial state and every rank's batches: the fp32 single-device reference and its float64
shadow, the arbiter's two inputs (docs/parity.md)."""

import json
from pathlib import Path

import torch

from .record import Recorder


class ReferenceError(Exception):
    """The references cannot be trained as the run was: a missing or damaged run directory,
    a model whose parameters differ from the run's, a model that cannot run in float64."""


def _load(run_dir):
    """The run's record spec, initial state and batches, or an error naming what is missing."""
    run_dir = Path(run_dir)
    paths = {n: run_dir / n for n in ("record.json", "init.pt", "batches.pt")}
    for name, path in paths.items():
        if not path.is_file():
            raise ReferenceError(f"{path}: missing (was the run recorded with "
                                 f"{'rec.batch(...) each step' if name == 'batches.pt' else 'lockstep_probe.Recorder'}?)")
    try:
        spec = json.loads(paths["record.json"].read_text())["spec"]
    except (ValueError, KeyError) as e:
        raise ReferenceError(f"{paths['record.json']}: not a Lockstep run record ({e})") from e
    init = torch.load(paths["init.pt"])
    batches = torch.load(paths["batches.pt"])
    if len(batches) != spec["steps"]:
        raise ReferenceError(f"{paths['batches.pt']}: {len(batches)} steps of batches for a run "
                             f"of {spec['steps']} steps")
    for step, ranks in enumerate(batches):
        if len(ranks) != spec["world_size"]:
            raise ReferenceError(f"step {step}: batches of {len(ranks)} ranks for a world of "
                                 f"{spec['world_size']}")
    return spec, init, batches


def _check_same_tensors(model, init):
    """Refuses a reference model whose parameters or buffers differ from the run's, naming the
    first one."""
    mine = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    theirs = {n: tuple(t.shape) for n, t in init.items()}
    for name in sorted(set(mine) | set(theirs)):
        if name not in mine:
            raise ReferenceError(f"the run has `{name}`, the reference model does not")
        if name not in theirs:
            raise ReferenceError(f"the reference model has `{name}`, the run does not")
        if mine[name] != theirs[name]:
            raise ReferenceError(f"`{name}` is {list(theirs[name])} in the run, "
                                 f"{list(mine[name])} in the reference model")


def _refuse_narrow_outputs(model):
    """Hooks that fail the float64 shadow when a module returns a float32 (or narrower)
    tensor: a forward that creates its own fp32 tensors cannot be widened, and a shadow that
    is not float64 throughout measures nothing."""
    def check(module, _inputs, output, name=None):
        outs = output if isinstance(output, (tuple, list)) else (output,)
        for o in outs:
            if torch.is_tensor(o) and o.is_floating_point() and o.dtype != torch.float64:
                raise ReferenceError(f"module `{name or type(module).__name__}` returned a "
                                     f"{o.dtype} tensor in the float64 shadow: its forward "
                                     "creates tensors of a fixed dtype; create them with the "
                                     "input's dtype")
    return [m.register_forward_hook(lambda mod, i, o, n=n: check(mod, i, o, n))
            for n, m in model.named_modules()]


def _widen(batch, dtype):
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)


def _train(model_fn, loss_fn, optimizer_fn, spec, init, batches, out, dtype, config):
    """One single-device training from `init` over the global batches: each step's objective
    is every rank's loss in rank order, summed, divided by the world size (what a data-parallel
    job's averaged gradients are the gradient of)."""
    model = model_fn()
    _check_same_tensors(model, init)
    model.load_state_dict(init, strict=True)
    model.to(dtype)
    hooks = _refuse_narrow_outputs(model) if dtype == torch.float64 else []
    optimizer = optimizer_fn(model.parameters())
    rec = Recorder(out, model, name=spec["model"], config=config, seed=spec["seed"],
                   world_size=spec["world_size"], backend=spec["backend"])
    for ranks in batches:
        optimizer.zero_grad()
        losses = [loss_fn(model, *_widen(b, dtype)) for b in ranks]
        loss = sum(losses) / len(losses)
        loss.backward()
        rec.step(loss)
        optimizer.step()
    for h in hooks:
        h.remove()
    rec.finish()


def train_references(model_fn, loss_fn, optimizer_fn, run_dir, out_dir, *, shadow=True):
    """Trains the references of the run recorded in `run_dir` into `out_dir/reference` (fp32)
    and `out_dir/shadow` (float64), on this process's CPU, one thread, deterministic
    algorithms: `model_fn()` builds the model (any initial values: the run's are loaded),
    `loss_fn(model, *batch)` one rank's loss, `optimizer_fn(params)` the optimizer."""
    spec, init, batches = _load(run_dir)
    out_dir = Path(out_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _train(model_fn, loss_fn, optimizer_fn, spec, init, batches, out_dir / "reference",
               torch.float32, "single")
        if shadow:
            _train(model_fn, loss_fn, optimizer_fn, spec, init, batches, out_dir / "shadow",
                   torch.float64, "single.f64")
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
