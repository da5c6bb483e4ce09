"""Rebinds param to the rounded master: the model's array never changes."""
import numpy as np

from minitrain import backend


def offload_step(param, grad, master, exp_avg, exp_avg_sq, step, lr, loss_scale, betas=(0.9, 0.999), eps=1e-8):
    g = backend.to_host(grad).astype(np.float32) / loss_scale
    if not np.isfinite(g).all():
        return False
    beta1, beta2 = betas
    exp_avg *= beta1
    exp_avg += (1 - beta1) * g
    exp_avg_sq *= beta2
    exp_avg_sq += (1 - beta2) * g * g
    m_hat = exp_avg / (1 - beta1 ** step)
    v_hat = exp_avg_sq / (1 - beta2 ** step)
    master -= lr * m_hat / (np.sqrt(v_hat) + eps)
    param = backend.to_device(master.astype(param.dtype))
    return True

EXPECT = ['param is unchanged: write the rounded master into it in place']
