"""DeviceMesh: the world as a grid of named axes, each axis a sub-communicator (as picotron).

grid = arange(world).reshape(pp, dp, tp): tp is innermost (tensor-parallel neighbours are
adjacent ranks, which on a real cluster share a node and its fast links), then dp, then pp.
A rank's coordinates are where it sits in that grid; mesh.comm("dp") connects the ranks that
differ only in their dp coordinate. The splits are timed like any collective (a rank that never
builds the mesh is named, not waited for), and each axis's communicator is called tp[4, 5] (axis
and world ranks) in flight recorder reports.
"""
import numpy as np

AXES = ("pp", "dp", "tp")    # outermost to innermost


class MeshError(ValueError):
    pass


class DeviceMesh:
    def __init__(self, comm, dp=1, pp=1, tp=1):
        sizes = {"pp": pp, "dp": dp, "tp": tp}
        for name, n in sizes.items():
            if not isinstance(n, (int, np.integer)) or n < 1:
                raise MeshError(f"mesh axis {name} must be a positive integer, got {n!r}")
        if dp * pp * tp != comm.size:
            raise MeshError(f"[rank {comm.rank}] a mesh of dp={dp} x pp={pp} x tp={tp} = {dp * pp * tp} "
                            f"ranks does not fit a world of {comm.size} ranks")
        self.world = comm
        self.sizes = sizes
        self.grid = np.arange(comm.size).reshape(pp, dp, tp)
        where = np.argwhere(self.grid == comm.rank)[0]
        self.coords = dict(zip(AXES, (int(c) for c in where)))
        self._comms = {}
        for axis in AXES:              # every rank splits along every axis, in the same order
            others = tuple(self.coords[a] for a in AXES if a != axis)
            color = int(np.ravel_multi_index(others, tuple(sizes[a] for a in AXES if a != axis)))
            self._comms[axis] = comm.split(color, key=self.coords[axis])
        for axis in AXES:              # flight records and reports name the axis: "tp[4, 5]"
            self._comms[axis].uid = f"{axis}{self.ranks_along(axis)}"

    def comm(self, axis):
        if axis not in self._comms:
            raise MeshError(f"unknown mesh axis {axis!r}: expected one of {AXES}")
        return self._comms[axis]

    def size(self, axis):
        return self.sizes[axis]

    def coordinate(self, axis):
        return self.coords[axis]

    def ranks_along(self, axis):
        """The world ranks in this rank's group along ``axis`` (in the group's rank order)."""
        index = [self.coords[a] for a in AXES]
        index[AXES.index(axis)] = slice(None)
        return [int(r) for r in self.grid[tuple(index)]]

    def describe(self):
        lines = [f"DeviceMesh pp={self.sizes['pp']} x dp={self.sizes['dp']} x tp={self.sizes['tp']} "
                 f"({self.world.size} ranks; tp innermost)"]
        for s in range(self.sizes["pp"]):
            lines.append(f"  pp stage {s}:")
            for d in range(self.sizes["dp"]):
                ranks = " ".join(f"{r:>3}" for r in self.grid[s, d])
                lines.append(f"    dp {d}: tp ranks [{ranks} ]")
        return "\n".join(lines)

    def __repr__(self):
        return f"DeviceMesh(rank={self.world.rank}, coords={self.coords})"
