"""Record a PyTorch training job so that Lockstep judges it (`lockstep judge`).

A run directory holds `record.json` (Lockstep's `RunRecord`: per-step losses and gradient
norms, every full gradient per step, every full parameter and buffer at the end, what the
cross-rank check found) naming its tensors in `tensors.safetensors`, plus `init.pt` and
`batches.pt`, the initial state and every
rank's batches, from which `train_references` trains the single-device references on the
same start and the same global batches. See docs/judge.md.

Three lines in a training loop::

    rec = lockstep_probe.Recorder("out/run", model, name="mlp", config="fsdp2", steps=N)
    ...
        loss.backward()
        rec.step(loss, x, y)      # after backward, before optimizer.step(): loss, this rank's batch
    rec.finish()
"""

from .record import Recorder, RecordError
from .reference import ReferenceError, deterministic, train_references

__all__ = ["Recorder", "RecordError", "ReferenceError", "deterministic", "train_references"]
