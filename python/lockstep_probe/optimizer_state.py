"""A resumed job's optimizer state: the references must start from the state the job's
optimizer held when recording began (Adam's moments and step count after a checkpoint is
loaded), or their first update already differs from the job's.

The recorder finds the optimizers over the recorded model's parameters; one that already
holds state means a resumed job. Given it (`Recorder(optimizer=opt)`), the recorder saves its
state by parameter name (`optimizer.pt`, DTensor states gathered whole) and
`train_references` loads it into the references' optimizer; not given it, the record says
so and `lockstep judge` refuses the job (exit 2) rather than fail it."""

import gc

import torch

# What the record says of the optimizer's start: nothing held, saved, held but not saved.
FRESH, RECORDED, UNRECORDED = "fresh", "recorded", "unrecorded"
FILE = "optimizer.pt"


def optimizers_over(model):
    """The optimizers alive in this process that update any of `model`'s parameters."""
    params = {id(p) for p in model.parameters()}
    # type(), not isinstance: a dead weak proxy (torch.compile keeps some) raises on any
    # attribute lookup.
    return [o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)
            and any(id(p) in params for g in o.param_groups for p in g["params"])]


def start_of(model, optimizer):
    """How the job's optimizer starts (`FRESH`, `RECORDED` or `UNRECORDED`): `optimizer` is
    the one the job passed to the recorder (`None`: none was)."""
    if optimizer is not None:
        return RECORDED
    held = any(o.state for o in optimizers_over(model))
    return UNRECORDED if held else FRESH


def state_tensors(optimizer, names):
    """The optimizer's per-parameter state and its groups' settings, by parameter name:
    `(tensors, scalars, groups)`, the tensors as `(name\\0key, tensor)` pairs in one order on
    every rank (a DTensor's state is gathered whole by the caller, a collective), the other
    per-parameter values as `{name: {key: value}}`, each group's settings with its
    parameters' names. `names` maps a parameter's id to its name."""
    tensors, scalars, groups = [], {}, []
    for group in optimizer.param_groups:
        group_names = [names[id(p)] for p in group["params"] if id(p) in names]
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "names": group_names})
        for p, name in zip(group["params"], group_names):
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if torch.is_tensor(value):
                    tensors.append((f"{name}\0{key}", value))
                else:
                    scalars.setdefault(name, {})[key] = value
    return tensors, scalars, groups


def saved(tensors, scalars, groups):
    """What `optimizer.pt` holds: every parameter's state by name, and the groups."""
    state = {name: dict(values) for name, values in scalars.items()}
    for key, t in tensors.items():
        name, field = key.split("\0")
        state.setdefault(name, {})[field] = t
    return {"state": state, "groups": groups}


def resume(optimizer, model, start):
    """Loads a job's saved optimizer state (`saved`) into `optimizer` over `model` (the
    references' own, of the model's dtype): each parameter's state by name, its floating
    tensors in the parameter's dtype and on its device (Adam's step count as it was), and
    each group's settings from the job's group holding its first parameter."""
    names = {id(p): name for name, p in model.named_parameters()}
    group_of = {name: g for g in start["groups"] for name in g["names"]}
    for group in optimizer.param_groups:
        first = next((names[id(p)] for p in group["params"] if id(p) in names), None)
        source = group_of.get(first)
        if source is not None:
            group.update({k: v for k, v in source.items() if k != "names"})
    for name, p in model.named_parameters():
        state = start["state"].get(name)
        if state is None:
            continue
        optimizer.state[p] = {
            key: (value.to(p.device, p.dtype) if torch.is_tensor(value)
                  and value.is_floating_point() and value.dim() > 0
                  else value.clone() if torch.is_tensor(value) else value)
            for key, value in state.items()}
