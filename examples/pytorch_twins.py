"""The PyTorch twins of Lockstep's zoo models: module trees whose `state_dict()` keys, shapes
and dtypes are exactly those of `lockstep run --save-init`, so a state dict moves between
Lockstep and PyTorch unchanged (docs/checkpoints.md).

Needs only torch (no `safetensors` package): the safetensors files are read and written
here by hand. Used by tests/run_cli.rs when a Python with torch is available:

    python3 examples/pytorch_twins.py check DIR   # strict-load DIR/<model>.lockstep.safetensors
    python3 examples/pytorch_twins.py write DIR   # write DIR/<model>.torch.safetensors
"""

import json
import struct
import sys
from pathlib import Path

import torch
from torch import nn


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


class FeedForward(nn.Module):
    """`w2(gelu(w1(x)))`: the dense feed-forward and each expert."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)


class MoE(nn.Module):
    """Top-2 of 8 experts, gates renormalized over the chosen two."""

    def __init__(self, dim, experts=8, hidden=32):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(dim, hidden) for _ in range(experts))


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


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("check", "write"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    {"check": check, "write": write}[sys.argv[1]](sys.argv[2])
