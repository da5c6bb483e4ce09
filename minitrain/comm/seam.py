"""The seam between the core Communicator (communicator.py) and the guard around it (guard.py).

Every hook a guard may fill, and what the core does without one: nothing. As PyTorch keeps its
collective checks in ProcessGroupWrapper, outside the process group, the core calls these hooks at
fixed points of a call and knows nothing else of the guard. comm.guard is an Unguarded by
default; guard.wrap(comm) puts a Guard there (comm.init and every backend do, unless asked not to).
"""
import types


class Unguarded:
    def options(self, comm):
        """Keywords a sub-communicator (split) passes on to keep the same guard (guard.wrap's)."""
        return {"guard": False}

    def opened(self, comm, name, seq, header, nbytes, async_op):
        """Collective #seq was called (before it runs; queued if async_op): the object that stands
        for it while it runs (``.name``, ``.seq``)."""
        return types.SimpleNamespace(name=name, seq=seq)

    def run(self, comm, call, nbytes, body):
        """Run the collective's ``body()`` and return its result."""
        return body()

    def posted(self, comm, request, kind):
        """A point-to-point ``kind`` ("send" / "recv") outside any collective was handed to the backend."""

    def closed(self, comm, request, state):
        """A request is done (``state`` "done") or abandoned ("failed")."""

    def waiting(self, comm, pending, start):
        """A wait lasts (past the yield window): returns what ``waited`` is given when it ends."""
        return ()

    def stalled(self, comm, pending, what, elapsed, hard):
        """The wait passed comm_timeout (``hard``: the hard timeout; the core raises after this)."""

    def waited(self, marked):
        """The wait that ``waiting`` marked has ended."""

    def size_note(self, comm, request, call):
        """Text added to the receive contract's error (what the sender called)."""
        return ""
