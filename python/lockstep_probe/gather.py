"""How the recorder brings a step's tensors to rank 0: in one gather, not one collective per
tensor. A DTensor travels as this rank's local part and its offset in the whole tensor (rank
0 puts the parts in place), a plain tensor whole from the one rank that sends it; each part
carries its sum of squares, so the gradient norm needs no tensor to travel on the steps whose
gradients are not recorded. Gathered to rank 0 only: no other rank holds the world's tensors."""

import copyreg
import io
import pickle
import sys
import time
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .tensor_file import raw_bytes


def comm_device():
    """Where the recorder's own collectives keep their tensors: the current GPU under NCCL
    (which moves only CUDA tensors), the CPU under gloo or without a process group."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _released(tensors, baselines, limit_seconds=2.0):
    """Waits, the GIL released, until gloo's worker threads have let go of `tensors` (their
    Python reference counts back to `baselines`, taken before the collective), for at most
    `limit_seconds`.

    A collective's work outlives its `wait()` on a gloo worker thread, and releasing it
    releases its tensors through Python, which needs the GIL. Should the job's main thread,
    holding the GIL, tear the process group down (DDP's reducer dropping it at exit) while a
    worker still holds such a work, it waits for that worker forever: seen as DDP jobs hanging
    at exit after their record was complete, once recording got fast (gdb: `runLoop` in
    `take_gil` under `~AsyncWork`, the main thread in `~ProcessGroupGloo` joining it)."""
    deadline = time.monotonic() + limit_seconds
    while _references(tensors) != baselines:
        if time.monotonic() > deadline:
            return
        time.sleep(0.0002)


def _references(tensors):
    """Each tensor's Python reference count, counted alike before and after a collective."""
    return [sys.getrefcount(t) for t in tensors]


def _collective(run, *tensors):
    """`run()`, a collective on `tensors`, returning once it is done and, under gloo, its work
    has let go of them (`_released`; NCCL's works are released by its watchdog thread, which
    takes no part in tearing the group down)."""
    if dist.get_backend() != "gloo":
        run()
        return
    baselines = _references(tensors)
    run()
    _released(tensors, baselines)


def wait_for_every_rank(world):
    """Returns once every rank has called it (an all-reduce of one number)."""
    if world == 1:
        return
    token = torch.zeros(1, device=comm_device())
    _collective(lambda: dist.all_reduce(token), token)


def _rebuilt(dtype, shape, data):
    """A tensor `_packed` sent: its elements read back from their bytes."""
    dtype = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def _packed(t):
    """How a plain tensor travels in a gather: its dtype, shape and memory as bytes (torch's
    own pickling costs about 0.1 ms a small tensor each way, more than the step's gathering
    of a small model's gradients and module outputs)."""
    return _rebuilt, (str(t.dtype).removeprefix("torch."), tuple(t.shape), raw_bytes(t))


class _TensorPickler(pickle.Pickler):
    """A pickler that sends plain tensors as their bytes (`_packed`)."""

    dispatch_table = copyreg.dispatch_table.copy()
    dispatch_table[torch.Tensor] = _packed


def _dumps(obj):
    buffer = io.BytesIO()
    _TensorPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def gather_to_root(obj, world):
    """`obj` of every rank, in rank order, on rank 0 (`None` on the others): its sizes, then
    its pickled bytes padded to the largest, two collectives in all (torch's
    `gather_object` needs NumPy, which a job need not have)."""
    if world == 1:
        return [obj]
    device = comm_device()
    data = _dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    _collective(lambda: dist.all_gather(sizes, size), size, *sizes)
    sizes = [int(n.item()) for n in sizes]
    mine = torch.zeros(max(sizes), dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    root = dist.get_rank() == 0
    every = ([torch.zeros(max(sizes), dtype=torch.uint8, device=device) for _ in range(world)]
             if root else None)
    mine = mine.to(device)
    _collective(lambda: dist.gather(mine, every, dst=0), mine, *(every or []))
    if not root:
        return None
    return [pickle.loads(raw_bytes(t[:n])) for t, n in zip(every, sizes)]


class Part(NamedTuple):
    """One rank's piece of a named tensor: the whole tensor's shape, where the piece starts in
    it (`None`: the piece is the whole tensor), the piece's sum of squares in float64, and the
    piece itself on the CPU (`None` when only its square travels)."""

    name: str
    shape: tuple
    offset: Optional[tuple]
    square: float
    tensor: Optional[torch.Tensor]


def _placement_classes():
    """DTensor's `Shard` and `Replicate` and the function that places a local shard, or
    `None` where this torch lacks them (every DTensor is then gathered whole)."""
    try:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        return None
    return Shard, Replicate, compute_local_shape_and_global_offset


PLACEMENTS = _placement_classes()


def _square(t):
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)  # a rotary cache, say: its parts' squares
    return float(t.double().pow(2).sum())


def _host(t):
    return t.detach().to("cpu").clone()


def _placed_part(name, t, keep):
    """A DTensor sharded only by `Shard` and `Replicate` (FSDP2, HSDP, TP): this rank's local
    part at its offset, or `None` for a rank the part need not come from (one whose
    coordinate on a replicated mesh dimension is not 0: another rank sends the same bits;
    a rank outside the mesh). `False`: the placements are of another kind (strided or partial
    shards), and the tensor is gathered whole."""
    if PLACEMENTS is None:
        return False
    shard, replicate, place = PLACEMENTS
    placements = t.placements
    if any(type(p) not in (shard, replicate) for p in placements):
        return False
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    if any(type(p) is replicate and coordinate[d] != 0 for d, p in enumerate(placements)):
        return None
    local = t.to_local()
    local_shape, offset = place(t.shape, t.device_mesh, placements)
    if tuple(local_shape) != tuple(local.shape):
        raise ValueError(f"`{name}`: its local shard is {list(local.shape)}, its placements "
                         f"{list(placements)} give {list(local_shape)}")
    return Part(name, tuple(t.shape), tuple(offset), _square(local),
                _host(local) if keep else None)


def parts_of(named, *, sends_whole, keep):
    """This rank's parts of the `(name, tensor)` pairs, to gather to rank 0: DTensors' local
    parts (a DTensor of other placements gathered whole here, a collective every rank
    calls in the same order), plain tensors whole when `sends_whole` (the rank whose copy
    the record takes); `keep=False` sends only their squares."""
    parts = []
    for name, t in named:
        if getattr(t, "placements", None) is not None:
            part = _placed_part(name, t, keep)
            if part is not False:
                if part is not None:
                    parts.append(part)
                continue
            t = t.full_tensor()
        if sends_whole:
            parts.append(Part(name, tuple(t.shape), None, _square(t), _host(t) if keep else None))
    return parts


def assemble(every_rank_parts):
    """Rank 0's view of the gathered parts: the whole tensors (name -> tensor, in the order
    first seen, for the parts that carried theirs) and every tensor's sum of squares. A piece
    sent twice (a replica's copy, a weight tied across stages) counts once: the first, in
    rank order; the copy check compares the others."""
    tensors, squares, seen = {}, {}, set()
    for parts in every_rank_parts:
        for part in parts:
            key = (part.name, part.offset)
            if key in seen:
                continue
            seen.add(key)
            squares[part.name] = squares.get(part.name, 0.0) + part.square
            if part.tensor is None:
                continue
            if part.offset is None:
                tensors[part.name] = part.tensor
                continue
            whole = tensors.get(part.name)
            if whole is None:
                whole = tensors[part.name] = torch.zeros(part.shape, dtype=part.tensor.dtype)
            region = tuple(slice(o, o + n) for o, n in zip(part.offset, part.tensor.shape))
            whole[region] = part.tensor
    return tensors, squares
