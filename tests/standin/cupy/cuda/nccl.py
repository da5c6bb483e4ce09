"""``cupy.cuda.nccl`` of the stand-in. By default it is what CuPy gives on a machine without NCCL: the
module imports and ``available`` is False. With CUPY_STANDIN_NCCL=1 (or ``available = True`` set by a
test) it is NCCL for ranks that are threads of one process (ThreadWorld), with CuPy 14.2's API
(cupy_backends/cuda/libs/nccl.pyx): communicators meet by unique id (128 bytes) and wait for one
another as ncclCommInitRank does; send/recv match in order per (source, destination) and run at
groupEnd, sends first (as a group never deadlocks); outside a group a recv waits for its send;
allReduce reduces every rank's buffer. Pointers are the stand-in's device pointers (host addresses).
"""
import collections
import ctypes
import os
import secrets
import threading

import numpy as np

available = os.environ.get("CUPY_STANDIN_NCCL", "0") == "1"

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16,
           7: np.float32, 8: np.float64}
TIMEOUT_S = 30.0


class NcclError(RuntimeError):
    def __init__(self, text):
        super().__init__(f"NCCL_ERROR_INVALID_USAGE: {text}")


def _dtype(code):
    if code == NCCL_BFLOAT16:
        from ml_dtypes import bfloat16
        return np.dtype(bfloat16)
    return np.dtype(_DTYPES[code])


def _memory(ptr, nbytes):
    return np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(int(ptr)))[:nbytes]


_cond = threading.Condition()
_worlds = {}
_group = threading.local()


def get_version():
    return 22809


def get_unique_id():
    return secrets.token_bytes(128)


def groupStart():   # noqa: N802  (CuPy's names)
    _group.depth = getattr(_group, "depth", 0) + 1
    _group.ops = getattr(_group, "ops", [])


def groupEnd():   # noqa: N802
    if getattr(_group, "depth", 0) == 0:
        raise NcclError("groupEnd without groupStart")
    _group.depth -= 1
    if _group.depth == 0:
        ops, _group.ops = _group.ops, []
        for op in sorted(ops, key=lambda o: o[0] != "send"):
            op[1]._run(*op)


def _wait(predicate, what):
    if not _cond.wait_for(predicate, TIMEOUT_S):
        raise NcclError(f"{what} timed out after {TIMEOUT_S} s")


class NcclCommunicator:
    def __init__(self, ndev, commId, rank):   # noqa: N803
        if len(commId) != 128:
            raise ValueError(f"commId length {len(commId)} != 128.")
        from .. import _standin
        self._device, self._rank, self._size = _standin.current_device(), rank, ndev
        with _cond:
            world = self._world = _worlds.setdefault(commId, {"size": ndev, "ranks": set(), "boxes":
                                                              collections.defaultdict(collections.deque),
                                                              "calls": collections.defaultdict(dict), "done": {}})
            if world["size"] != ndev or rank in world["ranks"] or not 0 <= rank < ndev:
                raise NcclError(f"rank {rank} of {ndev} cannot join this unique id")
            world["ranks"].add(rank)
            _cond.notify_all()
            _wait(lambda: len(world["ranks"]) == ndev, "ncclCommInitRank")
        self._calls = 0

    def device_id(self):
        return self._device

    def rank_id(self):
        return self._rank

    def size(self):
        return self._size

    def _queue_or_run(self, *op):
        if getattr(_group, "depth", 0):
            _group.ops.append(op)
        else:
            op[1]._run(*op)

    def send(self, sendbuf, count, datatype, peer, stream):
        self._queue_or_run("send", self, sendbuf, count * _dtype(datatype).itemsize, peer)

    def recv(self, recvbuf, count, datatype, peer, stream):
        self._queue_or_run("recv", self, recvbuf, count * _dtype(datatype).itemsize, peer)

    def _run(self, kind, _, ptr, nbytes, peer):
        with _cond:
            if kind == "send":
                self._world["boxes"][(self._rank, peer)].append(_memory(ptr, nbytes).copy())
                _cond.notify_all()
                return
            box = self._world["boxes"][(peer, self._rank)]
            _wait(lambda: len(box) > 0, f"rank {self._rank}: recv from rank {peer}")
            data = box.popleft()
        if data.nbytes != nbytes:
            raise NcclError(f"rank {self._rank} receives {nbytes} bytes from rank {peer}, who sent {data.nbytes}")
        _memory(ptr, nbytes)[...] = data

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):   # noqa: N802, N803
        dtype = _dtype(datatype)
        mine = np.frombuffer(_memory(sendbuf, count * dtype.itemsize).copy().tobytes(), dtype)
        call, self._calls = self._calls, self._calls + 1
        world = self._world
        with _cond:
            world["calls"][call][self._rank] = mine
            _cond.notify_all()
            _wait(lambda: len(world["calls"][call]) == self._size, f"rank {self._rank}: allReduce #{call}")
            stack = np.stack([world["calls"][call][r] for r in range(self._size)]).astype(np.float64)
            world["done"][call] = world["done"].get(call, 0) + 1
            if world["done"][call] == self._size:
                del world["calls"][call], world["done"][call]
        result = {NCCL_SUM: stack.sum(0), NCCL_PROD: stack.prod(0), NCCL_MAX: stack.max(0), NCCL_MIN: stack.min(0),
                  NCCL_AVG: stack.mean(0)}[op].astype(dtype)
        _memory(recvbuf, result.nbytes)[...] = result.view(np.uint8)

    def abort(self):
        pass

    def destroy(self):
        pass
