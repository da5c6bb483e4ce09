"""The CuPy path: the same training step on the GPU equals the CPU one (float32 tolerance).
Skipped without CuPy and a CUDA device (as on CI)."""
import numpy as np
import pytest

import minitrain as mt
from minitrain import backend, nn, optim
from minitrain.nn import functional as F

pytestmark = pytest.mark.gpu
if not backend.cuda_available():
    pytest.skip("needs CuPy and a CUDA device", allow_module_level=True)


@pytest.fixture
def cuda():
    backend.set_device("cuda")
    yield
    backend.set_device("cpu")


def run_steps(device, steps=3):
    backend.set_device(device)
    mt.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16))
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        idx = backend.to_device(rng.integers(0, 13, (4, 8)))
        _, loss = model(idx, idx)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: backend.to_host(v) for k, v in model.state_dict().items()}, loss.item()


def test_gpt_steps_on_gpu_match_cpu(cuda):
    gpu, gpu_loss = run_steps("cuda")
    cpu, cpu_loss = run_steps("cpu")
    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-4)
    for name in cpu:
        np.testing.assert_allclose(gpu[name], cpu[name], rtol=1e-3, atol=1e-4, err_msg=name)


def test_tensors_live_on_the_device(cuda):
    x = mt.Tensor(np.ones(3, np.float32), requires_grad=True)
    assert backend.is_device_array(x.data)
    (x * 2.0).sum().backward()
    assert backend.is_device_array(x.grad)
    assert isinstance(x.numpy(), np.ndarray)
    assert F.relu(x).numpy().tolist() == [1.0, 1.0, 1.0]


def test_a_gpu_checkpoint_loads_on_the_cpu_and_back_bit_for_bit(cuda, tmp_path):
    """Shards leave the device on purpose (backend.to_host) and return with backend.to_device: a CuPy
    GPT's checkpoint opens in a NumPy process, and a NumPy checkpoint in a CuPy one, every bit equal;
    the loaded optimizer state lives on the device."""
    from minitrain import checkpoint

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
