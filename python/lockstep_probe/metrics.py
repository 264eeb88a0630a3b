"""Evaluation metrics: what a job reports between its training steps (an evaluation loss, an
accuracy) can be wrong while its training is right (Hugging Face transformers PR #48167: the
evaluation loss under context parallelism reported as `cp_size` times the true one). The
recorder keeps each reported value with every rank's evaluation batch; the references
compute the same metric on the same batches from their own state at that point; the judge
holds the reported value to the arbiter's envelope.

A point is `(name, after)`: the metric `name` reported after `after` training steps (0:
before the first)."""

import torch

FILE = "metric_batches.pt"


class MetricError(ValueError):
    """A metric reported or computed as the record cannot hold it."""


def reported_value(name, value):
    """The job's reported value as a float (a tensor of one element, or a number)."""
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise MetricError(f"metric `{name}`: a scalar, not a tensor of shape "
                              f"{list(value.shape)}")
        value = float(value.detach().double().cpu())
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise MetricError(f"metric `{name}`: {value!r} is not a number") from e


def evaluate(model, fn, ranks, dtype, device, placed):
    """A reference's value of a metric: `fn(model, *batch)` on every rank's evaluation
    batch in rank order, without gradients and in eval mode (the job evaluates so), averaged
    over the ranks as the job's reported value averages them; the model's training mode is
    restored."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            values = [reported_value("reference", fn(model, *placed(b, dtype, device)))
                      for b in ranks]
    finally:
        model.train(was_training)
    return sum(values) / len(values)
