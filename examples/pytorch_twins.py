"""The PyTorch twins of Lockstep's zoo models: module trees whose `state_dict()` keys, shapes
and dtypes are exactly those of `lockstep run --save-init`, so a state dict moves between
Lockstep and PyTorch unchanged (docs/checkpoints.md).

Needs only torch (no `safetensors` package): the safetensors files are read and written
here by hand. Used by tests/run_cli.rs when a Python with torch is available:

    python3 examples/pytorch_twins.py check DIR   # strict-load DIR/<model>.lockstep.safetensors
    python3 examples/pytorch_twins.py write DIR   # write DIR/<model>.torch.safetensors
    python3 examples/pytorch_twins.py train DIR   # DIR/<model>.init + .batches -> .trained
    python3 examples/pytorch_twins.py ce DIR      # DIR/ce.inputs -> DIR/ce.torch.<rank>

`train` is the proof that Lockstep's single-device reference is PyTorch's arithmetic
(tests/pytorch_twins.rs): from Lockstep's initial state and Lockstep's batches it trains each
twin with `torch.optim.SGD(lr=0.01, momentum=0.9)` on one thread, the objective being what
Lockstep's reference computes (each rank's loss in rank order, summed, divided by the world
size), and writes the per-step losses and the final parameters for a bitwise comparison.
"""

import json
import math
import struct
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F


# --- the twins ---------------------------------------------------------------------------


class NestedWrappedModule(nn.Module):
    """`nested`: loss `output.sum()` on rand(4, 8) batches."""

    def __init__(self):
        super().__init__()
        self.module = nn.Sequential(
            nn.Linear(8, 4),
            nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16)),
            nn.Linear(16, 4),
            nn.Linear(4, 8),
        )

    def forward(self, x):
        return self.module(x)

    def loss(self, batch):
        (x,), _ = batch
        return self(x).sum()


class MixtureOfExperts(nn.Module):
    """`moe`: `module.2` is the per-rank expert (drawn from seed 42 + rank, never averaged)."""

    def __init__(self):
        super().__init__()
        self.module = nn.Sequential(
            nn.Linear(8, 12), nn.Linear(12, 23), nn.Linear(23, 12), nn.Linear(12, 8)
        )

    def forward(self, x):
        return self.module(x)


class MlpStack(nn.Module):
    """`mlp`: uneven widths 7 -> 15 -> 16 -> 17 -> 3, summed squared error."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(7, 15), nn.ReLU(),
            nn.Linear(15, 16), nn.ReLU(),
            nn.Linear(16, 17), nn.ReLU(),
            nn.Linear(17, 3),
        )

    def forward(self, x):
        return self.layers(x)

    def loss(self, batch):
        (x,), target = batch
        return F.mse_loss(self(x), target, reduction="sum")


class TransformerWithSharedParams(nn.Module):
    """`transformer` (and `transformer_bn` with batch_norm=True): the output projection's
    weight is the embedding's."""

    def __init__(self, batch_norm=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(23, 16)
        self.transformer = nn.Transformer(
            d_model=16, num_encoder_layers=2, num_decoder_layers=2,
            dim_feedforward=8, dropout=0.0,
        )
        self.output_proj = nn.Linear(16, 23)
        self.output_proj.weight = self.embed_tokens.weight
        self.register_buffer("vocab_bias", torch.ones(16))
        self.register_buffer("long_buffer", torch.zeros(16, dtype=torch.long))
        self.bn = nn.BatchNorm1d(2) if batch_norm else nn.Identity()

    def forward(self, src_ids, tgt_ids):
        """PyTorch's `TransformerWithSharedParams.forward` (FSDP's test models)."""
        src = self.embed_tokens(src_ids)
        src = src + self.vocab_bias + self.long_buffer.type_as(src)
        tgt = self.embed_tokens(tgt_ids)
        tgt = self.bn(tgt)
        x = self.transformer(src, tgt)
        return self.output_proj(x)

    def loss(self, batch):
        """PyTorch's `get_loss`: cross-entropy summed over the target tokens."""
        (src, tgt), _ = batch
        output = self(src, tgt)
        return F.cross_entropy(output.view(-1, output.size(-1)), tgt.view(-1), reduction="sum")


class FeedForward(nn.Module):
    """`w2(gelu(w1(x)))`: the dense feed-forward and each expert."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Attention(nn.Module):
    def __init__(self, dim, heads=4):
        super().__init__()
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x):
        """Causal attention written out (nanoGPT's non-flash path): scores scaled after
        the product, the future masked with -inf, softmax, weighted sum of values."""
        b, t, dim = x.shape
        hd = dim // self.heads
        q = self.wq(x).view(b, t, self.heads, hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.heads, hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.heads, hd).transpose(1, 2)
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        out = (probs @ v).transpose(1, 2).contiguous().view(b, t, dim)
        return self.wo(out)


class MoE(nn.Module):
    """Top-2 of 8 experts, gates renormalized over the chosen two."""

    def __init__(self, dim, experts=8, hidden=32):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(dim, hidden) for _ in range(experts))

    def forward(self, x, top_k=2):
        """Dense top-k mixture: every expert runs on every token and is weighted by its gate
        (0 unless chosen), experts summed in index order."""
        probs = self.router(x).softmax(-1)
        top, idx = probs.topk(top_k, -1)
        top = top / top.sum(-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(-1, idx, top)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + expert(x) * gates.narrow(-1, e, 1)
        return out


class Block(nn.Module):
    """Pre-norm: x + attention(attention_norm(x)), then x + ffn(ffn_norm(x))."""

    def __init__(self, dim, moe):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim)
        self.ffn_norm = nn.LayerNorm(dim)
        if moe:
            self.moe = MoE(dim)
        else:
            self.feed_forward = FeedForward(dim, 4 * dim)

    def forward(self, h):
        h = h + self.attention(self.attention_norm(h))
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Gpt(nn.Module):
    """`gpt`, `gpt_moe` (moe=True) and `gpt_dropout` (same tree, dropout 0.1): vocab 8,
    dim 16, 4 heads, 2 layers, 8 positions; `output` is tied to `tok_embeddings`."""

    def __init__(self, moe=False, vocab=8, dim=16, layers=2, seq=8):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(Block(dim, moe) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight
        self.vocab = vocab

    def forward(self, tokens):
        t = tokens.size(1)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(t))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def loss(self, batch):
        (tokens,), target = batch
        output = self(tokens)
        return F.cross_entropy(output.view(-1, self.vocab), target.reshape(-1))


TWINS = {
    "nested": NestedWrappedModule,
    "moe": MixtureOfExperts,
    "mlp": MlpStack,
    "transformer": lambda: TransformerWithSharedParams(batch_norm=False),
    "transformer_bn": lambda: TransformerWithSharedParams(batch_norm=True),
    "gpt": lambda: Gpt(moe=False),
    "gpt_moe": lambda: Gpt(moe=True),
    "gpt_dropout": lambda: Gpt(moe=False),
}


# --- safetensors without the safetensors package ------------------------------------------

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
    "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
CODES = {v: k for k, v in DTYPES.items()}


def read_safetensors(path):
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n:]
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        flat = torch.frombuffer(bytearray(data[begin:end]), dtype=DTYPES[entry["dtype"]])
        out[name] = flat.reshape(entry["shape"])
    return out


def write_safetensors(path, tensors):
    header, chunks, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = bytes(t.reshape(-1).view(torch.uint8).tolist())
        header[name] = {"dtype": CODES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks))


# --- commands ------------------------------------------------------------------------------


def check(directory):
    """Strict-loads every `<model>.lockstep.safetensors` into its twin; keys, shapes and
    dtypes must all match (load_state_dict checks keys and shapes, dtypes are compared)."""
    bad = []
    for name, make in TWINS.items():
        path = Path(directory) / f"{name}.lockstep.safetensors"
        if not path.exists():
            continue
        twin = make()
        tensors = read_safetensors(path)
        expected = twin.state_dict()
        for key, t in tensors.items():
            if key in expected and expected[key].dtype != t.dtype:
                bad.append(f"{name}: {key}: twin {expected[key].dtype}, file {t.dtype}")
        try:
            twin.load_state_dict(tensors, strict=True)
        except RuntimeError as e:
            bad.append(f"{name}: {e}")
            continue
        for key, t in twin.state_dict().items():
            if not torch.equal(t, tensors[key]):
                bad.append(f"{name}: {key} changed on load")
        print(f"{name}: {len(tensors)} tensors load into the twin")
    if bad:
        print("\n".join(bad), file=sys.stderr)
        sys.exit(1)


def write(directory):
    """Writes each twin's freshly initialized `state_dict()` (seed 1234) as
    `<model>.torch.safetensors`: a checkpoint as a user's PyTorch code would leave it."""
    for name, make in TWINS.items():
        torch.manual_seed(1234)
        twin = make()
        write_safetensors(Path(directory) / f"{name}.torch.safetensors", twin.state_dict())
        print(f"{name}: written")


def batches_of(tensors, step, rank):
    """Rank `rank`'s batch at `step` from Lockstep's batches file: (inputs, target)."""
    prefix = f"{step}.{rank}."
    inputs, k = [], 0
    while f"{prefix}input.{k}" in tensors:
        inputs.append(tensors[f"{prefix}input.{k}"])
        k += 1
    return inputs, tensors.get(f"{prefix}target")


def train(directory):
    """For every `<run>.init.safetensors` (Lockstep's initial state; `<run>` is a model name,
    optionally `+adam`) with its `<run>.batches.safetensors` (`<step>.<rank>.input.<k>`,
    `<step>.<rank>.target`, `steps`, `world_size`, and `adam_lr` for an Adam run), trains
    the twin as Lockstep's single-device reference does and writes
    `<run>.trained.safetensors`: `losses` (float32, one per step) and every parameter after
    the last step, under the state dict's names. The optimizer is `torch.optim.SGD(lr=0.01,
    momentum=0.9)` (Lockstep's default), or `torch.optim.Adam(lr=adam_lr)` with its default
    betas and eps; both take their single-tensor path on CPU."""
    torch.set_num_threads(1)
    for init in sorted(Path(directory).glob("*.init.safetensors")):
        run = init.name[: -len(".init.safetensors")]
        twin = TWINS[run.split("+")[0]]()
        twin.load_state_dict(read_safetensors(init), strict=True)
        twin.train()
        data = read_safetensors(Path(directory) / f"{run}.batches.safetensors")
        steps, world = int(data["steps"]), int(data["world_size"])
        if "adam_lr" in data:
            opt = torch.optim.Adam(twin.parameters(), lr=float(data["adam_lr"]))
        else:
            opt = torch.optim.SGD(twin.parameters(), lr=0.01, momentum=0.9)
        losses = []
        for step in range(steps):
            opt.zero_grad()
            total = twin.loss(batches_of(data, step, 0))
            for rank in range(1, world):
                total = total + twin.loss(batches_of(data, step, rank))
            objective = total / world
            objective.backward()
            losses.append(objective.detach().clone())
            opt.step()
        out = {"losses": torch.stack(losses)}
        out.update((k, p.detach()) for k, p in twin.named_parameters())
        write_safetensors(Path(directory) / f"{run}.trained.safetensors", out)
        print(f"{run}: trained {steps} steps")


def _ce_rank(rank, world, directory, store_path):
    """One rank of `ce`: PyTorch's own `loss_parallel` on this rank's vocabulary shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        data = read_safetensors(Path(directory) / "ce.inputs.safetensors")
        logits, target = data["logits"], data["target"]
        scale = float(data["scale"])
        width = logits.size(1) // world
        local = logits[:, rank * width:(rank + 1) * width].clone().requires_grad_(True)
        mesh = init_device_mesh("cpu", (world,))
        out = {}
        for reduction in ("mean", "sum"):
            local.grad = None
            sharded = DTensor.from_local(local, mesh, [Shard(1)], run_check=False)
            with loss_parallel():
                loss = F.cross_entropy(sharded, target, reduction=reduction)
                (loss * scale).backward()
            out[f"{reduction}.loss"] = loss.to_local().detach().clone()
            out[f"{reduction}.grad"] = local.grad.detach().clone()
        write_safetensors(Path(directory) / f"ce.torch.{rank}.safetensors", out)
        # No rank tears gloo down while a peer's last collective is still in flight: that
        # aborts the peer ("terminate called without an active exception") under load.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def ce(directory):
    """Runs PyTorch's vocabulary-parallel cross-entropy (`loss_parallel`) on
    `ce.inputs.safetensors` (`logits` [N, V], `target` [N], `world`, `scale`) over `world`
    gloo ranks, each taking its `V/world` columns; rank r writes `ce.torch.<r>.safetensors`
    with, per reduction (`mean`, `sum`), the loss and its shard's gradient of `loss·scale`."""
    import tempfile
    import torch.multiprocessing as mp

    data = read_safetensors(Path(directory) / "ce.inputs.safetensors")
    world = int(data["world"])
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_ce_rank, args=(world, directory, str(Path(tmp) / "store")), nprocs=world)


if __name__ == "__main__":
    commands = {"check": check, "write": write, "train": train, "ce": ce}
    if len(sys.argv) != 3 or sys.argv[1] not in commands:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    commands[sys.argv[1]](sys.argv[2])
