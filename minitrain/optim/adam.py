"""Adam (Kingma & Ba 2015) and AdamW (Loshchilov & Hutter 2019), PyTorch's update rules exactly:
    t += 1;  m = b1·m + (1-b1)·g;  v = b2·v + (1-b2)·g²
    p -= lr/(1-b1^t) · m / (sqrt(v)/sqrt(1-b2^t) + eps)
Adam adds wd·p to g (L2); AdamW first decays p *= 1 - lr·wd (decoupled).
Per parameter, 2 state arrays (8 bytes per fp32 parameter: the ZeRO paper's K=12 counts these
plus the fp32 master copy under mixed precision). On the GPU each parameter's update is one fused
kernel (kernels.adam_step) instead of about ten."""
import math

from .. import kernels
from ..backend import array_module, is_device_array
from .optimizer import Optimizer


class Adam(Optimizer):
    decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        # "not 0 <= x" as PyTorch writes it: NaN is refused too
        if not (0 <= lr and 0 <= eps and 0 <= weight_decay and 0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid Adam hyper-parameters lr={lr} betas={betas} eps={eps} weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def step(self):
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                data = p.data   # updated in place: the array keeps its identity (and its accounting)
                state = self.state.get(p)
                if state is None or "exp_avg" not in state:
                    xp = array_module(data)
                    self._new_state(p, "exp_avg", xp.zeros_like(data))
                    self._new_state(p, "exp_avg_sq", xp.zeros_like(data))
                    self.state[p]["step"] = 0
                    state = self.state[p]
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if is_device_array(data):
                    decoupled = bool(wd) and self.decoupled
                    kernels.adam_step(g, b1, b2, lr / (1.0 - b1 ** t), math.sqrt(1.0 - b2 ** t), eps,
                                      1.0 - lr * wd if decoupled else 1.0, wd if wd and not decoupled else 0.0,
                                      data, m, v)
                    continue
                if wd:
                    if self.decoupled:
                        data *= 1.0 - lr * wd
                    else:
                        g = g + wd * data
                m *= b1
                m += (1.0 - b1) * g
                v *= b2
                v += (1.0 - b2) * (g * g)
                step_size = lr / (1.0 - b1 ** t)
                denom = v ** 0.5
                denom /= math.sqrt(1.0 - b2 ** t)
                denom += eps
                data -= step_size * (m / denom)


class AdamW(Adam):
    """Adam with decoupled weight decay (default 0.01, as torch.optim.AdamW)."""
    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
