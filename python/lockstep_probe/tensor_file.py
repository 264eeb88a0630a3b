"""The record's tensor file: every recorded tensor in its own dtype, in the safetensors format
(written here without the `safetensors` package, which a job need not have): an 8-byte
little-endian header length, a JSON header mapping each key to its dtype, shape and byte
range, padded with spaces to a multiple of 8, then the raw little-endian bytes."""

import json
import os
import struct
import sys
from pathlib import Path

import torch

# The safetensors dtype codes Lockstep reads, by torch dtype.
DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def raw_bytes(t):
    """`t`'s elements as bytes, row-major, on the CPU (a compact copy of its own storage)."""
    host = t.detach().to("cpu").contiguous().clone()
    return bytes(host.untyped_storage())


def write_tensor_file(path, tensors):
    """Writes `tensors` (key -> tensor, in order) to `path` through a temporary file, so a
    reader never sees half of one."""
    if sys.byteorder != "little":
        raise OSError("the safetensors format is little-endian; this host is not")
    header, blobs, offset = {}, [], 0
    for key, t in tensors.items():
        data = raw_bytes(t)
        header[key] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "lockstep-record"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in blobs:
            f.write(data)
    os.replace(tmp, path)
