"""FullyShardedDataParallel's state dicts (fsdp.py holds the strategy): the full parameters
gathered unit by unit under the unwrapped model's names (PyTorch FSDP's FULL_STATE_DICT), full
arrays loaded into each rank's shards, and the checkpoint's view of the shards (minitrain.sharded).
Bytes: a full state dict all-gathers every unit once, (p-1)/p·Ψ·b per rank; loading sends nothing.
"""
from .. import backend


class FSDPStateDicts:
    """Mixed into FullyShardedDataParallel: reads its ``units`` and ``names`` (id(parameter) -> name)."""

    def full_state_dict(self):
        """name -> full array (copies), gathered unit by unit, under the unwrapped model's names."""
        state = {}
        for unit in self.units:
            unit.gather()
            for q in unit.params:
                state[self.names[id(q)]] = q.data.copy()
            unit.release()
        return state

    def state_dict(self):
        """The full parameters under the unwrapped model's names (PyTorch FSDP's default
        FULL_STATE_DICT: a collective, every rank gets every array)."""
        return self.full_state_dict()

    def load_state_dict(self, state):
        """Full arrays by name -> each rank copies in its shard of every unit (no communication)."""
        for unit in self.units:
            lo, hi = unit.flat.shard_range
            shard = unit.shard.data                       # on the host with offload_params
            for q in unit.params:
                name = self.names[id(q)]
                if name not in state:
                    raise KeyError(f"FullyShardedDataParallel.load_state_dict: missing {name}")
                value = state[name]
                if tuple(value.shape) != tuple(q.shape):
                    raise ValueError(f"load_state_dict: {name} has shape {tuple(value.shape)}, the model "
                                     f"expects {tuple(q.shape)}")
                a, b = unit.flat.offsets[id(q)]
                s, e = max(a, lo), min(b, hi)
                if s < e:
                    piece = value.reshape(-1)[s - a:e - a]
                    shard[s - lo:e - lo] = (backend.to_device(piece, "cuda") if backend.is_device_array(shard)
                                            else backend.to_host(piece))

    def sharded_parameters(self):
        """[(unit shard, [(name, Slice)])]: the pieces of the logical parameters this rank's shard of
        each unit holds (a flat range of the unit cut into boxes; padding excluded)."""
        out = []
        for unit in self.units:
            out.append((unit.shard, unit.flat.shard_slices(self.names)))
        return out
