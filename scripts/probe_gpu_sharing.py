"""What ranks sharing one GPU pay per hop, with and without MPS: the primitives under the cuda-ipc transport.

    mpirun -n 2 python scripts/probe_gpu_sharing.py          (then again with nvidia-cuda-mps-control -d running)

Each figure is the slowest rank's mean over 100-300 calls:
  cuStreamWriteValue32         one stream memory write (CUDA driver API, through ctypes)
  GPU-side ring token          ranks pass a counter around the ring by stream memory ops on IPC-mapped flags:
                               no kernel, no host (what a hop costs the GPU's front end)
  ... + 1 KiB copy kernel      the same with one kernel reading the peer's memory per hop (what a ring step
                               launches): without MPS the GPU switches between the processes for each
  host ring token              kernel + stream synchronisation + MPI message per hop
  event records                a plain event, an interprocess one (what cuda-ipc records per message) while the
                               other ranks record too, and while they sleep
Measured on an H200 (docs/measured.md, "GPU: every step on an H200"): 4.3 / 142 / 158 us a hop and a 273 us
interprocess record without MPS; 3.2 / 8.4 / 14.8 us and 3.9 us under MPS, by this program's first draft (the
same calls in the same order; this form has not run on a GPU yet). Needs a real GPU and the driver (libcuda):
the CuPy stand-in has no stream memory operations.
"""
import ctypes
import sys
import time

import numpy as np


def main():
    try:
        import cupy
        if getattr(cupy, "__standin__", False):
            raise ImportError("the CuPy stand-in")
        lib = ctypes.CDLL("libcuda.so.1")
    except (ImportError, OSError) as e:
        sys.exit(f"probe_gpu_sharing: needs a real GPU with CuPy and the CUDA driver (libcuda): {e}")
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, p = comm.rank, comm.size
    rt, stream = cupy.cuda.runtime, cupy.cuda.get_current_stream()

    def driver(name):                  # CUDA 12+ exports the _v2 entry points
        fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint], ctypes.c_int
        return lambda *args: _check(fn(*args), name)
    write, wait = driver("cuStreamWriteValue32"), driver("cuStreamWaitValue32")     # wait flags 0: >=

    def report(name, seconds):
        worst = comm.allreduce(seconds, op=MPI.MAX)
        if rank == 0:
            print(f"  {name:<56} {worst * 1e6:9.1f} us", flush=True)

    def timed(n, body, per=1):
        stream.synchronize()
        comm.Barrier()
        t0 = time.perf_counter()
        for k in range(1, n + 1):
            body(k)
        stream.synchronize()
        return (time.perf_counter() - t0) / n / per

    flags = rt.malloc(1 << 16)         # one allocation of counters per rank, mapped by the others
    rt.memset(flags, 0, 1 << 16)
    handles = comm.allgather(rt.ipcGetMemHandle(flags))
    prev = rt.ipcOpenMemHandle(handles[(rank - 1) % p], 1) if p > 1 else flags
    peer_bytes = cupy.ndarray((256,), np.float32, memptr=cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(prev, 1 << 16, None, rt.getDevice()), 4096))
    out = cupy.empty(256, np.float32)
    if rank == 0:
        print(f"{p} ranks on GPU {rt.getDevice()} ({rt.getDeviceProperties(rt.getDevice())['name'].decode()})")
    report("cuStreamWriteValue32, every rank at once", timed(300, lambda k: write(stream.ptr, flags, k, 0)))

    def token(slot, kernel):
        def hop(k):                    # rank 0 starts each round; the others pass it on
            if rank == 0:
                write(stream.ptr, flags + 4 * slot, k, 0)
            wait(stream.ptr, prev + 4 * slot, k, 0)
            if kernel:
                out[...] = peer_bytes
            if rank != 0:
                write(stream.ptr, flags + 4 * slot, k, 0)
        return hop
    if p > 1:
        report("GPU-side ring token, per hop", timed(200, token(1, False), per=p))
        report("GPU-side ring token + 1 KiB copy kernel from the peer, per hop", timed(200, token(2, True), per=p))
        one = np.zeros(1, np.int64)

        def host_hop(k):
            if rank != 0:
                comm.Recv(one, (rank - 1) % p, 5)
            out[...] = peer_bytes
            stream.synchronize()
            comm.Send(one, (rank + 1) % p, 5)
            if rank == 0:
                comm.Recv(one, (rank - 1) % p, 5)
        report("host ring token: kernel + stream sync + MPI, per hop", timed(200, host_hop, per=p))
    plain = cupy.cuda.Event(block=False, disable_timing=True)
    shared = cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
    report("plain event record, every rank at once", timed(100, lambda k: plain.record(stream)))
    report("interprocess event record, every rank at once", timed(100, lambda k: shared.record(stream)))
    stream.synchronize()
    comm.Barrier()
    alone = 0.0
    if rank == 0:                      # no barrier inside: the others sleep meanwhile
        t0 = time.perf_counter()
        for _ in range(100):
            shared.record(stream)
        stream.synchronize()
        alone = (time.perf_counter() - t0) / 100
    else:
        time.sleep(0.3)
    report("interprocess event record, the other ranks asleep", alone)
    if p > 1:
        rt.ipcCloseMemHandle(prev)
    comm.Barrier()


def _check(status, name):
    if status != 0:
        raise RuntimeError(f"{name} failed: CUresult {status}")


if __name__ == "__main__":
    # no options: the parser answers --help (the docstring) and refuses anything else before any GPU is touched
    import argparse
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
