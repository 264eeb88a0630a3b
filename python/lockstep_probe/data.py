"""The recorder's data checks: the references train on the batches the ranks received, so a
job fed the wrong data matches them, and only the data itself shows it.

Which ranks must receive different batches is found from what they hold: ranks holding the
same slices of every parameter are data-parallel replicas (DDP's ranks, FSDP's, whose shards
are gathered whole before they compute), while ranks holding different slices outside
FSDP's sharding (tensor or expert parallelism) are not, and may share a batch."""

import gc
import hashlib
from typing import NamedTuple

import torch

from .tensor_file import raw_bytes


def _model_parallel_specs(model):
    """The sharding each FSDP2-managed parameter had before FSDP sharded it (a TP DTensor's
    spec, `None` for a plain parameter), by the id of the parameter FSDP holds: FSDP's own
    sharding is data parallelism and does not count."""
    specs = {}
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
        for fsdp_param in getattr(group, "fsdp_params", None) or []:
            spec = (getattr(fsdp_param, "_unsharded_dtensor_spec", None)
                    or getattr(fsdp_param, "_tp_spec", None))
            specs[id(fsdp_param.sharded_param)] = spec
    return specs


def _slice_held(mesh, placements):
    """Which slice of a DTensor this rank holds, as (mesh dimension, coordinate) pairs over
    the dimensions it is sharded on (`None`: this rank is outside its mesh)."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    return tuple((names[d], coordinate[d]) for d, p in enumerate(placements)
                 if type(p).__name__ != "Replicate")


def replica_key(model, fsdp1):
    """What this rank holds of `model`, as a key its data-parallel replicas share: the slice
    of every sharded parameter outside FSDP's sharding, and the bytes of every plain one (a
    hand-sharded layer's local parts differ across ranks; DDP's replicas start identical).
    Under the first FSDP (`fsdp1`), whose flat shards are FSDP's own, every rank is one."""
    if fsdp1:
        return ()
    fsdp_specs = _model_parallel_specs(model)
    slices, plain = set(), hashlib.sha1()
    for _, p in model.named_parameters():
        if id(p) in fsdp_specs:
            spec = fsdp_specs[id(p)]
            held = None if spec is None else _slice_held(spec.mesh, spec.placements)
        elif hasattr(p, "placements"):
            held = _slice_held(p.device_mesh, p.placements)
        else:
            plain.update(raw_bytes(p.detach()))
            continue
        if held:
            slices.add(held)
    return tuple(sorted(slices)), plain.hexdigest()


def replica_groups(keys):
    """The ranks, grouped by the key they hold (`replica_key`), each group in rank order:
    each group's ranks are data-parallel replicas of one another."""
    groups = {}
    for rank, key in enumerate(keys):
        groups.setdefault(key, []).append(rank)
    return sorted(groups.values())


def shared_batch_group(replicated_data, rank, world):
    """The ranks that receive this rank's batch on purpose, as `Recorder(replicated_data=...)`
    says: `True` every rank, a 1-D `DeviceMesh` (or a process group) the ranks of this rank's
    group in it (context parallelism's `cp` mesh, whose ranks each compute a part of one
    batch's sequence), `False` this rank alone."""
    if replicated_data is True:
        return tuple(range(world))
    if replicated_data is False or replicated_data is None:
        return (rank,)
    import torch.distributed as dist

    group = replicated_data
    if hasattr(group, "get_group"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError("replicated_data= takes a 1-D DeviceMesh (the dimension whose "
                             f"ranks share a batch), not one of {group.ndim} dimensions")
        group = group.get_group()
    return tuple(sorted(dist.get_process_group_ranks(group)))


class EpochIndices(NamedTuple):
    """One rank's sampler's sample indices of an epoch, as it sends them to rank 0."""

    slot: int
    epoch: int
    dataset: int
    total: int
    drop_last: bool
    indices: torch.Tensor


class SamplerWatch:
    """This rank's `DistributedSampler`s (found alive at the first step, ordered by their
    dataset's length), and the epoch of each whose indices it sent last: each epoch's
    indices travel to rank 0 once, when the sampler's epoch changes (`set_epoch`)."""

    def __init__(self):
        self.samplers, self.sent = None, []

    def news(self):
        """The indices of every sampler whose epoch this rank has not sent yet."""
        if self.samplers is None:
            from torch.utils.data.distributed import DistributedSampler

            # type(), not isinstance: a dead weak proxy among them (torch.compile keeps some)
            # raises on any attribute lookup.
            found = [o for o in gc.get_objects() if issubclass(type(o), DistributedSampler)]
            self.samplers = sorted(found, key=lambda s: (len(s.dataset), s.num_replicas))
            self.sent = [None] * len(self.samplers)
        news = []
        for slot, sampler in enumerate(self.samplers):
            if self.sent[slot] == sampler.epoch:
                continue
            self.sent[slot] = sampler.epoch
            news.append(EpochIndices(slot, sampler.epoch, len(sampler.dataset),
                                     sampler.total_size, sampler.drop_last,
                                     torch.tensor(list(iter(sampler)), dtype=torch.int64)))
        return news


class DataChecks:
    """The data checks of a run, step by step on rank 0 (docs/judge.md, "Data checks"): the
    same batch on data-parallel replicas that do not share it on purpose, a batch repeating
    an earlier step's, and a batch that differs across ranks said to share it
    (`replicated_data=`). One finding of each kind at most, in the order found."""

    def __init__(self, stages, groups, shared):
        self.stages = stages
        # Every rank's replica group (under `stages`: none), and the ranks said to share
        # each rank's batch (`shared_batch_group`), by rank.
        self.groups, self.shared = groups, shared
        self.findings, self.seen = [], {}
        # Every rank's latest epoch indices of each sampler slot: {rank: {slot: EpochIndices}}.
        self.latest = {}

    def _kinds(self):
        return {f["kind"] for f in self.findings}

    def _add(self, kind, step, text):
        if kind not in self._kinds():
            self.findings.append({"kind": kind, "step": step, "text": text})

    def _name(self, rank):
        """How a finding names an entry of the step's batches: a pipeline replica, or a rank
        by its place among its data-parallel replicas (and its global rank where they
        differ)."""
        if self.stages:
            return f"pipeline replica {rank}"
        group = self.group_of(rank)
        if group is None:
            return f"data-parallel rank {rank}"
        group = self._representatives(group)
        place = group.index(rank) if rank in group else 0
        return f"data-parallel rank {place}" + (f" (rank {rank})" if place != rank else "")

    def group_of(self, rank):
        """`rank`'s group of data-parallel replicas (`None` when the groups are not known:
        a pipeline, a single process, a rank other than 0)."""
        return next((g for g in self.groups if rank in g), None)

    def _representatives(self, group):
        """`group`'s ranks, one for each set of ranks said to share a batch (the first)."""
        return [r for r in group if r == min(r2 for r2 in self.shared[r] if r2 in group)]

    def check(self, step, digests):
        """One step's checks, from the digest of every entry's batch (every rank's, or under
        `stages` every pipeline replica's)."""
        self._same_batch(step, digests)
        if not self.stages:
            self._shared_batches(step, digests)
        for r, d in enumerate(digests):
            earlier = self.seen.get(d)
            if earlier is not None:
                self._add("repeated_batch", step,
                          f"{self._name(r)}'s batch at step {step} repeats the batch of step "
                          f"{earlier[0]} ({self._name(earlier[1])}): the data loader does "
                          "not advance")
        for r, d in enumerate(digests):
            self.seen.setdefault(d, (step, r))

    def _shared_batches(self, step, digests):
        """Ranks said to share a batch (`replicated_data=`) must have received the same."""
        for group in sorted(set(self.shared)):
            differing = [r for r in group if digests[r] != digests[group[0]]]
            if differing:
                ranks = "every rank receives" if len(group) == len(digests) else \
                    "ranks " + ", ".join(map(str, group)) + " receive"
                self._add("unreplicated_batch", step,
                          f"Recorder(replicated_data=...) says {ranks} the same "
                          f"batch, but rank {differing[0]}'s batch at step {step} differs from "
                          f"rank {group[0]}'s: ranks that split a layer (tensor parallelism) "
                          "or a sequence (context parallelism) must compute on the same data")
                return

    def check_samples(self, step, news):
        """The sample-level check, from every rank's new epoch indices at this step (`news`,
        in rank order): within each group of data-parallel replicas, each sampler's ranks
        must split its dataset, every sample to exactly one rank in an epoch (up to the
        padding a `DistributedSampler` adds, or the tail `drop_last` drops)."""
        for rank, ranks_news in enumerate(news):
            for n in ranks_news or []:
                self.latest.setdefault(rank, {})[n.slot] = n
        if self.stages or not any(news):
            return
        for group in self.groups:
            if len(group) < 2:
                continue
            slots = set.intersection(*(set(self.latest.get(r, {})) for r in group))
            group = self._representatives(group)
            for slot in sorted(slots):
                if len(group) > 1:
                    self._split(step, [self.latest[r][slot] for r in group], group)

    def _split(self, step, epochs, group):
        """One sampler slot's indices on `group`'s ranks: a finding when they overlap or
        leave samples out beyond what padding and `drop_last` allow."""
        size, total, drop_last = epochs[0].dataset, epochs[0].total, epochs[0].drop_last
        counts = torch.bincount(torch.cat([e.indices for e in epochs]).clamp(0, size - 1),
                                minlength=size)
        repeated = int((counts - 1).clamp(min=0).sum())
        missing = int((counts == 0).sum())
        allowed_repeats = 0 if drop_last else max(total - size, 0)
        allowed_missing = max(size - total, 0) if drop_last else 0
        if repeated <= allowed_repeats and missing <= allowed_missing:
            return
        ranks = ", ".join(map(str, group))
        epoch_text = ", ".join(sorted({str(e.epoch) for e in epochs}))
        self._add("samples", step,
                  f"the data-parallel ranks {ranks} do not split the data between them in "
                  f"epoch {epoch_text} (seen at step {step}): of the {size} samples of their "
                  f"DistributedSampler's dataset, {repeated} more go to a rank than once and "
                  f"{missing} go to none: every rank's sampler must have the same seed and "
                  "shuffle, num_replicas the data-parallel size, rank its data-parallel rank, "
                  "and set_epoch called on every rank")

    def _same_batch(self, step, digests):
        """Every pipeline replica, or every data-parallel replica of some slice of the
        weights (one for each set said to share a batch), receiving the same batch."""
        if self.stages:
            groups = [list(range(len(digests)))]
        else:
            groups = [self._representatives(g) for g in self.groups]
        for group in groups:
            if len(group) < 2 or len({digests[r] for r in group}) != 1:
                continue
            if self.stages:
                who = f"every pipeline replica received the same batch at step {step} " \
                      f"({len(group)} of them)"
            elif len(group) == len(digests):
                who = f"every data-parallel rank received the same batch at step {step} " \
                      f"({len(group)} of them, holding the same slices of every parameter)"
            else:
                ranks = ", ".join(map(str, group))
                who = f"the data-parallel ranks {ranks} (holding the same slices of every " \
                      f"parameter) received the same batch at step {step}"
            self._add("same_batch", step,
                      f"{who}: a data loader without a DistributedSampler (or indexed by the "
                      "wrong rank) trains every replica on the same data; ranks that split "
                      "the weights (tensor parallelism) may share a batch and are told apart "
                      "by what they hold, and ranks that split a sequence (context "
                      "parallelism) say so with Recorder(replicated_data=cp_mesh)")
            return
