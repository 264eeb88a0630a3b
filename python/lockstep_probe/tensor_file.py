"""The record's tensor file: every recorded tensor in its own dtype, in the safetensors format
(written here without the `safetensors` package, which a job need not have): an 8-byte
little-endian header length, a JSON header mapping each key to its dtype, shape and byte
range, padded with spaces to a multiple of 8, then the raw little-endian bytes."""

import ctypes
import json
import os
import queue
import shutil
import struct
import sys
import threading
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
    """`t`'s elements as bytes, row-major, as the CPU holds them: one copy of its memory (a
    storage converted with `bytes()` is read element by element, milliseconds per kilobyte)."""
    host = t.detach().to("cpu").contiguous()
    if host.nbytes == 0:
        return b""
    return ctypes.string_at(host.data_ptr(), host.nbytes)


def _header_bytes(header):
    """The safetensors header: its JSON padded with spaces to a multiple of 8."""
    header = dict(header)
    header["__metadata__"] = {"format": "lockstep-record"}
    text = json.dumps(header).encode()
    return text + b" " * (-len(text) % 8)


def _check_byte_order():
    if sys.byteorder != "little":
        raise OSError("the safetensors format is little-endian; this host is not")


class TensorFileWriter:
    """A tensor file written as its tensors come: a background thread writes their bytes to
    a body file beside `path` (a step hands its gradients over and goes on; memory holds one
    step's, not the run's), and `close()` writes the header, then copies the body after it
    in large chunks."""

    def __init__(self, path):
        _check_byte_order()
        self.path = Path(path)
        self.body_path = self.path.with_name(self.path.name + ".body")
        self.body = open(self.body_path, "wb")
        self.header, self.offset, self.error = {}, 0, None
        self.queue = queue.Queue(maxsize=2)
        self.thread = threading.Thread(target=self._drain, name="lockstep-record-writer",
                                       daemon=True)
        self.thread.start()

    def add(self, key, t):
        """Queues `t` (on the CPU, not changed afterwards) under `key`; an earlier write's
        failure is raised here."""
        if self.error is not None:
            raise self.error
        if key in self.header:
            raise KeyError(f"`{key}` is in the tensor file twice")
        if t.dtype not in DTYPE_CODES:
            raise TypeError(f"`{key}` has dtype {t.dtype}, which Lockstep does not record")
        self.header[key] = None  # its place, filled when written
        self.queue.put((key, t))

    def _drain(self):
        while True:
            item = self.queue.get()
            if item is None:
                return
            if self.error is None:
                try:
                    self._write(*item)
                except Exception as e:  # raised to the recorder at its next add or close
                    self.error = e

    def _write(self, key, t):
        data = raw_bytes(t)
        self.body.write(data)
        self.header[key] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [self.offset, self.offset + len(data)]}
        self.offset += len(data)

    def close(self):
        """Writes the file at `path` (through a temporary file: a reader never sees half of
        one) and removes the body."""
        self.queue.put(None)
        self.thread.join()
        self.body.close()
        try:
            if self.error is not None:
                raise self.error
            tmp = self.path.with_name(self.path.name + ".partial")
            text = _header_bytes(self.header)
            with open(tmp, "wb") as f, open(self.body_path, "rb") as body:
                f.write(struct.pack("<Q", len(text)))
                f.write(text)
                f.flush()
                shutil.copyfileobj(body, f, 1 << 24)
            os.replace(tmp, self.path)
        finally:
            self.body_path.unlink(missing_ok=True)
