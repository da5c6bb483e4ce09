"""PipeDream-2BW's double-buffered weights (Narayanan et al. 2021, sec. 3): batch t runs forward and
backward on the stashed version W(t-1) while the optimizer updates W(t):
W(t+1) = W(t) - lr·∇L(W(t-1)). The stash is part of a checkpoint (<name>/stash): without it a
resumed run would take another step.
"""
from ...backend import array_module


class WeightStash:
    def __init__(self):
        self.old = None                        # W(t-1), one array per parameter; None before the first step

    def swap_in(self, params):
        """Before a step: the parameters take W(t-1); returns W(t) to put back after."""
        current = [q.data.copy() for q in params]
        if self.old is not None:
            for q, old in zip(params, self.old):
                q.data[...] = old
        return current

    def swap_out(self, params, current):
        """After a step: W(t) becomes the version the next batch computes on, and is put back."""
        self.old = current
        for q, now in zip(params, current):
            q.data[...] = now

    def sharded_state(self, params, placements):
        if self.old is None:
            return {}
        stash = {}
        for q, old in zip(params, self.old):
            for name, piece in placements[id(q)]:
                stash.setdefault(f"{name}/stash", []).append((piece, piece.view(old)))
        return stash

    def load(self, params, reader, placements, schedule_name):
        names = [placements[id(q)][0][0] for q in params]
        saved = [reader.has(f"{name}/stash") for name in names]
        if not any(saved):
            self.old = None                     # as at the start: the first step computes on W(t)
            return
        if schedule_name != "pipedream_2bw":
            raise ValueError("the checkpoint holds PipeDream-2BW's stashed weights W(t-1); only the pipedream_2bw "
                             "schedule computes on them (resume with --schedule pipedream_2bw)")
        self.old = []
        for q, name in zip(params, names):
            old = array_module(q.data).zeros(q.shape, q.dtype)
            reader.read_into(f"{name}/stash", placements[id(q)][0][1], old)
            self.old.append(old)
