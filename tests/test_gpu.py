"""On a real GPU (CuPy and a CUDA device; skipped elsewhere, and under the stand-in): the same step on
the GPU equals the CPU's, CuPy keeps the rules the stand-in (tests/standin) enforces, every fused
kernel compiles and equals the CPU op, a step makes no synchronisation, and ranks pick their GPU.

Runs under pytest, or without it (the GPU machine may not have pytest): ``python3 tests/test_gpu.py``
runs every test here and exits 1 if one fails.
"""
import contextlib
import re
import sys
import threading
import traceback

import numpy as np

import minitrain as mt
from minitrain import backend, kernels, nn, optim, random  # noqa: F401  (kernels: the fused ones, registered)
from minitrain.nn import functional as F

try:
    import pytest
except ImportError:          # pragma: no cover - the GPU machine may lack pytest
    pytest = None


def real_gpu():
    if not backend.cuda_available():
        return False
    return not getattr(backend._import_cupy(), "__standin__", False)


if pytest is not None:
    pytestmark = pytest.mark.gpu
    if not real_gpu():
        pytest.skip("needs CuPy and a CUDA device (the stand-in is tested by test_device*.py)", allow_module_level=True)


@contextlib.contextmanager
def on_gpu():
    backend.set_device("cuda")
    try:
        yield backend._import_cupy()
    finally:
        backend.set_device("cpu")


def raises(kind, fn, match=None):
    try:
        fn()
    except kind as e:
        assert match is None or re.search(match, str(e)), f"{kind.__name__} without {match!r}: {e}"
        return e
    raise AssertionError(f"expected {kind.__name__}")


def close(a, b, rtol=1e-4, atol=1e-5, what=""):
    np.testing.assert_allclose(backend.to_host(a), backend.to_host(b), rtol=rtol, atol=atol, err_msg=what)


# ---------------------------------------------------------------- the training step
def run_steps(device, steps=3):
    backend.set_device(device)
    mt.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16))
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        idx = rng.integers(0, 13, (4, 8))
        _, loss = model(idx, idx)
        opt.zero_grad()
        loss.backward()
        optim.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    state = {k: backend.to_host(v) for k, v in model.state_dict().items()}
    backend.set_device("cpu")
    return state, loss.item()


def test_gpt_steps_on_gpu_match_cpu():
    gpu, gpu_loss = run_steps("cuda")
    cpu, cpu_loss = run_steps("cpu")
    assert abs(gpu_loss - cpu_loss) <= 1e-4 * abs(cpu_loss), (gpu_loss, cpu_loss)
    for name in cpu:
        close(gpu[name], cpu[name], rtol=1e-3, atol=1e-4, what=name)


def test_tensors_live_on_the_device():
    with on_gpu():
        x = mt.Tensor(np.ones(3, np.float32), requires_grad=True)
        assert backend.is_device_array(x.data)
        (x * 2.0).sum().backward()
        assert backend.is_device_array(x.grad)
        assert isinstance(x.numpy(), np.ndarray)
        assert F.relu(x).numpy().tolist() == [1.0, 1.0, 1.0]


def test_a_training_step_makes_no_synchronisation():
    with on_gpu():
        mt.manual_seed(0)
        model = nn.GPT(nn.GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16))
        opt = optim.AdamW(model.parameters(), lr=1e-2)
        idx = backend.to_device(np.random.default_rng(0).integers(0, 13, (4, 8)))
        for step in range(2):
            before = backend.transfer_counts()
            _, loss = model(idx, idx)
            opt.zero_grad()
            loss.backward()
            optim.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            after = backend.transfer_counts()
        assert {k: after[k] - before[k] for k in after} == dict.fromkeys(after, 0)


# ---------------------------------------------------------------- CuPy's rules, as the stand-in has them
def test_cupy_refuses_what_the_stand_in_refuses():
    with on_gpu() as cp:
        x = cp.arange(4.0)
        raises(TypeError, lambda: np.asarray(x), "Implicit conversion to a NumPy array is not allowed")
        raises(AttributeError, lambda: x.__array_interface__)
        raises(TypeError, lambda: memoryview(x))
        for mix in (lambda: x + np.ones(4), lambda: np.ones(4) * x, lambda: cp.maximum(x, np.ones(4))):
            raises(TypeError, mix, "Unsupported type <class 'numpy.ndarray'>")
        raises(TypeError, lambda: cp.concatenate([x, np.ones(4)]), "Unsupported type <class 'numpy.ndarray'>")
        raises(ValueError, lambda: x.__setitem__(Ellipsis, np.ones(4)), "non-scalar numpy.ndarray cannot be used for fill")
        assert isinstance((np.float32(2) * x).sum(), cp.ndarray)
        assert x.__cuda_array_interface__["data"][0] == x.data.ptr


def test_cupy_devices_belong_to_host_threads_and_arrays_to_devices():
    with on_gpu() as cp:
        count = cp.cuda.runtime.getDeviceCount()
        seen = []
        with cp.cuda.Device(count - 1):
            t = threading.Thread(target=lambda: seen.append(cp.cuda.runtime.getDevice()))
            t.start()
            t.join()
            y = cp.ones(2)
        assert seen == [0] and y.device.id == count - 1
        if count > 1 and not cp.cuda.runtime.deviceCanAccessPeer(0, count - 1):
            raises(ValueError, lambda: y + 1.0, "is different from the current device")


def test_cupy_streams_events_pinned_memory_and_ipc():
    with on_gpu() as cp:
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        cp.ones(1 << 20).sum()
        end.record()
        end.synchronize()
        assert cp.cuda.get_elapsed_time(start, end) >= 0
        pinned = np.frombuffer(cp.cuda.alloc_pinned_memory(16), np.float32, 4)
        pinned[:] = 2
        x = cp.empty(4, np.float32)
        x.set(pinned)
        assert cp.asnumpy(x).tolist() == [2.0] * 4
        try:                                             # works, or fails as the stand-in fails
            cp.cuda.runtime.ipcGetMemHandle(x.data.ptr)
        except cp.cuda.runtime.CUDARuntimeError as e:
            assert "cudaErrorNotSupported" in str(e) or e.status == 801, e


def test_what_the_transports_assume_of_cupy_and_the_driver():
    """The calls minitrain/comm/transport.py and ipc.py make, on the GPU, in one process (the MPI runs of
    scripts/gpu_validate.sh's transport step use them across processes): the driver's allocation range of a
    pool array's interior pointer, 64-byte memory and event handles, a stream waiting on an interprocess
    event, a device array wrapped around a raw pointer, and the pinned staging round trip."""
    from minitrain.comm import ipc, transport
    with on_gpu() as cp:
        big = cp.arange(1 << 20, dtype=cp.float32)
        view = big[1000:]
        base, size, alloc_id = ipc.allocation_range(view.data.ptr)
        assert base <= big.data.ptr < view.data.ptr < base + size and size >= big.nbytes
        assert ipc.allocation_range(big.data.ptr) == (base, size, alloc_id)
        mem = cp.cuda.UnownedMemory(base, size, big, device_id=cp.cuda.runtime.getDevice())
        alias = cp.ndarray(view.shape, view.dtype, memptr=cp.cuda.MemoryPointer(mem, view.data.ptr - base))
        assert bool((alias == view).all())
        try:                                             # works, or fails as the stand-in fails by default
            handle = cp.cuda.runtime.ipcGetMemHandle(base)
            assert isinstance(handle, bytes) and len(handle) == 64
            event = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
            event_handle = cp.cuda.runtime.ipcGetEventHandle(event.ptr)
            assert isinstance(event_handle, bytes) and len(event_handle) == 64
            event.record()
            cp.cuda.runtime.streamWaitEvent(cp.cuda.get_current_stream().ptr, event.ptr, 0)
        except cp.cuda.runtime.CUDARuntimeError as e:
            assert "cudaErrorNotSupported" in str(e) or e.status == 801, e
        pool = transport.PinnedPool()
        host = transport._view(pool.take(view.nbytes), view)
        backend.to_host_into(view, host, blocking=False)
        backend.synchronize()
        assert np.array_equal(host, cp.asnumpy(view))
        back = cp.empty_like(view)
        backend.to_device_into(back, host)
        assert bool((back == view).all())
        pool.close()


# ---------------------------------------------------------------- minitrain's fused kernels on CuPy
def test_every_fused_kernel_compiles_and_equals_the_cpu_op():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 5)).astype(np.float32)
    w, b = rng.standard_normal(5).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    masked = (np.arange(20).reshape(4, 5) % 3 == 0) | (np.arange(4) == 1)[:, None]    # row 1 masked whole
    cases = [("gelu", lambda z: F.gelu(z)), ("softmax", lambda z: F.softmax(z)),
             ("softmax scaled and masked", lambda z: F.softmax(z, scale=0.5, mask=masked)),
             ("log_softmax", lambda z: F.log_softmax(z)),
             ("layer_norm", lambda z: F.layer_norm(z, 5, mt.Tensor(w), mt.Tensor(b))),
             ("cross_entropy", lambda z: F.cross_entropy(z, np.array([[0, 1, 2, 3, 0]] * 3)))]   # classes on dim 1
    for name, fn in cases:
        results = []
        for device in ("cuda", "cpu"):
            backend.set_device(device)
            t = mt.Tensor(x, requires_grad=True)
            out = fn(t)
            out.backward(np.ones(out.shape, np.float32))
            results.append((out.numpy(), backend.to_host(t.grad)))
        for got, want in zip(*results):
            close(got, want, what=name)
    backend.set_device("cpu")
    unfused = {f.name: f.unfusable for f in backend.FUSED if f.unfusable}
    assert not unfused, f"cupy.fuse could not compile: {unfused}"


def test_fused_adam_equals_the_cpu_adam_and_dropout_masks_replay():
    results = []
    for device in ("cuda", "cpu"):
        backend.set_device(device)
        mt.manual_seed(0)
        p = nn.Parameter(np.linspace(-1, 1, 12).astype(np.float32))
        opt = optim.Adam([p], lr=0.1, weight_decay=0.1)
        for _ in range(3):
            p.grad = backend.to_device(np.linspace(0.5, -0.5, 12).astype(np.float32)) if device == "cuda" \
                else np.linspace(0.5, -0.5, 12).astype(np.float32)
            opt.step()
        results.append(p.numpy())
    close(*results, rtol=1e-5, atol=1e-6, what="adam")
    with on_gpu():
        x = mt.Tensor(np.ones((64, 64), np.float32))
        state = random.get_state()
        a = F.dropout(x, 0.25).numpy()
        random.set_state(state)
        assert (F.dropout(x, 0.25).numpy() == a).all() and abs((a == 0).mean() - 0.25) < 0.05


def test_bfloat16_runs_on_the_gpu():
    with on_gpu():
        model = nn.MLP([8, 16, 4]).to(backend.bfloat16)
        out = model(mt.Tensor(np.ones((2, 8), np.float32)).to(backend.bfloat16))
        assert out.dtype == backend.bfloat16 and np.isfinite(out.float().numpy()).all()


def test_placement_gives_each_local_rank_its_gpu():
    with on_gpu() as cp:
        count = cp.cuda.runtime.getDeviceCount()
        backend.use_gpu(count - 1)
        x = mt.Tensor(np.ones(2, np.float32))
        assert x.data.device.id == count - 1 and backend.describe_device().startswith(f"cuda:{count - 1}")
        backend.use_gpu(0)


def test_a_gpu_checkpoint_loads_on_the_cpu_and_back_bit_for_bit(tmp_path=None):
    """Shards leave the device on purpose (backend.to_host) and return with backend.to_device: a CuPy
    GPT's checkpoint opens in a NumPy process, and a NumPy checkpoint in a CuPy one, every bit equal;
    the loaded optimizer state lives on the device."""
    import pathlib
    import tempfile
    from minitrain import checkpoint
    tmp_path = pathlib.Path(tempfile.mkdtemp()) if tmp_path is None else tmp_path

    def job(device):
        backend.set_device(device)
        mt.set_default_dtype(np.float64)
        mt.manual_seed(0)
        model = nn.GPT(nn.GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16))
        return model, optim.AdamW(model.parameters(), lr=1e-2)
    try:
        gpu_model, gpu_opt = job("cuda")
        idx = backend.to_device(np.random.default_rng(0).integers(0, 13, (4, 8)))
        for _ in range(2):
            gpu_opt.zero_grad()
            gpu_model(idx, idx)[1].backward()
            gpu_opt.step()
        path = checkpoint.save(str(tmp_path / "gpu"), None, 2, gpu_model, gpu_opt)
        cpu_model, cpu_opt = job("cpu")
        checkpoint.load(path, None, cpu_model, cpu_opt)
        back = checkpoint.save(str(tmp_path / "cpu"), None, 2, cpu_model, cpu_opt)
        again, again_opt = job("cuda")
        checkpoint.load(back, None, again, again_opt)
        for (name, g), c, a in zip(gpu_model.named_parameters(), cpu_model.parameters(), again.parameters()):
            assert isinstance(c.data, np.ndarray) and backend.is_device_array(a.data), name
            assert np.array_equal(backend.to_host(g.data), c.data) and np.array_equal(c.data, backend.to_host(a.data))
            for key in ("exp_avg", "exp_avg_sq"):
                assert backend.is_device_array(again_opt.state[a][key])
                assert np.array_equal(backend.to_host(gpu_opt.state[g][key]), backend.to_host(again_opt.state[a][key]))
    finally:
        mt.set_default_dtype(np.float32)
        backend.set_device("cpu")


if __name__ == "__main__":          # without pytest
    if not real_gpu():
        print("SKIP: needs CuPy and a CUDA device")
        sys.exit(0)
    failed = 0
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print(f"PASS {name}")
            except Exception:
                failed += 1
                print(f"FAIL {name}\n{traceback.format_exc()}")
    print(f"{failed} failed")
    sys.exit(1 if failed else 0)
