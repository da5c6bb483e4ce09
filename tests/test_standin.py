"""The CuPy stand-in keeps CuPy 14's rules (each checked against cupy/cupy v14.2.0's source), so that
what would fail on a GPU fails here: implicit conversions, NumPy arrays mixed into device work,
arrays used on another device, code that cupy.fuse cannot compile; and it counts what moves."""
import pathlib
import threading

import numpy as np
import pytest
from ml_dtypes import bfloat16


@pytest.fixture
def cp(standin_gpu):
    return standin_gpu


def counts(cp):
    return cp._standin.counters()


def test_no_implicit_conversion_to_numpy(cp):
    x = cp.arange(4.0)
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(x)
    with pytest.raises(AttributeError, match="__array_interface__"):    # CuPy has none (fsdp used it)
        x.__array_interface__
    with pytest.raises(TypeError):
        memoryview(x)                                                # no buffer protocol
    host = np.zeros(4)
    with pytest.raises(TypeError, match="Implicit conversion"):
        host[...] = x


@pytest.mark.parametrize("mix", [lambda x, h: x + h, lambda x, h: h * x, lambda x, h: x.__iadd__(h),
                                 lambda x, h: np.maximum(h, x), lambda x, h: np.where(x > 0, h, x)])
def test_numpy_arrays_are_refused_in_device_operations(cp, mix):
    with pytest.raises(TypeError, match="Unsupported type <class 'numpy.ndarray'>"):
        mix(cp.arange(3.0), np.ones(3))
    with pytest.raises(TypeError, match="Unsupported type <class 'numpy.ndarray'>"):
        np.concatenate([cp.arange(3.0), np.ones(3)])


def test_scalars_mix_and_numpy_functions_dispatch_to_the_device(cp):
    x = cp.arange(3.0, dtype=np.float32)
    y = np.float32(2) * x + 1.0
    assert isinstance(y, cp.ndarray) and y.dtype == np.float32
    assert isinstance(np.exp(x), cp.ndarray) and isinstance(np.concatenate([x, x]), cp.ndarray)
    s = x.sum()
    assert isinstance(s, cp.ndarray) and s.shape == ()                 # 0-d arrays, never scalars


def test_assigning_host_arrays_follows_cupy(cp):
    x = cp.zeros((2, 3))
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        x[...] = np.ones((2, 3))
    x[...] = np.float64(2.0)                                           # a scalar fills
    x[0] = 1.0
    assert cp.asnumpy(x).tolist() == [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]


def test_copies_and_synchronisations_are_counted(cp):
    before = counts(cp)
    x = cp.asarray(np.ones(4, np.float32))                              # host -> device
    float(x.sum())                                                     # device -> host, blocking
    x.get()
    cp.cuda.get_current_stream().synchronize()
    after = counts(cp)
    assert after["h2d"] - before["h2d"] == 1 and after["h2d_bytes"] - before["h2d_bytes"] == 16
    assert after["d2h"] - before["d2h"] == 2 and after["sync"] - before["sync"] == 3


def test_silent_conversions_are_counted_or_refused(cp):
    x = cp.arange(5.0)
    with pytest.raises(TypeError, match="implicit host-to-device conversion of an index"):
        x[np.array([0, 2])]
    cp._standin.IMPLICIT = "count"
    before = counts(cp)["h2d_implicit"]
    assert cp.asnumpy(x[[0, 2]]).tolist() == [0.0, 2.0]
    assert counts(cp)["h2d_implicit"] - before == 1


def test_boolean_masks_synchronise_as_in_cupy(cp):
    x = cp.arange(5.0)
    before = counts(cp)["sync"]
    x[x > 2.0]                                                         # CuPy counts the Trues on the host
    cp.nonzero(x)
    assert counts(cp)["sync"] - before == 2


def test_an_array_is_used_on_its_own_device_only(cp):
    with cp.cuda.Device(1):
        y = cp.ones(3)
    assert y.device.id == 1 and cp.cuda.Device().id == 0
    with pytest.raises(ValueError, match=r"resides \(1\) is different from the current device \(0\)"):
        y + 1.0
    y.reshape(3, 1)                                                    # a view launches nothing: allowed
    assert cp.asnumpy(y).tolist() == [1.0, 1.0, 1.0]                  # get() switches devices itself
    with pytest.raises(Exception, match="invalid device ordinal"):
        cp.cuda.Device(cp.cuda.runtime.getDeviceCount()).use()


def test_the_current_device_belongs_to_the_host_thread(cp):
    cp.cuda.Device(2).use()
    seen = []
    t = threading.Thread(target=lambda: seen.append(cp.cuda.runtime.getDevice()))
    t.start()
    t.join()
    assert cp.cuda.runtime.getDevice() == 2 and seen == [0]


def test_device_pointers_only_through_the_cuda_array_interface(cp):
    x = cp.arange(4.0)
    view = x[1:]
    assert view.data.ptr - x.data.ptr == 8 and view.base is x
    with pytest.raises(TypeError, match="device pointer was requested"):     # strict: nobody gets one
        x.__cuda_array_interface__
    cp._standin.FORBID_DEVICE_POINTERS = False
    assert x.__cuda_array_interface__["data"][0] == x.data.ptr
    rebuilt = cp.ndarray((2,), np.float64, memptr=x.data + 16)
    assert cp.asnumpy(rebuilt).tolist() == [2.0, 3.0]


def test_fuse_runs_one_kernel_and_refuses_what_cupy_cannot_compile(cp):
    @cp.fuse()
    def axpy(a, x, y):
        y *= a
        y += x
        return y * 2.0

    x, y = cp.ones(4, dtype=np.float32), cp.full(4, 3.0, dtype=np.float32)
    before = counts(cp)
    out = axpy(0.5, x, y)
    after = counts(cp)
    assert cp.asnumpy(out).tolist() == [5.0] * 4 and cp.asnumpy(y).tolist() == [2.5] * 4
    assert after["kernels"] - before["kernels"] == 1 and after["fused"] - before["fused"] == 1

    for body, error in [(lambda a: a.reshape(-1), TypeError), (lambda a: a[0], TypeError),
                        (lambda a: cp.sum(a, axis=0, keepdims=True), NotImplementedError),
                        (lambda a: cp.sum(cp.sum(a, axis=0)), NotImplementedError),
                        (lambda a: a if a > 0 else -a, Exception),
                        (lambda a: (cp.sum(a, axis=0), a + 1.0), Exception)]:
        with pytest.raises(error):
            cp.fuse(body)(cp.ones((2, 2)))
    assert cp.asnumpy(cp.fuse(lambda a: cp.sum(a * a, axis=1) * 0.5)(cp.ones((2, 3)))).tolist() == [1.5, 1.5]


def test_cuda_ipc_is_not_supported_here(cp):
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="cudaErrorNotSupported") as err:
        cp.cuda.runtime.ipcGetMemHandle(cp.arange(4.0).data.ptr)
    assert err.value.status == 801


def test_cuda_ipc_emulation_lets_another_process_map_device_memory(cp, monkeypatch, tmp_path):
    """CUPY_STANDIN_IPC=1: device memory lives in shared memory; a handle names the allocation (its base,
    as cudaIpcGetMemHandle wants), the exporting process may not open it, another one maps the same bytes."""
    import os
    import subprocess
    import sys
    monkeypatch.setattr(cp._standin, "IPC", True)
    rt = cp.cuda.runtime
    x = cp.arange(10.0)
    base, size, alloc_id = cp._standin.allocation_range(x.data.ptr)
    assert base <= x.data.ptr < base + size and alloc_id > 0 and rt.deviceCanAccessPeer(0, 1) == 1
    handle = rt.ipcGetMemHandle(base)
    assert isinstance(handle, bytes) and len(handle) == 64
    with pytest.raises(rt.CUDARuntimeError, match="cudaErrorInvalidValue"):
        rt.ipcGetMemHandle(base + 8)                                   # not an allocation's base
    with pytest.raises(rt.CUDARuntimeError, match="cudaErrorInvalidContext"):
        rt.ipcOpenMemHandle(handle)                                    # not in the exporting process
    child = ("import sys, numpy as np, cupy; ptr = cupy.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(sys.argv[1])); "
             "mem = cupy.cuda.UnownedMemory(ptr, int(sys.argv[2]), None, device_id=0); "
             "a = cupy.ndarray((10,), np.float64, memptr=cupy.cuda.MemoryPointer(mem, int(sys.argv[3]))); "
             "print(cupy.asnumpy(a).tolist()); a *= 2")
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parent / "standin"), "CUPY_STANDIN_IPC": "1"}
    out = subprocess.run([sys.executable, "-c", child, handle.hex(), str(size), str(x.data.ptr - base)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(np.arange(10.0).tolist())        # the child read this process's bytes
    assert cp.asnumpy(x).tolist() == (np.arange(10.0) * 2).tolist()    # and its writes are seen here
    with pytest.raises(ValueError, match="Timing must be disabled"):
        cp.cuda.Event(interprocess=True)
    event = cp.cuda.Event(disable_timing=True, interprocess=True)
    assert len(rt.ipcGetEventHandle(event.ptr)) == 64
    with pytest.raises(rt.CUDARuntimeError, match="cudaErrorInvalidResourceHandle"):
        rt.ipcGetEventHandle(cp.cuda.Event(disable_timing=True).ptr)  # not made interprocess


def test_streams_events_and_pinned_memory(cp):
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        assert cp.cuda.get_current_stream() is stream
    assert cp.cuda.get_current_stream() is cp.cuda.Stream.null
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    end.record()
    assert cp.cuda.get_elapsed_time(start, end) >= 0
    before = counts(cp)["sync"]
    end.synchronize()
    assert counts(cp)["sync"] - before == 1
    pinned = np.frombuffer(cp.cuda.alloc_pinned_memory(32), np.float32, 8)
    pinned[:] = 3
    x = cp.empty(8, np.float32)
    x.set(pinned)
    assert cp.asnumpy(x).tolist() == [3.0] * 8 and counts(cp)["pinned_bytes"] >= 32


def test_random_draws_on_the_device_reproducibly(cp):
    before = counts(cp)["h2d"]
    a = cp.random.RandomState(7, method=cp.cuda.curand.CURAND_RNG_PSEUDO_PHILOX4_32_10).random_sample(5, np.float32)
    b = cp.random.RandomState(7).random_sample(5, np.float32)
    assert counts(cp)["h2d"] == before and a.dtype == np.float32
    assert cp.asnumpy(a).tolist() == cp.asnumpy(b).tolist()
    with pytest.raises(TypeError):
        cp.random.RandomState(7).random_sample(5, np.float16)          # cuRAND: float32/64 only
    assert cp.random.default_rng(1).random(3).shape == (3,)


def test_scatter_add_accumulates_repeated_indices(cp):
    import cupyx
    out = cp.zeros(3)
    cupyx.scatter_add(out, cp.asarray(np.array([0, 0, 2])), cp.ones(3))
    assert cp.asnumpy(out).tolist() == [2.0, 0.0, 1.0]


def test_bfloat16_works_as_in_cupy_14_2(cp):
    x = cp.asarray(np.ones((2, 2), np.float32)).astype(bfloat16)
    y = cp.exp(x @ x + x).sum()
    assert x.dtype == bfloat16 and float(y) == pytest.approx(4 * np.exp(3.0), rel=1e-2)
