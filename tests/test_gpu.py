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
