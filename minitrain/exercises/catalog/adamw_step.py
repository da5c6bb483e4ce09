"""Grader: AdamW's update of one parameter (Kingma & Ba 2015, Algorithm 1; Loshchilov & Hutter 2019,
Algorithm 2, decoupled weight decay; PyTorch's torch.optim.AdamW): the two moments, their bias
correction, eps outside the square root, the decay of the parameter itself before the step; one step
and ten (float64, 1e-12), a zero gradient under weight decay, and minitrain's AdamW in a small MLP's
training replaced by the learner's step, step for step."""
import numpy as np

from ..comparing import compare, host, to_learner
from ..grading import Check, Mismatch

TITLE = "AdamW's step: two moments, bias correction, decoupled weight decay"
ORDER = 45
KIND = "implement"
NOTEBOOK = "01_autograd"
DEFINES = "adamw_step"

STUB = '''"""Exercise adamw_step: Adam (Kingma & Ba 2015, "Adam: A Method for Stochastic Optimization",
Algorithm 1) keeps, per parameter, a running mean of the gradients (the first moment, exp_avg) and of
their squares (the second moment, exp_avg_sq), and steps each element by its mean gradient over the
root of its mean square: large, noisy gradients take small steps. AdamW (Loshchilov & Hutter 2019,
"Decoupled Weight Decay Regularization") shrinks the parameter itself by lr * weight_decay instead
of adding weight_decay * param to the gradient. These two arrays are the 8 bytes per parameter that
ZeRO's optimizer-state sharding is about.

Write adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay): one update,
as torch.optim.AdamW makes it.

Contract:
  - param, grad, exp_avg, exp_avg_sq: arrays of one shape; update param, exp_avg and exp_avg_sq in
    place (the caller keeps them), return nothing; leave grad as it is;
  - step is this update's number t, counted from 1 (the first update has step 1);
  - betas = (beta1, beta2). In order:
      param      *= 1 - lr * weight_decay
      exp_avg     = beta1 * exp_avg + (1 - beta1) * grad
      exp_avg_sq  = beta2 * exp_avg_sq + (1 - beta2) * grad ** 2
      param      -= lr / (1 - beta1 ** t) * exp_avg / (sqrt(exp_avg_sq / (1 - beta2 ** t)) + eps)
  - arrays live where the parameter does (NumPy on the CPU, CuPy on the GPU): no np. on them.

The test to pass:
  - one step from zero moments, then ten with a changing lr: param, exp_avg and exp_avg_sq equal
    torch.optim.AdamW's rule (float64, 1e-12);
  - a zero gradient under weight decay still shrinks the parameter: param * (1 - lr * weight_decay);
  - a small MLP trained 10 steps with your step in place of minitrain's AdamW: the same weights.

Check it:  python -m minitrain.exercises check adamw_step mine.py
Stuck?     python -m minitrain.exercises hint adamw_step
"""


def adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    raise NotImplementedError("adamw_step: decay, the two moments, then the bias-corrected step")
'''

HINTS = (
    "In place means the caller's arrays change: param *= ..., exp_avg *= beta1 then exp_avg += (1 - beta1) * "
    "grad, and the same for exp_avg_sq with grad * grad. exp_avg = beta1 * exp_avg + ... makes a new array "
    "under the same local name and leaves the caller's as it was.",
    "Bias correction: the moments start at zero, so after t steps they are (1 - beta ** t) times too small on "
    "average. Divide exp_avg by 1 - beta1 ** t and exp_avg_sq by 1 - beta2 ** t, with t = step (1 at the first "
    "update, not 0), in the step only: the stored moments stay uncorrected.",
    "eps goes outside the root: denom = sqrt(exp_avg_sq / (1 - beta2 ** t)) + eps. And AdamW decays the "
    "parameter first, by itself: param *= 1 - lr * weight_decay, before the moments; adding weight_decay * "
    "param to the gradient is Adam's L2 penalty, which the moments then rescale.",
)

BETAS, EPS = (0.9, 0.999), 1e-8


def _rule(param, grad, m, v, t, lr, betas, eps, wd, mistake=None):
    """The update on host copies (``mistake``: the same with one of the usual slips, to name it)."""
    p, m, v = param.copy(), m.copy(), v.copy()
    b1, b2 = betas
    if mistake == "l2":
        grad = grad + wd * p
    elif mistake != "decay after":
        p *= 1 - lr * wd
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad * grad
    c1, c2 = (1.0, 1.0) if mistake == "no bias correction" else (1 - b1 ** t, 1 - b2 ** t)
    if mistake == "t from 0":
        c1, c2 = 1 - b1 ** (t + 1), 1 - b2 ** (t + 1)
    denom = np.sqrt(v / c2 + eps) if mistake == "eps inside" else np.sqrt(v / c2) + eps
    p -= lr / c1 * m / denom
    if mistake == "decay after":
        p *= 1 - lr * wd
    return p, m, v


MISTAKES = {"no bias correction": "the moments were used without their bias correction (divide by 1 - beta ** t "
                                  "in the step)",
            "t from 0": "the bias correction counted t from 0: step is this update's number, 1 at the first",
            "eps inside": "eps was added inside the square root: sqrt(v_hat) + eps, not sqrt(v_hat + eps)",
            "l2": "weight decay was added to the gradient (Adam's L2 penalty): AdamW decays the parameter itself, "
                  "param *= 1 - lr * weight_decay",
            "decay after": "the parameter was decayed after the step: AdamW decays it first, then steps"}


def _one(impl, param, grad, m, v, t, lr, wd, what):
    """Run impl on the learner's copies; compare with the rule; name the slip where one explains it."""
    arrays = [to_learner(a) for a in (param, grad, m, v)]
    returned = impl(*arrays, t, lr, BETAS, EPS, wd)
    if returned is not None:
        raise Mismatch(f"{what}: returned {type(returned).__name__}; update param, exp_avg and exp_avg_sq in place "
                       "and return nothing (the optimizer keeps its arrays)")
    got = [host(a) for a in arrays]
    if not np.array_equal(got[1], grad):
        raise Mismatch(f"{what}: grad changed; leave it as it is (the caller may still read it)")
    want = _rule(param, grad, m, v, t, lr, BETAS, EPS, wd)
    for k, name, g, before in ((1, "exp_avg", got[2], m), (2, "exp_avg_sq", got[3], v), (0, "param", got[0], param)):
        problem = compare(g, want[k], f"{what}: {name}", rtol=1e-12, atol=0)
        if problem is None:
            continue
        if np.array_equal(g, before):
            problem += (f"; {name} is unchanged: update the caller's array in place ({name} *= ..., {name} += ...), "
                        f"not a new array under the same name")
        else:                                   # one of the usual slips, if it explains what came out
            slips = [why for slip, why in MISTAKES.items()
                     if np.allclose(g, _rule(param, grad, m, v, t, lr, BETAS, EPS, wd, slip)[k], rtol=1e-12, atol=0)]
            problem += f"; {slips[0]}" if slips else ""
        raise Mismatch(problem)
    return want


def _values(shape, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), rng.standard_normal(shape)


def _first(impl):
    param, grad = _values((3, 4), 0)
    _one(impl, param, grad, np.zeros((3, 4)), np.zeros((3, 4)), 1, 1e-2, 0.1, "step 1 from zero moments")


def _ten(impl):
    param, _ = _values((7,), 1)
    m, v = np.zeros(7), np.zeros(7)
    rng = np.random.default_rng(2)
    for t in range(1, 11):
        grad = rng.standard_normal(7) * (1 + t)
        lr = 1e-2 * (1 - t / 20)                               # a schedule's lr, changing each step
        param, m, v = _one(impl, param, grad, m, v, t, lr, 0.05, f"step {t} of 10 (lr {lr:g})")


def _zero_grad(impl):
    param, _ = _values((5,), 3)
    lr, wd = 0.1, 0.2
    _one(impl, param, np.zeros(5), np.zeros(5), np.zeros(5), 1, lr, wd,
         f"a zero gradient, lr {lr}, weight_decay {wd} (param should become param * {1 - lr * wd:g})")


def _trains_as_adamw(impl):
    from ... import manual_seed, nn
    from ...autograd import Tensor
    from ...optim import AdamW
    x, y = _values((16, 4), 4)
    models = []
    for _ in range(2):
        manual_seed(5)
        models.append(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)))
        models[-1].to(np.float64)
    library = AdamW(models[0].parameters(), lr=1e-2, weight_decay=0.1)
    theirs = models[1].parameters()
    moments = [(np.zeros(q.shape), np.zeros(q.shape)) for q in theirs]
    for t in range(1, 11):
        for model in models:
            model.zero_grad()
            out = model(Tensor(to_learner(x)))
            ((out - Tensor(to_learner(y))) ** 2).mean().backward()
        library.step()
        for q, (m, v) in zip(theirs, moments):
            data, grad, mm, vv = (to_learner(host(a)) for a in (q.data, q.grad, m, v))
            impl(data, grad, mm, vv, t, 1e-2, BETAS, EPS, 0.1)
            q.data[...] = data
            m[...], v[...] = host(mm), host(vv)
        for (name, mine), theirs_q in zip(models[0].named_parameters(), theirs):
            problem = compare(host(theirs_q.data), host(mine.data), f"after step {t}, {name}", rtol=1e-12, atol=0)
            if problem:
                raise Mismatch(problem + ": the MLP trained with your step drifted from minitrain's AdamW")


def checks():
    return [Check("one step from zero moments: exp_avg, exp_avg_sq, param", _first, 1),
            Check("ten steps, lr changing: the bias correction fades as t grows", _ten, 2),
            Check("a zero gradient under weight decay shrinks the parameter by lr * weight_decay", _zero_grad, 3),
            Check("a small MLP trained 10 steps with your step == with minitrain's AdamW", _trains_as_adamw, 2)]


def reference():
    """minitrain's AdamW, stepping one parameter that holds the given arrays."""
    from ...autograd import Tensor
    from ...optim import AdamW

    def adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
        q = Tensor(param, requires_grad=True)
        q.grad = grad
        optimizer = AdamW([q], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        optimizer.state[q] = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "step": step - 1}
        optimizer.step()
    return adamw_step
