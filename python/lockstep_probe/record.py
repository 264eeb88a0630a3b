"""The recorder: what a rank of a PyTorch job hands Lockstep, written in Lockstep's own run
record format (`record.json`, the `RunRecord` the Rust side reads), with the initial state and
the batches the references need."""

import contextlib
import functools
import hashlib
import json
import math
import os
from pathlib import Path
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from . import metrics, optimizer_state
from .data import (DataChecks, SamplerWatch, replica_groups, replica_key,
                   shared_batch_group)
from .gather import assemble, gather_to_root, parts_of, wait_for_every_rank
from .tensor_file import DTYPE_CODES, TensorFileWriter, raw_bytes

TENSOR_FILE = "tensors.safetensors"


class RecordError(Exception):
    """The recorder was used out of order, or a tensor cannot be recorded."""


def _world():
    """(rank, world size) of the default process group, or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _backend_name():
    """The default process group's backend: `gloo`, `nccl`... A group made by
    `init_device_mesh` (no backend named) answers `dist.get_backend()` with "undefined"; its
    per-device configuration (`cpu:gloo,cuda:nccl`) says which backends it holds: the one
    name when there is one, else that configuration as it reads."""
    name = dist.get_backend()
    if name != "undefined":
        return name
    config = str(dist.get_backend_config())
    names = {part.split(":")[-1] for part in config.split(",") if part}
    return names.pop() if len(names) == 1 else config


def full_tensor(t):
    """`t` at full size: a DTensor (FSDP2, TP) gathered from its shards (a collective every
    rank must call), anything else as it is."""
    gather = getattr(t, "full_tensor", None)
    return gather() if callable(gather) else t


def unwrapped(model):
    """The module that DDP, `torch.compile` and Lightning Fabric wrappers train, in any
    nesting (its parameters under the names the single-device references use, without DDP's
    `module.` or compile's `_orig_mod.` prefix); any other module as it is."""
    ddp = getattr(torch.nn.parallel, "DistributedDataParallel", None)
    while True:
        if ddp is not None and isinstance(model, ddp):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod  # torch.compile's OptimizedModule
        elif type(model).__name__ == "_FabricModule":
            model = model.module  # Lightning Fabric's wrapper of the module it set up
        else:
            return model


def _compiled(model):
    """Whether `model` or any module in it runs under `torch.compile` (an `_orig_mod`)."""
    ddp = getattr(torch.nn.parallel, "DistributedDataParallel", None)
    while ddp is not None and isinstance(model, ddp):
        model = model.module
    return any(isinstance(getattr(m, "_orig_mod", None), torch.nn.Module)
               for m in model.modules())


def model_name(name):
    """A tensor's or module's name as the single-device model has it: without the
    `_orig_mod` segments of submodules compiled in place (torchtitan compiles each block,
    then shards it), nor the first FSDP's `_fsdp_wrapped_module` ones."""
    return ".".join(part for part in name.split(".")
                    if part not in ("_orig_mod", "_fsdp_wrapped_module"))


def named(items):
    """`(name, tensor)` pairs under the single-device model's names (`model_name`)."""
    return [(model_name(n), t) for n, t in items]


@functools.cache
def fsdp1_class():
    """PyTorch's first FSDP wrapper class (`FullyShardedDataParallel`), or `None` where this
    torch has none."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return None
    return FullyShardedDataParallel


def is_fsdp1(model):
    """Whether `model` is wrapped by the first FSDP, whose parameters are flat shards under
    its own names (FSDP2's `fully_shard` keeps the module's own, as DTensors)."""
    fsdp1 = fsdp1_class()
    return fsdp1 is not None and isinstance(model, fsdp1)


def full_view(model):
    """A context in which `model`'s parameters are whole, under the model's own names, with
    their whole gradients: the first FSDP's `summon_full_params` (a collective every rank
    enters), or nothing to do for any other module (FSDP2 and DTensor gather per tensor)."""
    if not is_fsdp1(model):
        return contextlib.nullcontext()
    return fsdp1_class().summon_full_params(model, writeback=False, with_grads=True)


PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def declared_precision(model):
    """The narrow dtype's name ("bf16", "fp16") that the FSDP wrapping of `model` computes in:
    a `MixedPrecisionPolicy` of `fully_shard` on any of its modules, or the first FSDP's
    `MixedPrecision`; `None` when it has none (autocast is not seen here: say it)."""
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        policy = getattr(state(), "_mp_policy", None) if callable(state) else None
        if policy is None and is_fsdp1(module):
            policy = module.mixed_precision
        dtype = getattr(policy, "param_dtype", None)
        if dtype in PRECISION_NAMES:
            return PRECISION_NAMES[dtype]
    return None


def fsdp1_shard_coordinate(model):
    """Under the first FSDP's HYBRID_SHARD (or _HYBRID_SHARD_ZERO2), this rank's place in its
    shard group, as a copy-group key: the ranks of every replica with the same place hold the
    same flat shard. `None` for any other wrapping (FULL_SHARD's shards are each rank's own)."""
    if not is_fsdp1(model):
        return None
    strategy = getattr(model, "sharding_strategy", None)
    if "HYBRID" not in getattr(strategy, "name", ""):
        return None
    return (("shard", dist.get_rank(model.process_group)),)


def copy_group(t):
    """Which ranks hold the same bits of `t` as this one, as a key every such rank computes
    alike: a plain tensor is one copy on every rank (key `()`); a DTensor's local part is
    shared by the ranks whose mesh coordinates agree on every dimension it is not replicated
    over (a TP-replicated bias: every rank of the mesh; an HSDP shard: the ranks of its
    replicate dimension), and by the ranks at the same place of another mesh of the same
    shape: under FSDP x TP, a norm the TP plan leaves out is sharded over each TP rank's own
    `dp` mesh, and the TP ranks hold copies of one shard. `None`: this rank holds no part of
    it, or no part that another rank copies (a shard of a mesh of every rank)."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return ()
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    sharded_only = all(type(p).__name__ != "Replicate" for p in placements)
    if coordinate is None or (sharded_only and mesh.size() == _world()[1]):
        return None
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    return tuple((names[d], coordinate[d]) for d, p in enumerate(placements)
                 if type(p).__name__ != "Replicate")


def _number(x):
    """A float as Lockstep's JSON writes it: NaN and infinities as strings."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def host_copy(name, t):
    """`t` on the CPU, as the record keeps it, or an error when Lockstep cannot record its
    dtype."""
    if t.dtype not in DTYPE_CODES:
        raise RecordError(f"`{name}` has dtype {t.dtype}, which Lockstep does not record")
    return t.detach().to("cpu").clone()


def write_json_atomically(path, value):
    """Writes `value` as JSON at `path` through a temporary file: a reader never sees half a
    record, and a failed write leaves what was there."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def _digest(t):
    """A replicated copy's identity: its element sum (for the message) and a hash of its
    bytes (the comparison is bitwise)."""
    local = getattr(t, "to_local", None)
    t = local() if callable(local) else t  # a replicated DTensor's copy is its local tensor
    return float(t.detach().double().sum()), hashlib.sha1(raw_bytes(t)).hexdigest()


def digest_state(state):
    """The identity of a state dict (name -> tensor): a SHA-256 over every name, dtype, shape
    and byte, in name order. What binds references to the start they were trained from."""
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(raw_bytes(t))
    return h.hexdigest()


def digest_step_batches(ranks):
    """The identity of one step's batches (every rank's, or every pipeline's, in order): a
    SHA-256 over every tensor's position, dtype, shape and bytes."""
    h = hashlib.sha256()
    for r, batch in enumerate(ranks):
        for i, t in enumerate(batch):
            h.update(f"{r}.{i}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(raw_bytes(t))
    return h.hexdigest()


def digest_config(spec):
    """The identity of what a run trained: its model, world size, step count and seed (the
    configuration's name differs between a run and its references by design)."""
    key = json.dumps([spec["model"], spec["world_size"], spec["steps"], spec["seed"]])
    return hashlib.sha256(key.encode()).hexdigest()


KINDS = ("run", "reference", "shadow")
# Models up to this many parameters record their module outputs at step 0 by default.
ACTIVATION_PARAMETERS = 10_000_000
# How many steps, from the first, record module outputs by default.
ACTIVATION_STEPS = 16


def by_data_rank(pairs):
    """Recorded outputs, each paired with its place within its data rank, grouped by data rank
    (their first field) and in that order within each."""
    return [o for o, _ in sorted(pairs, key=lambda pair: (pair[0][0], pair[1]))]


def whole_batches(recorded, drop_scalars):
    """A step's recorded outputs (or their gradients), each (data rank, module, call, tensor,
    piece), as the references hold them: the pieces of a module call (a pipeline stage's
    microbatches, a job's accumulation micro-steps) concatenated along dimension 0 in their
    order, in the order the calls came first. A piece whose shape past dimension 0 differs
    from the one before it (micro-steps of another sequence length) starts a call of its own,
    as the references' loss function runs each such part on its own. A scalar (a loss) has
    no batch dimension: left out of a call of several pieces, and of every pipeline stage's
    (`drop_scalars`)."""
    pieces = {}
    for order, (rank, module, call, t, piece) in enumerate(recorded):
        pieces.setdefault((rank, module, call), []).append((piece, order, t))
    runs = []
    for (rank, module, call), parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        if len(parts) > 1 or drop_scalars:
            parts = [p for p in parts if p[2].dim() > 0]
        for piece, order, t in parts:
            last = runs[-1] if runs else None
            if (last is not None and last["slot"] == (rank, module, call)
                    and last["tensors"][-1].shape[1:] == t.shape[1:]):
                last["tensors"].append(t)
                last["came"] = min(last["came"], order)
            else:
                runs.append({"slot": (rank, module, call), "first": piece, "came": order,
                             "tensors": [t]})
    # Each run is a call of its own, numbered per module in the order the references make
    # them: by the first piece it holds, then by the call within that piece.
    calls, numbered = {}, {}
    for r in sorted(runs, key=lambda r: (r["first"], r["slot"][2])):
        rank, module, _ = r["slot"]
        numbered[id(r)] = calls.get((rank, module), 0)
        calls[(rank, module)] = numbered[id(r)] + 1
    return [(r["slot"][0], r["slot"][1], numbered[id(r)],
             r["tensors"][0] if len(r["tensors"]) == 1 else torch.cat(r["tensors"]))
            for r in sorted(runs, key=lambda r: r["came"])]


class Recorder:
    """Records one rank's training for Lockstep.

    `out` is the run's directory (rank 0 writes it); `model` the module this rank trains
    (compiled, DDP- or FSDP-wrapped, FSDP2, DTensor TP, plain, or its pipeline stage); `name`
    the model's name and `config` the parallelism's, as the report shows them; `seed` what the
    run was seeded with.

    `stages=True` for a pipeline: every rank holds other parameters (its stages'), the
    record's model is their union gathered on rank 0, only the last stage passes its loss,
    every rank of a pipeline trains on the same global batch, and the references stand for one
    data rank. With data parallelism over pipelines, `data=(index, size)` says which replica
    this rank's pipeline is and how many there are: the model is the first replica's, the
    references stand for `size` data ranks (each pipeline's batch in replica order), and the
    replicas' copies of each stage are compared.
    `precision` ("bf16", "fp16") names the narrow dtype the job computes in when FSDP's
    mixed-precision policy does not say it (a forward under `torch.autocast`); the record
    carries it, and the references must compute in it.
    Weights tied across stages: a parameter every stage holding it lists under the same name
    is one parameter, counted once in the gradient norm, its copies compared bit for bit after
    every step (a tied gradient the stages did not sum makes them drift, named). A stage that
    holds a tied weight under another name than the single-device model lists it (a head at
    index 4 sharing index 2's linear: `model.named_parameters()` lists `2.weight` only) says
    so with `tied={"4.weight": "2.weight", ...}` (alias -> the model's name).

    `activations` lists the steps whose module outputs are recorded, with the gradients that
    backward brings to them (default: the first 16 steps for models of at most 10M
    parameters, so that the first failing step is among them; `[]`: none): at the first step
    where either leaves its envelope, the judge names the first module, in execution order,
    whose output does (a forward bug), else the first module whose backward sent a gradient
    out of it (a backward bug), before the parameters where either showed. A pipeline's
    stages record their modules' outputs per microbatch, a job accumulating gradients per
    micro-step, put back together along the batch dimension as the whole step's
    (`whole_batches`). A model under `torch.compile` records none: hooks
    inside a compiled graph break it, and would change the kernels whose numerics are judged.

    `loss_reduction="sum"`: the job sums its ranks' gradients instead of averaging them, each
    rank's loss being its share of the global loss (torchtitan's FSDP, whose losses are
    divided by the step's tokens over every rank): the record's loss is then the ranks' sum.

    `every=k` records the full gradients every k-th step only (steps 0, k, 2k...; the loss
    and the gradient norm at every step), and compares the copies at those steps: for long
    jobs, where a step's gathering is not free. The references record the same steps.

    `scaler` is a job's `torch.amp.GradScaler` (or FSDP's `ShardedGradScaler`) under fp16: the
    job calls `scaler.unscale_(optimizer)` before `rec.step`, the recorder records the true
    gradients and the scale of each step, and a step whose gradients overflowed (the scaler
    skips its update) is recorded as skipped: the references skip it too, at the same scale,
    and `lockstep judge` leaves its overflowed gradients out of the comparison.

    `world_size` overrides how many data ranks the run stands for (a single-device reference
    stands in for a world of ranks); `keep_batches=False` records no batches (the references'
    own records need none).

    `frozen` lists parameters that do not train on purpose (a frozen trunk the optimizer
    leaves out); those without `requires_grad` are found without it. `lockstep judge` flags
    every other parameter whose gradient is zero at every recorded step, and a job whose
    gradient norm is zero or whose loss is the same at every step: a job that trains nothing,
    in its references alike, would otherwise pass.

    `optimizer` is the job's optimizer, for a job resumed from a checkpoint: its state as
    recording begins (Adam's moments, the step count, each group's learning rate) is saved,
    and the references start from it. A resumed job that does not pass it is found (an
    optimizer over the model already holding state) and refused by `lockstep judge`.

    The data is checked as it is recorded (`data.DataChecks`): every data-parallel replica
    (every pipeline replica under `stages`) receiving the same batch at a step (a loader
    without a `DistributedSampler`), or a rank's batch repeating one of an earlier step (a
    loader that does not advance), fails the job with its own finding. Which ranks are
    replicas is found from what they hold (`data.replica_key`): tensor-parallel ranks, which
    hold different slices of the weights, may share a batch with no word said.
    `replicated_data=True` says every rank receives the same batch on purpose, and
    `replicated_data=mesh["cp"]` that the ranks of this rank's group in that 1-D mesh do
    (context parallelism, whose ranks each compute a part of one batch's sequence: the
    inference cannot see them, as they hold the same weights); it is checked, not trusted:
    a rank said to share a batch whose batch differs is a finding.

    The record binds itself: a job's (`kind="run"`) carries the digests of its initial state,
    of every step's batches and of its configuration; a reference's or shadow's (`kind=
    "reference"` / `"shadow"`, written by `train_references`) carries, as `trained_from`, the
    digests of the run it was trained from, so `lockstep judge` refuses references of another
    run.
    """

    def __init__(self, out, model, *, name, config, seed=0, steps=None, record_grads=True,
                 world_size=None, backend=None, stages=False, data=None, keep_batches=True,
                 precision=None, kind="run", trained_from=None, replicated_data=False,
                 tied=None, activations=None, every=1, scaler=None, skipped_steps=None,
                 loss_reduction="mean", frozen=None, optimizer=None):
        if kind not in KINDS:
            raise RecordError(f"kind={kind!r}: a record is one of {', '.join(KINDS)}")
        if (kind == "run") != (trained_from is None):
            raise RecordError("a run's record binds its own start and batches; a reference's "
                              "or shadow's names the run's with trained_from=")
        self.kind, self.trained_from = kind, trained_from
        if scaler is not None and kind != "run":
            raise RecordError("scaler= is a job's: the references replay the steps it skipped")
        # A job's loss scaler: its scale at each step, and the steps it skipped (their
        # gradients overflowed); a reference's record lists the skipped steps it replayed.
        self.scaler, self.loss_scales = scaler, []
        if loss_reduction not in ("mean", "sum"):
            raise RecordError(f"loss_reduction={loss_reduction!r}: the ranks' gradients are "
                              "averaged (\"mean\", DDP's and FSDP's default) or summed "
                              "(\"sum\", each rank's loss its share of the global one)")
        self.loss_reduction = loss_reduction
        self.skipped_steps = list(skipped_steps or [])
        self.batch_digests = []
        self.tied = dict(tied or {})
        # Parameters that do not train on purpose: the judge flags any other whose gradient
        # is zero at every step. Those the model holds without requires_grad need no word.
        if isinstance(frozen, str):
            raise RecordError(f"frozen={frozen!r}: a list of parameter names, e.g. "
                              "frozen=[\"embed.weight\"]")
        self.frozen = set(frozen or []) | {
            n for n, p in self._named(model.named_parameters()) if not p.requires_grad}
        # Module outputs (forward), at the steps `activations` names; a pipeline stage's per
        # microbatch (its stage module's forwards this step).
        self.data_rank = None
        self.step_outputs, self.output_calls, self.microbatch = [], {}, -1
        # The gradients reaching those outputs (backward), in the order backward reached them.
        self.step_output_grads, self.output_grad_entries = [], []
        self.out = Path(out)
        compiled = _compiled(model)
        self.model = unwrapped(model)
        precision = precision or declared_precision(self.model)
        if precision not in (None, *PRECISION_NAMES.values()):
            raise RecordError(f"precision={precision!r}: Lockstep knows "
                              f"{', '.join(PRECISION_NAMES.values())} (or None for the "
                              "parameters' own dtype)")
        if is_fsdp1(self.model) and not getattr(self.model, "_use_orig_params", True):
            raise RecordError("a FullyShardedDataParallel job is recorded with "
                              "use_orig_params=True: the recorder reads its whole gradients "
                              "through summon_full_params(with_grads=True), which needs it")
        self.stages = stages
        self.rank, self.world = _world()
        if data is not None and not stages:
            raise RecordError("data=(index, size) describes replicas of a pipeline: pass "
                              "stages=True (other data parallelism needs no declaring)")
        self.data_index, self.data_size = data or (0, 1)
        self.spec = {
            "model": name,
            "config": config,
            "world_size": world_size or (self.data_size if stages else self.world),
            "backend": backend or (_backend_name() if self.world > 1 else "none"),
            "dtype": "fp32",
            "steps": 0,
            "seed": seed,
        }
        self.declared_steps = steps
        self.record_grads = record_grads
        if not isinstance(every, int) or every < 1:
            raise RecordError(f"every={every!r}: the full gradients are recorded every k-th "
                              "step, k a whole number of at least 1")
        self.every = every
        self.losses, self.grad_norms, self.grad_entries, self.output_entries = [], [], [], []
        self.batches, self.pending_batch, self.keep_batches = [], None, keep_batches
        self.cross_rank = {"ranks": self.world, "compared": 0}
        # The float64 shadow's casts to narrower dtypes that it widened, by module (set by
        # `train_references`).
        self.widened_casts = None
        # Reported metrics ({"name", "after", "value"}), and a job's every rank's batch of
        # each, in the same order.
        self.metrics, self.metric_batches = [], []
        self.finished = False
        self.activation_steps = self._activation_steps(activations, compiled)
        # A step's forwards fall into pieces, each module's outputs concatenated over them
        # (`whole_batches`): a pipeline stage's microbatches, or a job's accumulation
        # micro-steps (forwards with a backward between them).
        self.backward_since_forward = False
        if self.activation_steps:
            self.model.register_forward_pre_hook(
                self._next_microbatch if stages else self._next_micro_step)
        for module_name, module in self.model.named_modules():
            # The first FSDP's wrappers return their module's output: that module is hooked.
            if (self.activation_steps and model_name(module_name)
                    and not is_fsdp1(module)):
                module.register_forward_hook(
                    functools.partial(self._record_output, model_name(module_name)))
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            self.writer = TensorFileWriter(self.out / TENSOR_FILE)
        self._refuse_meta()
        try:
            shared = shared_batch_group(replicated_data, self.rank, self.world)
        except ValueError as e:
            raise RecordError(str(e)) from e
        # Which ranks are replicas matters to a job's data checks over several ranks only
        # (a reference's own record is one process): the key hashes every plain parameter.
        checked = kind == "run" and not stages and self.world > 1
        key = (replica_key(self.model, is_fsdp1(self.model)), shared) if checked else None
        init, _, keys = self._gathered(self._named(self.model.state_dict().items()), True, key)
        self.optimizer_start = (optimizer_state.start_of(self.model, optimizer)
                                if kind == "run" else None)
        if optimizer is not None and kind == "run":
            self._save_optimizer(optimizer)
        self.data_checks = DataChecks(
            stages, replica_groups([k[0] for k in keys]) if keys and checked else [],
            [k[1] for k in keys] if keys and checked else [])
        self.samplers = SamplerWatch() if checked else None
        for alias, name in self.tied.items():
            # The single-device model's state dict lists a tied weight under every name.
            if name in init:
                init[alias] = init[name]
        if self.rank == 0:
            dtypes = {t.dtype for t in init.values() if t.is_floating_point()}
            if precision is not None:
                self.spec["dtype"] = precision
            elif len(dtypes) == 1:
                self.spec["dtype"] = {torch.float32: "fp32", torch.float64: "fp64"}.get(
                    dtypes.pop(), "mixed")
            self.init_digest = digest_state(init)
            torch.save(init, self.out / "init.pt")

    def _refuse_meta(self):
        """Refuses a model still on the meta device (built there, not yet materialised):
        the recorder reads the job's initial state as it is created."""
        tensors = self._named(list(self.model.named_parameters())
                              + list(self.model.named_buffers()))
        meta = next((name for name, t in tensors if t.device.type == "meta"), None)
        if meta is not None:
            raise RecordError(f"`{meta}` is on the meta device: create the Recorder after the "
                              "model is materialised (`model.to_empty(device=...)` and its "
                              "initialisation, e.g. `init_weights()`) and before the first "
                              "step: it records the job's initial state, which the "
                              "references start from")

    def _save_optimizer(self, optimizer):
        """Saves the job's optimizer state as recording begins (`optimizer.pt`, rank 0), its
        DTensor states gathered whole: the references start from it."""
        if is_fsdp1(self.model):
            raise RecordError("optimizer= under the first FSDP: its optimizer state is kept "
                              "per flat shard; record the job from a fresh optimizer, or "
                              "move it to FSDP2 (fully_shard)")
        names = {id(p): name for name, p in self._named(self.model.named_parameters())}
        tensors, scalars, groups = optimizer_state.state_tensors(optimizer, names)
        whole, _, _ = self._gathered(tensors, True)
        if self.rank == 0:
            torch.save(optimizer_state.saved(whole, scalars, groups),
                       self.out / optimizer_state.FILE)

    def _activation_steps(self, asked, compiled):
        """The steps whose module outputs are recorded: `asked`, or by default the first
        `ACTIVATION_STEPS` for a model of at most `ACTIVATION_PARAMETERS` parameters; none
        for a model under `torch.compile` (its hooks would break the graph under judgement)."""
        if compiled:
            if asked:
                raise RecordError("activations= is not supported for a compiled model: hooks "
                                  "inside its graph would break it and change the kernels "
                                  "under judgement; record the job uncompiled to place a bug "
                                  "at its module")
            return frozenset()
        if asked is None:
            size = sum(p.numel() for p in self.model.parameters())
            return (frozenset(range(ACTIVATION_STEPS)) if size <= ACTIVATION_PARAMETERS
                    else frozenset())
        return frozenset(asked)

    def _next_microbatch(self, _module, _inputs):
        """A pipeline stage module's forward pre-hook: a new microbatch begins (not in an
        evaluation's forward, which has no gradients)."""
        if torch.is_grad_enabled():
            self.microbatch += 1

    def _next_micro_step(self, _module, _inputs):
        """The model's forward pre-hook: a forward after a backward within a step begins
        the step's next accumulation micro-step (forwards with no backward between them,
        a model run twice for one loss or every rank's forward in the references, stay one
        piece, told apart by their calls)."""
        if not torch.is_grad_enabled():
            return  # an evaluation's forward
        if self.microbatch < 0 or self.backward_since_forward:
            self.microbatch += 1
        self.backward_since_forward = False

    def _record_output(self, module_name, _module, _inputs, output):
        """A forward hook: keeps the module's output (its first floating tensor, whole) when
        this step's outputs are recorded; a pipeline stage's under its microbatch."""
        # An evaluation's forward (no gradients) is no training step's.
        if (self.finished or len(self.losses) not in self.activation_steps
                or not torch.is_grad_enabled()):
            return
        outs = output if isinstance(output, (tuple, list)) else (output,)
        t = next((o for o in outs if torch.is_tensor(o) and o.is_floating_point()), None)
        # A pipeline stage's shape inference runs its modules on the meta device.
        if t is None or t.device.type == "meta":
            return
        # The data rank the references stand for: a stage's is its pipeline replica's.
        rank = self.data_index if self.stages else (
            self.rank if self.data_rank is None else self.data_rank)
        slot = (rank, module_name, self.microbatch)
        call = self.output_calls.get(slot, 0)
        self.output_calls[slot] = call + 1
        with torch.no_grad():
            whole = full_tensor(t.detach())
        self.step_outputs.append((rank, module_name, call, host_copy(module_name, whole),
                                  self.microbatch))
        if t.requires_grad:
            t.register_hook(functools.partial(self._record_output_grad, rank, module_name, call,
                                              self.microbatch))

    def _record_output_grad(self, rank, module_name, call, microbatch, grad):
        """A gradient hook on a recorded output: keeps the gradient that backward brought to
        it (whole), as each rank's share of the step's loss: a job's rank differentiates its
        own loss, the references the mean of every rank's, so a job's is divided by the
        ranks its references stand for."""
        self.backward_since_forward = True
        with torch.no_grad():
            whole = full_tensor(grad.detach())
            if self.kind == "run" and self.loss_reduction == "mean" and self.spec["world_size"] > 1:
                whole = whole / self.spec["world_size"]
        self.step_output_grads.append((rank, module_name, call, host_copy(module_name, whole),
                                       microbatch))

    def _named(self, items):
        """`(name, tensor)` pairs under the single-device model's names, tied aliases under
        the name they alias."""
        return [(self.tied.get(n, n), t) for n, t in named(items)]

    def _sends_whole(self):
        """Whether this rank's plain tensors are the record's: rank 0's, or under `stages`
        those of every stage of the first replica (a tied weight's first stage counts)."""
        return self.data_index == 0 if self.stages else self.rank == 0

    def _gathered(self, named_tensors, keep, extra=None):
        """The whole tensors of `named_tensors` and their sums of squares on rank 0 (`({},
        {})` elsewhere), plus every rank's `extra` on rank 0, in one gather: each rank sends
        its parts (rank 0 keeps its own); `keep=False` brings only the squares."""
        for name, t in named_tensors:
            if t.dtype not in DTYPE_CODES and not t.is_complex():
                raise RecordError(f"`{name}` has dtype {t.dtype}, which Lockstep does not record")
        parts = parts_of(named_tensors, sends_whole=self._sends_whole(), keep=keep)
        every = gather_to_root((extra, [] if self.rank == 0 else parts), self.world)
        if every is None:
            return {}, {}, None
        every[0] = (every[0][0], parts)
        tensors, squares = assemble(p for _, p in every)
        return tensors, squares, [e for e, _ in every]

    def grads_recorded_at(self, step):
        """Whether the full gradients of `step` are recorded (every `every`-th step, from
        the first); the loss and the gradient norm are recorded at every step."""
        return self.record_grads and step % self.every == 0

    def batch(self, *tensors):
        """This rank's batch for the coming step (inputs, targets...), before a forward that
        changes it in place; otherwise pass it to `step`."""
        self.pending_batch = tuple(t.detach().to("cpu").clone() for t in tensors)

    def step(self, loss, *batch):
        """After backward, before the optimizer step: records the global loss (the mean of
        every rank's; a pipeline's last stage passes it, the others `None`), the global
        gradient norm, the full gradients (at the steps `every` names), and compares the
        copies of every parameter the ranks hold (after the previous update). `batch` is this
        rank's batch of the step (inputs, targets...) unless `batch()` was given it: the
        references train on every rank's batch in rank order (a pipeline's every rank passes
        the same global batch). One gather to rank 0 brings it all."""
        if self.finished:
            raise RecordError("step() after finish()")
        if batch:
            self.batch(*batch)
        if self.keep_batches and self.pending_batch is None:
            raise RecordError(f"step {len(self.losses)}: no batch: pass it to step(loss, *batch) "
                              "(or to batch() before the forward)")
        if loss is None and not self.stages:
            raise RecordError("step(None): only a pipeline's other stages (stages=True) pass no loss")
        step = len(self.losses)
        keep = self.grads_recorded_at(step)
        if self.scaler is not None:
            self.loss_scales.append(self._loss_scale())
        # Copies are digested as the ranks hold them (the first FSDP's flat shards), outside
        # the full view.
        contribution = self._contribution(loss, keep)
        with full_view(self.model):
            params = self._named(self.model.named_parameters())
            if params and all(p.grad is None for _, p in params):
                raise RecordError(f"no parameter has a gradient at step {step}: "
                                  "call step() after backward")
            # A parameter the step did not use has no gradient: its gradient is zero.
            grads = [(name, p.grad if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype))
                     for name, p in params]
            grads, squares, every = self._gathered(grads, keep, contribution)
        if every is None:
            self.losses.append(None)  # rank 0 alone keeps the record's figures
            return
        self._compare_copies(step, "param", [c.digests for c in every])
        self.losses.append(self._mean_loss([c.loss for c in every]))
        # A weight tied across stages is one parameter: its square counted once.
        self.grad_norms.append(math.sqrt(sum(squares.values())))
        if self.scaler is not None and not math.isfinite(self.grad_norms[-1]):
            # The scaler finds the same overflow and skips the optimizer step.
            self.skipped_steps.append(step)
        if self.record_grads:
            self.grad_entries.append(self._keyed(f"grad/{step}", grads) if keep else [])
        # Within a data rank, forward runs the stages in order and backward in reverse.
        forward = [(o, i) for i, c in enumerate(every) for o in c.outputs]
        shared = self._tensor_parallel_multiplicity()
        backward = [((*o[:3], o[3] / shared) if shared > 1 else o, -i if self.stages else i)
                    for i, c in enumerate(every) for o in c.output_grads]
        self._keep_outputs(step, by_data_rank(forward), "act", self.output_entries)
        self._keep_outputs(step, by_data_rank(backward), "outgrad", self.output_grad_entries)
        self._keep_batches(every)
        if self.samplers is not None:
            self.data_checks.check_samples(step, [c.samples for c in every])

    def metric(self, name, value, *batch):
        """Records an evaluation metric the job reports between training steps (its
        evaluation loss, after `len(steps)` updates): `value` as the job reports it (the
        same on every rank; rank 0's is kept) and `batch` this rank's evaluation batch. The
        references compute `metrics[name]` (`train_references(metrics=...)`) on every rank's
        batch from their own state at the same point, and `lockstep judge` holds the
        reported value to the arbiter's envelope. Every rank calls it (one gather)."""
        if self.finished:
            raise RecordError("metric() after finish()")
        try:
            value = metrics.reported_value(name, value)
        except metrics.MetricError as e:
            raise RecordError(str(e)) from e
        after = len(self.losses)
        if any(m["name"] == name and m["after"] == after for m in self.metrics):
            raise RecordError(f"metric `{name}` reported twice after {after} steps")
        mine = tuple(t.detach().to("cpu").clone() for t in batch)
        every = gather_to_root(mine, self.world)
        self.metrics.append({"name": name, "after": after, "value": value})
        if every is not None:
            self.metric_batches.append(every)

    def _loss_scale(self):
        """The job's loss scale at this step, once its gradients are unscaled (an error when
        they are not: the recorder would read gradients `scale` times too large)."""
        if not self.scaler.is_enabled():
            return 1.0
        states = getattr(self.scaler, "_per_optimizer_states", None)
        if states is not None and all(getattr(state.get("stage"), "name", "") != "UNSCALED"
                                      for state in states.values()):
            raise RecordError(f"step {len(self.losses)}: the GradScaler's gradients are still "
                              "scaled: call scaler.unscale_(optimizer) before rec.step (as "
                              "before clipping), so that the true gradients are recorded")
        return float(self.scaler.get_scale())

    def _contribution(self, loss, compare):
        """What this rank brings to rank 0 at a step besides its gradients: its replica, the
        digests of its parameters' copies (at the steps whose gradients are recorded, when
        `compare`), its loss, its batch and the module outputs it recorded."""
        # A DTensor loss (`loss_parallel`) is replicated: its full value is the local one.
        if loss is None or not torch.is_tensor(loss):
            value = None if loss is None else float(loss)  # a loss summed as a number
        else:
            value = float(full_tensor(loss.detach()).double().cpu())
        batch, self.pending_batch = self.pending_batch, None
        outputs, self.step_outputs, self.output_calls = self.step_outputs, [], {}
        output_grads, self.step_output_grads = self.step_output_grads, []
        self.microbatch = -1
        self.backward_since_forward = False
        outputs = whole_batches(outputs, drop_scalars=self.stages)
        output_grads = whole_batches(output_grads, drop_scalars=self.stages)
        samples = self.samplers.news() if self.samplers is not None else None
        return Contribution(self.data_index, self._digests() if compare else None, value,
                            batch if self.keep_batches else None, outputs, output_grads, samples)

    def _tensor_parallel_multiplicity(self):
        """How many ranks hold each data-parallel replica's loss under `loss_reduction="sum"`
        (rank 0's): the references stand for every rank, tensor-parallel ones too, so a
        rank's share of the loss is that many times theirs (under "mean" the hook's division
        by the world's ranks accounts for them already). 1 otherwise."""
        if self.loss_reduction != "sum" or self.stages or self.kind != "run":
            return 1
        group = self.data_checks.group_of(0)
        return self.world // len(group) if group else 1

    def _mean_loss(self, values):
        """The step's loss over the world: the mean of every rank's, or of every pipeline's
        (its last stage's); under `loss_reduction="sum"` the sum of one replica group's
        shares (rank 0's data-parallel replicas: the tensor-parallel ranks beside them hold
        the same shares again)."""
        present = [v for v in values if v is not None]
        if self.loss_reduction == "sum":
            group = self.data_checks.group_of(0)
            if group is not None and not self.stages:
                return sum(values[r] for r in group if values[r] is not None)
            return sum(present)
        return sum(present) / (self.data_size if self.stages else len(values))

    def _keyed(self, prefix, tensors):
        """The record's entries for `tensors` (name -> tensor), their bytes handed to the
        tensor file's writer under `prefix/name`."""
        entries = []
        for name, t in tensors.items():
            key = f"{prefix}/{name}"
            # A complex tensor (a rotary cache) as its real and imaginary parts.
            self.writer.add(key, torch.view_as_real(t) if t.is_complex() else t)
            entries.append({"name": name, "key": key})
        return entries

    def _keep_outputs(self, step, outputs, prefix, entries):
        """The step's recorded module outputs or their gradients (data rank, module, call,
        tensor), in the order they came within each data rank, handed to the tensor file's
        writer under `prefix/...` and listed in `entries`."""
        for rank, module, call, t in outputs:
            name = f"step {step}, rank {rank}: {module}" + (f" (call {call + 1})" if call else "")
            key = f"{prefix}/{step}/{rank}/{module}#{call}"
            self.writer.add(key, t)
            entries.append({"name": name, "key": key})

    def _keep_batches(self, every):
        """Every rank's batch of this step, on rank 0; under `stages` every pipeline's global
        batch (which each of its stages was given), in replica order."""
        if not self.keep_batches:
            return
        if self.stages:
            per_replica = {}
            for c in every:
                per_replica.setdefault(c.replica, c.batch)
            self.batches.append([per_replica[i] for i in range(self.data_size)])
        else:
            self.batches.append([c.batch for c in every])
        self.batch_digests.append(digest_step_batches(self.batches[-1]))
        self._check_data(len(self.batches) - 1, self.batches[-1])

    def _check_data(self, step, ranks):
        """The data checks of one step (rank 0), on the digest of every entry's batch."""
        self.data_checks.check(step, [digest_step_batches([b]) for b in ranks])

    def _holds_copies(self):
        """Whether some rank may hold another's copy of a tensor (a pipeline's stages across
        data-parallel replicas, a weight tied across stages, the first FSDP's hybrid shards
        across its replicas; FULL_SHARD's flat shards are each rank's own): the record then
        says what the copy check found. The same on every rank."""
        return self.world > 1 and (not is_fsdp1(self.model)
                                   or fsdp1_shard_coordinate(self.model) is not None)

    def _digests(self):
        """This rank's parameters that other ranks hold copies of: name -> (copy group,
        digest); `None` when no rank holds another's copy."""
        if not self._holds_copies():
            return None
        digests = {}
        # The first FSDP's parameters are views of this rank's flat shard: a hybrid shard's
        # copies are the replicas' ranks at the same place in their shard groups.
        fsdp1_key = fsdp1_shard_coordinate(self.model)
        for name, p in self._named(self.model.named_parameters()):
            group = copy_group(p) if fsdp1_key is None else fsdp1_key
            if group is not None:
                digests[name] = (group, _digest(p))
        return digests

    def _compare_copies(self, step, kind, every):
        """Compares the bits of every copy of every parameter across the ranks holding it (a
        replicated tensor on every rank, an HSDP shard across its replicate group, a stage
        across pipeline replicas), from every rank's digests (rank 0; a rank's `None`: not
        compared at this step); keeps the first mismatch, naming the tensor, the copy and
        the ranks on each side."""
        if "mismatch" in self.cross_rank or any(d is None for d in every):
            return
        for name in sorted(set().union(*every)):
            groups = {}
            for rank, held in enumerate(every):
                if name in held:
                    groups.setdefault(held[name][0], []).append(rank)
            for group, holders in groups.items():
                if len(holders) < 2:
                    continue
                self.cross_rank["compared"] += 1
                base = every[holders[0]][name][1]
                differing = [r for r in holders if every[r][name][1] != base]
                if differing:
                    self.cross_rank["mismatch"] = {
                        "step": max(step - 1, 0) if kind == "param" else step,
                        "kind": kind,
                        "name": name,
                        "coord": ",".join(f"{d}={c}" for d, c in group),
                        "holders": holders,
                        "agreeing": [r for r in holders if r not in differing],
                        "differing": differing,
                        "sums": [base[0], every[differing[0]][name][1][0]],
                        "shapes": [],
                    }
                    return

    def finish(self):
        """After the last step: records every full parameter and buffer, compares the final
        copies, and writes `record.json` (rank 0), in one gather and a barrier."""
        if self.finished:
            raise RecordError("finish() called twice")
        self.finished = True
        steps = len(self.losses)
        if self.declared_steps is not None and steps != self.declared_steps:
            raise RecordError(f"{steps} steps recorded, {self.declared_steps} declared")
        digests = self._digests()
        with full_view(self.model):
            params = self._named(self.model.named_parameters())
            buffers = [(f"\0{n}", t) for n, t in self._named(self.model.named_buffers())]
            state, _, digests = self._gathered(params + buffers, True, digests)
        if self.rank == 0:
            self._compare_copies(steps, "final", digests)
            self._write(steps, {n: t for n, t in state.items() if not n.startswith("\0")},
                        {n[1:]: t for n, t in state.items() if n.startswith("\0")})
        # No rank leaves (and tears its process group down) while rank 0 still writes.
        wait_for_every_rank(self.world)

    def _write(self, steps, params, buffers):
        """Rank 0's files: the tensor file, the record naming its tensors, and the batches
        the references train on (docs/judge.md, "The record format")."""
        self.spec["steps"] = steps
        record = {
            "spec": self.spec,
            "losses": [_number(x) for x in self.losses],
            "grad_norms": [_number(x) for x in self.grad_norms],
            "params": self._keyed("param", params),
            "buffers": self._keyed("buffer", buffers),
            "grads": self.grad_entries if self.record_grads else None,
            "grads_every": self.every,
            "tensor_file": TENSOR_FILE,
            "kind": self.kind,
            "activation_steps": sorted(self.activation_steps),
            "activations": self.output_entries,
            "output_grads": self.output_grad_entries,
            "skipped_steps": self.skipped_steps,
            "frozen": sorted(self.frozen),
            "metrics": [{**m, "value": _number(m["value"])} for m in self.metrics],
        }
        if self.scaler is not None:
            record["loss_scales"] = self.loss_scales
        if self.kind == "run":
            record["data"] = self.data_checks.findings
            record["optimizer_start"] = self.optimizer_start
            record["binding"] = {
                "init": self.init_digest,
                "batches": self.batch_digests if self.keep_batches else None,
                "config": digest_config(self.spec),
            }
        else:
            record["trained_from"] = self.trained_from
        if self.widened_casts:
            record["widened_casts"] = self.widened_casts
        if self._holds_copies():
            record["cross_rank"] = self.cross_rank
        if self.keep_batches:
            torch.save(self.batches, self.out / "batches.pt")
            if self.metric_batches:
                torch.save(self.metric_batches, self.out / metrics.FILE)
        self.writer.close()
        write_json_atomically(self.out / "record.json", record)


class Contribution(NamedTuple):
    """What each rank brings to rank 0 at a step besides its gradients' parts."""

    replica: int
    digests: Optional[dict]
    loss: Optional[float]
    batch: Optional[tuple]
    outputs: list
    output_grads: list
    samples: Optional[list]
