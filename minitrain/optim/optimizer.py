"""Optimizer base: parameter groups, per-parameter state, zero_grad, state_dict.

State is kept per parameter as a dict of arrays shaped like the parameter (exp_avg,
momentum_buffer, ...), and every update is elementwise. That is what lets ZeRO shard it
later: build the same optimizer on flat shards of the parameters and each rank updates only
its shard. State arrays register their bytes with minitrain.memory as optimizer_state.
"""
import weakref

from .. import memory
from ..backend import array_module


def _release(tracker, keys):
    for key in keys:
        tracker.remove(key)


def as_group(group):
    """One parameter group (a dict with "params" and per-group options) with its "params" as a list
    (PyTorch takes a single tensor there too)."""
    params = group["params"]
    return {**group, "params": [params] if hasattr(params, "shape") else list(params)}


def _iterable_of_params(params, who):
    """``params`` as a list. A single tensor is refused, as PyTorch does: iterating it would give its rows,
    slices that no backward gives a gradient to, and every step would silently do nothing."""
    if hasattr(params, "shape"):
        raise TypeError(f"{who or 'optimizer'}: params should be an iterable of tensors or dicts (e.g. "
                        f"model.parameters() or [p]), got a single tensor of shape {tuple(params.shape)}")
    return list(params)


def param_groups(params, who=None):
    """Parameters, or PyTorch's parameter groups, as a list of groups (as_group); a parameter in two
    groups is refused. The optimizers that wrap one (mixed precision, ZeRO) read their arguments here too."""
    params = _iterable_of_params(params, who)
    groups = [as_group(g) for g in (params if params and isinstance(params[0], dict) else [{"params": params}])]
    seen = set()
    for q in (q for g in groups for q in g["params"]):
        if id(q) in seen:
            raise ValueError(f"{who + ': ' if who else ''}some parameters appear in more than one parameter group")
        seen.add(id(q))
    return groups


class Optimizer:
    def __init__(self, params, defaults):
        self.defaults = dict(defaults)
        params = _iterable_of_params(params, type(self).__name__)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.param_groups = []
        for group in groups:
            self.add_param_group(group)
        self.state = {}                 # parameter -> dict of state
        self._tracker = memory.tracker()
        self._keys = []
        weakref.finalize(self, _release, self._tracker, self._keys)

    def add_param_group(self, param_group):
        """Add a group of parameters (a dict with "params" and any options; the rest from the
        constructor's defaults), e.g. layers unfrozen during fine-tuning (PyTorch's method)."""
        group = {**self.defaults, **as_group(param_group)}
        param_groups(self.param_groups + [group])          # refuses a parameter already in a group
        self.param_groups.append(group)

    def _new_state(self, p, name, array):
        """Create one state array for parameter ``p`` and account its bytes."""
        self.state.setdefault(p, {})[name] = array
        key = ("optimizer_state", id(self), id(p), name)
        if not self._tracker.contains(key):
            self._tracker.add("optimizer_state", key, array.nbytes)
            self._keys.append(key)
        return array

    def zero_grad(self, set_to_none=True):
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad[...] = 0

    def step(self):
        raise NotImplementedError

    def state_dict(self):
        """{'state': {index: {name: copy}}, 'param_groups': [{..., 'params': [indices]}]} as PyTorch."""
        index, groups = {}, []
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        state = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p in self.state:
                    state[index[id(p)]] = {k: (v.copy() if hasattr(v, "copy") else v)
                                           for k, v in self.state[p].items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, self.param_groups)):
            raise ValueError("load_state_dict: parameter groups do not match this optimizer's")
        by_index = {}
        for saved, mine in zip(groups, self.param_groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
            for i, p in zip(saved["params"], mine["params"]):
                by_index[i] = p
        for i, entries in state_dict["state"].items():
            p = by_index[int(i)]
            for name, value in entries.items():
                if hasattr(value, "shape") and value.shape == p.shape:
                    self._new_state(p, name, value.astype(p.dtype, copy=True))
                else:
                    self.state.setdefault(p, {})[name] = value

    # ---- the checkpoint's view: state arrays cut as their parameters are (minitrain.sharded)
    def sharded_state_dict(self, placements):
        """This optimizer's state as logical tensors. ``placements``: id(parameter) -> [(logical name,
        Slice)], where each piece of a parameter sits in its logical tensor; a state array shaped like
        its parameter is cut by the same slices. Returns ({"<name>/<state>": [(Slice, view)]}, scalars):
        the scalars hold the class, the groups' hyper-parameters and per-parameter counters (Adam's step)."""
        tensors, per_param = {}, {}
        for group in self.param_groups:
            for p in group["params"]:
                for key, value in self.state.get(p, {}).items():
                    for name, piece in placements[id(p)]:
                        if hasattr(value, "shape") and tuple(value.shape) == tuple(p.shape):
                            tensors.setdefault(f"{name}/{key}", []).append((piece, piece.view(value)))
                        else:
                            per_param.setdefault(name, {})[key] = value
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                  for g in self.param_groups]
        return tensors, {"class": type(self).__name__, "param_groups": groups, "param_state": per_param}

    def load_sharded_state_dict(self, reader, placements, scalars):
        """The inverse of ``sharded_state_dict``: ``reader.read_into(key, slice, out)`` fills each piece
        (``reader.keys(prefix)`` lists what was saved); missing state stays missing, as before a first step."""
        if scalars["class"] != type(self).__name__:
            raise ValueError(f"the checkpoint's optimizer is {scalars['class']}, this job's is {type(self).__name__}")
        if len(scalars["param_groups"]) != len(self.param_groups):
            raise ValueError(f"the checkpoint's optimizer has {len(scalars['param_groups'])} parameter groups, "
                             f"this one {len(self.param_groups)}")
        for saved, group in zip(scalars["param_groups"], self.param_groups):
            for k, v in saved.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
        for group in self.param_groups:
            for p in group["params"]:
                pieces = placements[id(p)]
                names = sorted({k.rsplit("/", 1)[1] for name, _ in pieces for k in reader.keys(f"{name}/")})
                for key in names:
                    array = array_module(p.data).zeros(p.shape, p.dtype)
                    for name, piece in pieces:
                        reader.read_into(f"{name}/{key}", piece, piece.view(array))
                    self._new_state(p, key, array)
                counters = [scalars["param_state"].get(name, {}) for name, _ in pieces]
                if any(c != counters[0] for c in counters):
                    raise ValueError(f"the checkpoint's counters differ between the parameters one shard holds: "
                                     f"{dict(zip((n for n, _ in pieces), counters))}")
                if counters and counters[0]:
                    self.state.setdefault(p, {}).update(counters[0])
