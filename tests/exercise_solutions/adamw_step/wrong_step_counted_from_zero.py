"""Counts the bias correction's t from 0 (step + 1 at the first update)."""


def adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    beta1, beta2 = betas
    t = step + 1
    param *= 1 - lr * weight_decay
    exp_avg *= beta1
    exp_avg += (1 - beta1) * grad
    exp_avg_sq *= beta2
    exp_avg_sq += (1 - beta2) * grad * grad
    m_hat = exp_avg / (1 - beta1 ** t)
    v_hat = exp_avg_sq / (1 - beta2 ** t)
    param -= lr * m_hat / (v_hat ** 0.5 + eps)

EXPECT = ['the bias correction counted t from 0']
