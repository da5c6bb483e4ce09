"""Memory accounting: model-state bytes equal the formulas, agree with tracemalloc's count of
what NumPy really allocated, activations are freed by backward, and the teaching device raises."""
import threading
import tracemalloc

import numpy as np
import pytest

import minitrain as mt
from minitrain import memory, nn, optim
from minitrain.nn import functional as F


@pytest.fixture
def tracker():
    t = memory.MemoryTracker()
    with memory.use_tracker(t):
        yield t


def traced():
    return tracemalloc.get_traced_memory()[0]


# tracemalloc also counts the interpreter's own objects (tensors, graph nodes, dicts): allow for those
PYTHON_OBJECTS = 32 * 1024


def test_model_states_match_the_formulas_and_tracemalloc(tracker):
    """fp32 Adam: params 4Ψ, grads 4Ψ, optimizer state 8Ψ bytes (the ZeRO paper's 16Ψ)."""
    tracemalloc.start()
    try:
        before = traced()
        model = nn.MLP([256, 512, 512, 10])
        psi = model.num_parameters()
        after_init = traced()
        assert tracker.live["params"] == 4 * psi
        assert after_init - before == pytest.approx(4 * psi, abs=PYTHON_OBJECTS)

        x, y = np.random.rand(64, 256).astype(np.float32), np.random.randint(0, 10, 64)
        F.cross_entropy(model(mt.Tensor(x)), y).backward()
        assert tracker.live["grads"] == 4 * psi
        assert tracker.live["activations"] == 0          # backward freed every saved array
        after_backward = traced()
        assert after_backward - after_init == pytest.approx(4 * psi + x.nbytes + y.nbytes, abs=PYTHON_OBJECTS)

        opt = optim.Adam(model.parameters())
        opt.step()
        assert tracker.live["optimizer_state"] == 8 * psi
        assert traced() - after_backward == pytest.approx(8 * psi, abs=PYTHON_OBJECTS)

        opt.zero_grad()
        assert tracker.live["grads"] == 0
    finally:
        tracemalloc.stop()


def test_saved_activations_match_tracemalloc_and_are_freed(tracker):
    model = nn.MLP([512, 1024, 1024, 10])
    tracemalloc.start()
    try:
        before = traced()
        x = np.random.rand(256, 512).astype(np.float32)
        y = np.random.randint(0, 10, 256)
        loss = F.cross_entropy(model(mt.Tensor(x)), y)
        # alive after forward: exactly what backward needs (inputs of each Linear, ReLU outputs,
        # the log-probabilities, the targets), plus the loss itself and y
        assert tracker.live["activations"] == pytest.approx(traced() - before, abs=PYTHON_OBJECTS)
        assert tracker.peak_by_category["activations"] == tracker.live["activations"]
        loss.backward()
        assert tracker.live["activations"] == 0
    finally:
        tracemalloc.stop()


def test_an_array_saved_twice_is_counted_once(tracker):
    x = mt.Tensor(np.ones(1000, dtype=np.float32), requires_grad=True)
    y = x.exp()                           # saves its output e
    z = (y * y).sum()                     # saves e twice more (both operands)
    assert tracker.live["activations"] == 4000
    z.backward()
    assert tracker.live["activations"] == 0


def test_parameters_are_not_counted_as_activations(tracker):
    layer = nn.Linear(100, 100)
    out = layer(mt.Tensor(np.ones((1, 100), dtype=np.float32)))
    assert tracker.live["activations"] == 400   # only the input row; the weight is a parameter
    out.sum().backward()


def test_no_grad_saves_nothing(tracker):
    model = nn.MLP([10, 10, 10])
    with mt.no_grad():
        model(mt.Tensor(np.ones((5, 10), dtype=np.float32)))
    assert tracker.peak_by_category["activations"] == 0


def test_deleted_model_releases_its_bytes(tracker):
    model = nn.MLP([10, 10])
    assert tracker.live["params"] > 0
    del model
    assert tracker.live["params"] == 0


def test_reset_peak_and_snapshot(tracker):
    x = mt.Tensor(np.ones(1000, dtype=np.float32), requires_grad=True)
    x.exp().sum().backward()
    assert memory.peak()["activations"] == 4000
    memory.reset_peak()
    assert memory.peak()["activations"] == 0
    assert memory.snapshot()["total"] == sum(v for k, v in memory.snapshot().items() if k != "total")


def test_teaching_device_raises_when_full(tracker):
    memory.set_device_capacity(10_000)
    nn.Linear(10, 10)                     # 440 bytes: fits
    with pytest.raises(memory.DeviceOutOfMemory, match="params"):
        nn.Linear(100, 100)               # 40,400 bytes: does not
    memory.set_device_capacity(None)


def test_a_capacity_below_what_is_already_on_the_device_is_refused_when_set(tracker):
    layer = nn.Linear(100, 100)           # 40,400 bytes of params
    with pytest.raises(memory.DeviceOutOfMemory, match="40,400 bytes .params=40,400., exceeds .* 40,399 bytes"):
        memory.set_device_capacity(40_399)
    assert tracker.capacity is None       # refused: nothing set
    memory.set_device_capacity(40_400)    # exactly what is there: fits
    memory.set_device_capacity(None)
    del layer


def test_a_job_given_less_device_memory_than_its_model_says_so_before_training(capsys):
    from minitrain.examples import mlp
    assert mlp.main(["--no-progress", "--epochs", "1", "--hidden", "32", "--device-memory", "1000"]) == 3
    err = capsys.readouterr().err
    assert "[rank 0] ddp does not fit the device: what is already on the device" in err and "params=" in err


def test_each_thread_can_keep_its_own_account():
    results = {}

    def rank(r):
        with memory.use_tracker(memory.MemoryTracker()) as t:
            model = nn.Linear(10 * (r + 1), 10)
            results[r] = t.live["params"]
            del model
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == {0: 440, 1: 840}
