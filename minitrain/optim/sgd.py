"""SGD with momentum and weight decay, PyTorch's update rule exactly:
    d = g + wd·p;  buf = d (first step) or momentum·buf + (1 - dampening)·d;  p -= lr·buf
(nesterov=True: p -= lr·(d + momentum·buf))."""
from .optimizer import Optimizer


class SGD(Optimizer):
    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
        if not 0 <= lr:                 # (as PyTorch writes it: NaN is refused too)
            raise ValueError(f"invalid learning rate {lr}")
        if not (0 <= momentum and 0 <= weight_decay):
            raise ValueError(f"invalid SGD hyper-parameters momentum={momentum} weight_decay={weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov momentum needs momentum > 0 and dampening = 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def step(self):
        for group in self.param_groups:
            lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if wd:
                    g = g + wd * p.data
                if momentum:
                    state = self.state.get(p)
                    if state is None or "momentum_buffer" not in state:
                        buf = self._new_state(p, "momentum_buffer", g.copy())
                    else:
                        buf = state["momentum_buffer"]
                        buf *= momentum
                        buf += (1.0 - group["dampening"]) * g
                    g = g + momentum * buf if group["nesterov"] else buf
                data = p.data   # update in place: the array keeps its identity (and its accounting)
                data -= lr * g
