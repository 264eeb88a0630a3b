"""The references a PyTorch run is judged against, trained on one device from the run's own
initial state and every rank's batches: the fp32 single-device reference and its float64
shadow, the arbiter's two inputs (docs/parity.md)."""

import contextlib
import copy
import functools
import itertools
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from . import metrics as metric_points
from . import optimizer_state
from .record import (PRECISION_NAMES, Recorder, digest_config, digest_state,
                     digest_step_batches)


class ReferenceError(Exception):
    """The references cannot be trained as the run was: a missing or damaged run directory,
    a model whose parameters differ from the run's, a model that cannot run in float64."""


def _load(run_dir):
    """The run's record spec, initial state and batches, or an error naming what is missing."""
    run_dir = Path(run_dir)
    paths = {n: run_dir / n for n in ("record.json", "init.pt", "batches.pt")}
    if paths["init.pt"].is_file() and not paths["record.json"].is_file():
        raise ReferenceError(f"{paths['record.json']}: missing, while {paths['init.pt'].name} is "
                             "there: the run started recording but never reached rec.finish() "
                             "(did it crash or stop early? its log says why)")
    for name, path in paths.items():
        if not path.is_file():
            raise ReferenceError(f"{path}: missing (was the run recorded with "
                                 f"{'its batches given to rec.step' if name == 'batches.pt' else 'lockstep_probe.Recorder'}?)")
    try:
        record = json.loads(paths["record.json"].read_text())
        spec = record["spec"]
        spec["activation_steps"] = record.get("activation_steps", [])
        spec["grads_every"] = record.get("grads_every", 1)
        spec["loss_scales"] = record.get("loss_scales")
        spec["skipped_steps"] = record.get("skipped_steps", [])
    except (ValueError, KeyError) as e:
        raise ReferenceError(f"{paths['record.json']}: not a Lockstep run record ({e})") from e
    init, batches = (_load_tensors(paths[n]) for n in ("init.pt", "batches.pt"))
    # The metrics the job reported, and every rank's evaluation batch of each.
    spec["metrics"] = record.get("metrics", [])
    saved_metrics = run_dir / metric_points.FILE
    spec["metric_batches"] = (_load_tensors(saved_metrics) if saved_metrics.is_file()
                              else [])
    if len(spec["metric_batches"]) != len(spec["metrics"]):
        raise ReferenceError(f"{saved_metrics}: batches for {len(spec['metric_batches'])} "
                             f"metric points, the record reports {len(spec['metrics'])}")
    # A resumed job's optimizer state as recording began: the references start from it.
    saved_optimizer = run_dir / optimizer_state.FILE
    spec["optimizer_start"] = (_load_tensors(saved_optimizer) if saved_optimizer.is_file()
                               else None)
    if len(batches) != spec["steps"]:
        raise ReferenceError(f"{paths['batches.pt']}: {len(batches)} steps of batches for a run "
                             f"of {spec['steps']} steps")
    for step, ranks in enumerate(batches):
        if len(ranks) != spec["world_size"]:
            raise ReferenceError(f"step {step}: batches of {len(ranks)} ranks for a world of "
                                 f"{spec['world_size']}")
    return spec, init, batches


def _load_tensors(path):
    """A file the recorder saved, on the CPU, or an error naming it when damaged."""
    try:
        return torch.load(path, map_location="cpu")
    except Exception as e:  # torch raises several kinds for a truncated or foreign file
        raise ReferenceError(f"{path}: not readable as the recorder wrote it ({e})") from e


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
    """Hooks that fail the float64 shadow when a module still returns a float32 (or
    narrower) tensor, a cast `WidenedCasts` could not see: a shadow that is not float64
    throughout measures nothing."""
    def check(module, _inputs, output, name=None):
        outs = output if isinstance(output, (tuple, list)) else (output,)
        for o in outs:
            if torch.is_tensor(o) and o.is_floating_point() and o.dtype != torch.float64:
                raise ReferenceError(f"module `{name or type(module).__name__}` returned a "
                                     f"{o.dtype} tensor in the float64 shadow, narrowed in a "
                                     "way the shadow does not widen (a cast through another "
                                     "tensor's dtype, `x.to(y)`, or a dtype as a string): "
                                     "cast with `.float()` or `.to(torch.float32)`, which the "
                                     "shadow widens")
    return [m.register_forward_hook(lambda mod, i, o, n=n: check(mod, i, o, n))
            for n, m in model.named_modules()]


NARROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class WidenedCasts(TorchFunctionMode):
    """The float64 shadow's forward with every cast to a narrower floating dtype widened to
    float64: `.float()`, `.half()`, `.bfloat16()`, `.to(torch.float32)`, `.type(...)` and a
    `dtype=torch.float32` given to any function (a factory, a softmax). Models cast on
    purpose (logits `.float()` for the loss, an RMSNorm or rotary embedding computing in
    fp32 inside a bf16 model); in the shadow such an fp32 island would compute in fp32 and
    the shadow would no longer be the exact answer. `widened` counts the casts by the
    module they were made in, for the record."""

    def __init__(self, model):
        super().__init__()
        self.widened, self.stack = {}, []
        self.hooks = []
        for name, module in model.named_modules():
            self.hooks.append(module.register_forward_pre_hook(
                functools.partial(self._enter, name or "the model's forward")))
            self.hooks.append(module.register_forward_hook(self._leave))

    def _enter(self, name, _module, _inputs):
        self.stack.append(name)

    def _leave(self, _module, _inputs, _output):
        if self.stack:
            self.stack.pop()

    def _count(self):
        where = self.stack[-1] if self.stack else "the loss function"
        self.widened[where] = self.widened.get(where, 0) + 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if (func in (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)
                and args and torch.is_tensor(args[0])):
            self._count()  # an integer tensor's `.float()` (positions) too
            return args[0].double(*args[1:], **kwargs)
        if kwargs.get("dtype") in NARROW_DTYPES:
            self._count()
            kwargs["dtype"] = torch.float64
        if any(isinstance(a, torch.dtype) and a in NARROW_DTYPES for a in args):
            self._count()
            args = tuple(torch.float64 if isinstance(a, torch.dtype) and a in NARROW_DTYPES
                         else a for a in args)
        return func(*args, **kwargs)

    def remove(self):
        for h in self.hooks:
            h.remove()


def _materialised(model, device):
    """`model`, built by `model_fn`, on a real device: a model built on the meta device (the
    builder a job materialises with `to_empty` and its own initialisation) is given storage
    on `device`, for the run's initial state to fill; a buffer the state does not hold (a
    non-persistent one, such as a rotary cache) would stay uninitialised, and is refused by
    name."""
    if not any(t.device.type == "meta" for t in itertools.chain(model.parameters(),
                                                                 model.buffers())):
        return model
    saved = model.state_dict()
    unfilled = [n for n, b in model.named_buffers() if b.device.type == "meta" and n not in saved]
    if unfilled:
        raise ReferenceError(f"model_fn() builds the model on the meta device, and its buffer "
                             f"`{unfilled[0]}` is not in its state dict (persistent=False), so "
                             "the run's initial state cannot fill it: build the references' "
                             "model on a real device (or initialise it inside model_fn)")
    return model.to_empty(device=device)


def _placed(batch, dtype, device):
    """A rank's batch on `device`, its floating-point tensors in `dtype`."""
    return tuple(t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in batch)


@contextmanager
def deterministic(device="cpu"):
    """Lockstep's determinism settings for the duration (docs/gpu.md): deterministic
    algorithms (an op without a deterministic kernel fails naming itself), one CPU thread; on
    CUDA also cuDNN deterministic without autotuning, no TF32 in matmuls or convolutions (TF32
    rounds inputs to 10 mantissa bits: not fp32 arithmetic) and cuBLAS's fixed workspace,
    which must be set before the process's first cuBLAS call. A job judged on GPUs runs under
    the same settings: `with lockstep_probe.deterministic("cuda"):` around its loop."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        workspace = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if workspace not in (":4096:8", ":16:8"):
            raise ReferenceError(f"CUBLAS_WORKSPACE_CONFIG={workspace}: deterministic cuBLAS "
                                 "needs :4096:8 or :16:8")
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if cuda:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])
        (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
         torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) = saved[2:]


class _OwnDtype:
    """A step as the model's own dtype computes it: every rank's loss over its batch, their
    mean, one backward."""

    def __init__(self, model, dtype, device):
        self.model, self.dtype, self.device = model, dtype, device

    def context(self):
        return contextlib.nullcontext()

    def step(self, loss_fn, ranks, rec=None, scale=None):
        """The step's loss, after its backward put the gradients on the model; `rec` is told
        which data rank each forward stands for (the module outputs it records). `scale`:
        the job's loss scale at this step, the backward scaled and the gradients unscaled
        as its GradScaler does."""
        losses = []
        with self.context():
            for i, b in enumerate(ranks):
                if rec is not None:
                    rec.data_rank = i
                losses.append(loss_fn(self.model, *_placed(b, self.dtype, self.device)))
        loss = sum(losses) / len(losses)
        (loss if scale is None else loss * scale).backward()
        _unscale(self.model.parameters(), scale)
        return loss


class _Autocast(_OwnDtype):
    """The job's forward under `torch.autocast` in `autocast` (matmuls narrow, parameters and
    gradients fp32): the same autocast around every rank's loss."""

    def __init__(self, model, dtype, device, autocast):
        super().__init__(model, dtype, device)
        self.autocast = autocast

    def context(self):
        return torch.autocast(torch.device(self.device).type, dtype=self.autocast)


class _CastParams(_OwnDtype):
    """FSDP's mixed precision (`MixedPrecisionPolicy(param_dtype=D, reduce_dtype=float32)`,
    FSDP1's `MixedPrecision`) on one device: each rank's forward and backward on a copy of the
    fp32 parameters cast to D, its floating inputs cast to D, and its D gradients averaged over
    the ranks in fp32 onto the fp32 parameters, as FSDP reduces them. The buffers are not cast
    (neither FSDP casts them by default): the copy shares the model's."""

    def __init__(self, model, dtype, device, param_dtype):
        super().__init__(model, dtype, device)
        self.param_dtype = param_dtype
        self.narrow = copy.deepcopy(model)
        for wide, narrow in zip(model.modules(), self.narrow.modules()):
            narrow._buffers = wide._buffers
        for p in self.narrow.parameters():
            p.data = p.data.to(param_dtype)

    def step(self, loss_fn, ranks, rec=None, scale=None):
        # The forward runs on the cast copy: no module outputs are recorded (`rec` unused).
        pairs = list(zip(self.model.parameters(), self.narrow.parameters()))
        with torch.no_grad():
            for wide, narrow in pairs:
                narrow.copy_(wide)
        sums, losses = {}, []
        for b in ranks:
            self.narrow.zero_grad(set_to_none=True)
            loss = loss_fn(self.narrow, *_placed(b, self.param_dtype, self.device))
            (loss if scale is None else loss * scale).backward()
            losses.append(float(loss.detach()))
            for i, (wide, narrow) in enumerate(pairs):
                if narrow.grad is not None:  # a parameter no rank used keeps no gradient
                    g = narrow.grad.to(wide.dtype)
                    sums[i] = g if i not in sums else sums[i] + g
        for i, (wide, _) in enumerate(pairs):
            wide.grad = sums[i] / len(ranks) if i in sums else None
        _unscale(self.model.parameters(), scale)
        return torch.tensor(sum(losses) / len(losses), dtype=torch.float64)


def _unscale(params, scale):
    """Divides the gradients by `scale` as `GradScaler.unscale_` does: times the float64
    reciprocal rounded to float32."""
    if scale is None:
        return
    inverse = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
    for p in params:
        if p.grad is not None:
            p.grad.mul_(inverse.to(p.grad.device))


def _same_precision(spec, narrow):
    """The narrow dtype's name the references compute in (`None`: the model's own), or an
    error when it is not the run's: references narrower than the job would widen its
    envelope and hide bugs, wider ones would fail a correct job."""
    if narrow is not None and narrow not in PRECISION_NAMES:
        raise ReferenceError(f"{narrow}: the references compute in "
                             f"{' or '.join(map(str, PRECISION_NAMES))}")
    theirs = spec["dtype"] if spec["dtype"] in PRECISION_NAMES.values() else None
    mine = PRECISION_NAMES.get(narrow)
    if mine != theirs:
        run = f"in {theirs}" if theirs else f"in its parameters' dtype ({spec['dtype']})"
        asked = f"in {mine}" if mine else "in fp32"
        raise ReferenceError(f"the run computes {run}, and its references were asked to "
                             f"compute {asked}: pass param_dtype= (FSDP's mixed precision) or "
                             "autocast= as the job computes, or declare the job's autocast "
                             "with Recorder(precision=...)")
    return mine


def _compute(param_dtype, autocast):
    """How the fp32 reference computes a step, as the job does: a callable of (model, dtype,
    device) that gives the step's computation."""
    if param_dtype is not None:
        return lambda model, dtype, device: _CastParams(model, dtype, device, param_dtype)
    if autocast is not None:
        return lambda model, dtype, device: _Autocast(model, dtype, device, autocast)
    return _OwnDtype


def _binding(spec, init, batches):
    """The digests of the run the references are trained from, as its record binds them."""
    return {"init": digest_state(init),
            "batches": [digest_step_batches(ranks) for ranks in batches],
            "config": digest_config({k: spec[k] for k in ("model", "world_size", "steps",
                                                          "seed")})}


def _train(model_fn, loss_fn, optimizer_fn, spec, init, batches, out, *args, **kwargs):
    """`_train_at` into a staging folder beside `out`, moved into place only once its record
    is complete: a reference refused or failed part-way leaves nothing half-written (and a
    complete one from before stays as it was)."""
    final = Path(out)
    staging = final.with_name(f".{final.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _train_at(model_fn, loss_fn, optimizer_fn, spec, init, batches, staging, *args,
                  **kwargs)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)


def _train_at(model_fn, loss_fn, optimizer_fn, spec, init, batches, out, dtype, config, device,
              *, compute=_OwnDtype, precision=None, max_grad_norm=None, kind="reference",
              scales=None, metric_fns=None):
    """One single-device training from `init` over the global batches: each step's objective
    is every rank's loss in rank order, summed, divided by the world size (what a data-parallel
    job's averaged gradients are the gradient of), each step computed by `compute` (the job's
    mixed precision, named `precision` in the record, for the fp32 reference; never for the
    float64 shadow); its gradients clipped to `max_grad_norm` after they are recorded, when
    given. `scales`: the job's loss scale at each step (the fp32 reference scales as it
    did). A step the job's scaler skipped is skipped here too: its gradients recorded, no
    update."""
    model = _materialised(model_fn(), device)
    _check_same_tensors(model, init)
    model.load_state_dict(init, strict=True)
    # Floating tensors only: `Module.to(dtype)` would also cast a complex buffer (a rotary
    # cache) to real, dropping its imaginary part.
    model.to(device)._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
    hooks = _refuse_narrow_outputs(model) if dtype == torch.float64 else []
    # The shadow's casts to fp32 widened; registered before the recorder's hooks, so a
    # module's name is on the stack when its outputs are recorded.
    widen = WidenedCasts(model) if dtype == torch.float64 else None
    optimizer = optimizer_fn(model.parameters())
    if spec["optimizer_start"] is not None:
        optimizer_state.resume(optimizer, model, spec["optimizer_start"])
    stepper = compute(model, dtype, device)
    rec = Recorder(out, model, name=spec["model"], config=config, seed=spec["seed"],
                   world_size=spec["world_size"], backend=spec["backend"], keep_batches=False,
                   precision=precision, kind=kind, trained_from=_binding(spec, init, batches),
                   activations=spec["activation_steps"], every=spec["grads_every"],
                   skipped_steps=spec["skipped_steps"])
    skipped = set(spec["skipped_steps"])
    evaluate = functools.partial(_evaluate, model, metric_fns or {}, spec, rec, dtype, device,
                                 widen)
    for step, ranks in enumerate(batches):
        evaluate(step)
        optimizer.zero_grad()
        with widen if widen is not None else contextlib.nullcontext():
            loss = stepper.step(loss_fn, ranks, rec, None if scales is None else scales[step])
        rec.step(loss)
        if step in skipped:
            continue  # the job's scaler skipped this update: so do the references
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
    evaluate(len(batches))
    for h in hooks:
        h.remove()
    if widen is not None:
        widen.remove()
        rec.widened_casts = widen.widened
    rec.finish()


def _evaluate(model, metric_fns, spec, rec, dtype, device, widen, after):
    """The metrics the job reported after `after` training steps, computed from the
    reference's state now on the job's evaluation batches (`metric_fns[name](model,
    *batch)`), kept in the reference's record."""
    for point, ranks in zip(spec["metrics"], spec["metric_batches"]):
        if point["after"] != after:
            continue
        fn = metric_fns.get(point["name"])
        if fn is None:
            raise ReferenceError(f"the job reported the metric `{point['name']}`: pass "
                                 f"train_references(..., metrics={{'{point['name']}': "
                                 "fn}), fn(model, *batch) computing it on one rank's batch")
        with widen if widen is not None else contextlib.nullcontext():
            value = metric_points.evaluate(model, fn, ranks, dtype, device, _placed)
        rec.metrics.append({"name": point["name"], "after": after, "value": value})


def train_references(model_fn, loss_fn, optimizer_fn, run_dir, out_dir, *, shadow=True,
                     device="cpu", shadow_device=None, max_grad_norm=None, param_dtype=None,
                     autocast=None, metrics=None):
    """Trains the references of the run recorded in `run_dir` into `out_dir/reference` (fp32)
    and `out_dir/shadow` (float64), under `deterministic` settings: `model_fn()` builds the
    model (any initial values: the run's are loaded), `loss_fn(model, *batch)` one rank's
    loss, `optimizer_fn(params)` the optimizer.

    `device` is where the fp32 reference trains ("cpu", or "cuda" for a GPU job: the same
    kernels as the job's); `shadow_device` the float64 shadow's (default: `device`; "cpu"
    when the GPU's float64 is slow or a kernel lacks a float64 CUDA version: the shadow
    only has to be accurate, not fast).

    `max_grad_norm`: the job clips its gradients to this global norm after `rec.step` and
    before the optimizer step (FSDP1's `model.clip_grad_norm_`, `clip_grad_norm_` on DTensors);
    the references clip theirs to the same.

    A mixed-precision job names its precision, and the fp32 reference computes as it does, so
    that its distance to the float64 shadow is the noise a correct job in that precision shows
    (the arbiter's envelope; the shadow stays float64 throughout): `param_dtype=torch.bfloat16`
    for FSDP's mixed precision (parameters and inputs cast for the forward and backward,
    gradients reduced in fp32), `autocast=torch.bfloat16` for a forward under
    `torch.autocast`. A job recorded with its GradScaler (`Recorder(scaler=...)`, fp16) is
    replayed at its loss scale of each step, and the steps its scaler skipped are skipped.
    `metrics` maps each metric the job reported (`rec.metric(name, ...)`) to
    `fn(model, *batch)`, its value on one rank's evaluation batch: computed at the same
    points, without gradients and in eval mode, averaged over the ranks."""
    if param_dtype is not None and autocast is not None:
        raise ReferenceError("param_dtype and autocast describe two precisions: pass the one "
                             "the job uses")
    spec, init, batches = _load(run_dir)
    precision = _same_precision(spec, param_dtype or autocast)
    out_dir = Path(out_dir)
    shadow_device = shadow_device or device
    name = "single" if precision is None else f"single.{precision}"
    with deterministic(device):
        _train(model_fn, loss_fn, optimizer_fn, spec, init, batches, out_dir / "reference",
               torch.float32, name, device, compute=_compute(param_dtype, autocast),
               precision=precision, max_grad_norm=max_grad_norm, scales=spec["loss_scales"],
               metric_fns=metrics)
    if shadow:
        with deterministic(shadow_device):
            _train(model_fn, loss_fn, optimizer_fn, spec, init, batches, out_dir / "shadow",
                   torch.float64, "single.f64", shadow_device, max_grad_norm=max_grad_norm,
                   kind="shadow", metric_fns=metrics)
