"""DeviceMesh: the world as a grid of named axes, each axis a sub-communicator (as picotron).

grid = arange(world).reshape(pp, dp, cp, tp): tp is innermost (tensor-parallel neighbours are
adjacent ranks, which on a real cluster share a node and its fast links), then cp (context
parallelism: the ring or the all-to-alls of every attention layer), then dp, then pp. A rank's
coordinates are where it sits in that grid; mesh.comm("dp") connects the ranks that differ only
in their dp coordinate. With cp > 1, mesh.comm("dp_cp") joins the dp and cp axes (Megatron's
data-parallel-with-context group: gradients are averaged over both; with cp = 1 it is the dp
communicator); with tp > 1 too, mesh.comm("cp_tp") joins cp and tp, the ranks holding the pieces of
one row under sequence parallelism (the experts' token group; with cp = 1 the tp communicator). The
splits are timed like any collective (a rank that never builds the mesh is named, not waited for),
and each axis's communicator is called tp[4, 5] (axis and world ranks) in flight recorder reports.
"""
import numpy as np

AXES = ("pp", "dp", "cp", "tp")    # outermost to innermost
JOINT = {"dp_cp": ("dp", "cp"), "cp_tp": ("cp", "tp")}    # communicators over several axes at once


class MeshError(ValueError):
    pass


class DeviceMesh:
    # the axes by name only: the grid's order (pp, dp, cp, tp) is not the arguments', and torch's
    # DeviceMesh(device_type, mesh) / init_device_mesh(device_type, shape, mesh_dim_names) are other calls
    def __init__(self, comm, *, dp=1, pp=1, tp=1, cp=1):
        sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        for name, n in sizes.items():
            if not isinstance(n, (int, np.integer)) or n < 1:
                raise MeshError(f"mesh axis {name} must be a positive integer, got {n!r}")
        if dp * pp * cp * tp != comm.size:
            shape = f"dp={dp} x pp={pp} x " + (f"cp={cp} x " if cp > 1 else "") + f"tp={tp}"
            raise MeshError(f"[rank {comm.rank}] a mesh of {shape} = {dp * pp * cp * tp} "
                            f"ranks does not fit a world of {comm.size} ranks")
        self.world = comm
        self.sizes = sizes
        self.grid = np.arange(comm.size).reshape(pp, dp, cp, tp)
        where = np.argwhere(self.grid == comm.rank)[0]
        self.coords = dict(zip(AXES, (int(c) for c in where)))
        self._comms = {}
        groups = [(axis,) for axis in AXES] + ([JOINT["dp_cp"]] if cp > 1 else []) \
            + ([JOINT["cp_tp"]] if cp > 1 and tp > 1 else [])
        for group in groups:           # every rank splits along every group, in the same order
            others = [a for a in AXES if a not in group]
            color = int(np.ravel_multi_index(tuple(self.coords[a] for a in others), tuple(sizes[a] for a in others)))
            key = int(np.ravel_multi_index(tuple(self.coords[a] for a in group), tuple(sizes[a] for a in group)))
            name = "_".join(group)
            self._comms[name] = comm.split(color, key=key)
            # flight records and reports name the axis: "tp[4, 5]"
            self._comms[name].uid = f"{name}{self.ranks_along(name)}"

    def comm(self, axis):
        if axis == "dp_cp" and "dp_cp" not in self._comms:
            return self._comms["dp"]   # cp = 1: the data-parallel group alone
        if axis == "cp_tp" and "cp_tp" not in self._comms:
            return self._comms["tp" if self.sizes["cp"] == 1 else "cp"]     # cp = 1 or tp = 1: the other alone
        if axis not in self._comms:
            raise MeshError(f"unknown mesh axis {axis!r}: expected one of {AXES + tuple(JOINT)}")
        return self._comms[axis]

    def size(self, axis):
        if axis in JOINT:
            return int(np.prod([self.sizes[a] for a in JOINT[axis]]))
        return self.sizes[axis]

    def coordinate(self, axis):
        return self.coords[axis]

    def ranks_along(self, axis):
        """The world ranks in this rank's group along ``axis`` (or a joint group such as "dp_cp"),
        in the group's rank order."""
        group = JOINT.get(axis, (axis,))
        index = [slice(None) if a in group else self.coords[a] for a in AXES]
        return [int(r) for r in self.grid[tuple(index)].reshape(-1)]

    def describe(self):
        cp = self.sizes["cp"]
        lines = [f"DeviceMesh pp={self.sizes['pp']} x dp={self.sizes['dp']} x " + (f"cp={cp} x " if cp > 1 else "")
                 + f"tp={self.sizes['tp']} ({self.world.size} ranks; tp innermost)"]
        for s in range(self.sizes["pp"]):
            lines.append(f"  pp stage {s}:")
            for d in range(self.sizes["dp"]):
                for c in range(cp):
                    ranks = " ".join(f"{r:>3}" for r in self.grid[s, d, c])
                    lines.append(f"    dp {d}" + (f" cp {c}" if cp > 1 else "") + f": tp ranks [{ranks} ]")
        return "\n".join(lines)

    def __repr__(self):
        return f"DeviceMesh(rank={self.world.rank}, coords={self.coords})"
