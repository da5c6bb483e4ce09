"""Grader: one parameter's ZeRO-Offload step (Ren et al. 2021; minitrain's CPUOffloadOptimizer over
MixedPrecisionOptimizer): the 16-bit gradient copied to the host, unscaled in fp32, the step skipped
on inf/NaN, Adam on the fp32 host master and moments, the master rounded back into the parameter in
place. One step and five (fp32 math, 1e-6), a skipped step, small gradients that fp16 unscaling
loses, tiny updates that rounding each step loses, and a float16 MLP trained with the learner's
step beside minitrain's CPUOffloadOptimizer."""
import numpy as np

from ..comparing import compare, host, to_learner
from ..grading import Check, Mismatch

TITLE = "ZeRO-Offload's step: gradient to the host, fp32 Adam on the master, rounded weights back"
ORDER = 105
KIND = "implement"
NOTEBOOK = "04_zero"
DEFINES = "offload_step"

STUB = '''"""Exercise offload_step: ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale
Model Training") keeps the fp32 master weights and Adam's two moments in host memory, 12 of the 16
bytes per parameter of mixed-precision Adam, and runs the update on the CPU. The device keeps the
16-bit parameter and gradient. Each step the gradient goes device -> host, the update runs on the
host in fp32, and the new weights come back host -> device, rounded to 16 bits.

Write offload_step(param, grad, master, exp_avg, exp_avg_sq, step, lr, loss_scale, betas, eps):
one parameter's step, as minitrain's CPUOffloadOptimizer makes it; return True, or False when the
step was skipped.

Contract:
  - param, grad: the parameter and its gradient on the device (float16; grad is loss_scale times
    the true gradient). master, exp_avg, exp_avg_sq: float32 arrays of the same shape on the host;
  - move arrays only with minitrain.backend: g = backend.to_host(grad) (device -> host) and
    backend.to_device(...) (host -> device). On NumPy both are no-ops; on the GPU they are the
    counted copies, and mixing a host and a device array in one operation is an error;
  - unscale in float32: g = g.astype(np.float32) / loss_scale (in fp16, small gradients underflow);
  - if g holds an inf or a NaN: change nothing and return False (the caller lowers the scale);
  - else Adam with t = step (counted from 1), on the host, in float32, in place:
      exp_avg    *= beta1;  exp_avg    += (1 - beta1) * g
      exp_avg_sq *= beta2;  exp_avg_sq += (1 - beta2) * g * g
      denom = sqrt(exp_avg_sq) / sqrt(1 - beta2 ** t) + eps
      master     -= lr / (1 - beta1 ** t) * exp_avg / denom
    (minitrain's order: written so, your weights equal its bit for bit);
  - then write the master, rounded to param's dtype, into param in place (param[...] = ...: the
    model holds that array) and return True. Leave grad as it is.

The test to pass:
  - one step, then five with a changing loss scale: moments and master equal Adam's rule on the
    unscaled fp32 gradient (1e-6), param equals the master rounded to float16;
  - gradients with an inf or a NaN: False, and nothing changed;
  - true gradients near 1e-6 (2**15 times that in fp16): unscaling in fp16 loses their digits;
  - lr 1e-5 on weights near 1: each update is below fp16's spacing, yet the fp32 master moves;
  - a float16 MLP trained 5 steps with your step: the weights of minitrain's CPUOffloadOptimizer.

Check it:  python -m minitrain.exercises check offload_step mine.py
Stuck?     python -m minitrain.exercises hint offload_step
"""
import numpy as np

from minitrain import backend


def offload_step(param, grad, master, exp_avg, exp_avg_sq, step, lr, loss_scale, betas=(0.9, 0.999), eps=1e-8):
    raise NotImplementedError("offload_step: grad to the host, unscale in fp32, skip on inf/NaN, Adam, round back")
'''

HINTS = (
    "Three places, three precisions: grad and param are 16-bit on the device; master and the moments are "
    "fp32 on the host. g = backend.to_host(grad).astype(np.float32) / loss_scale brings the gradient over "
    "and unscales it in fp32 (dividing the fp16 array itself keeps fp16: 1e-6 is below its normal range).",
    "Check before touching anything: if not np.isfinite(g).all(): return False. Then Adam on the master in "
    "place (master -= ..., exp_avg *= ..., exp_avg += ...): the caller keeps these arrays across steps, "
    "and the master must never pass through float16, or updates smaller than fp16's spacing vanish.",
    "Last, param[...] = backend.to_device(master.astype(param.dtype)): the rounding happens once, on the "
    "way back, into the array the model holds (param = ... would only rename a local). Return True.",
)

BETAS, EPS = (0.9, 0.999), 1e-8


def _rule(param, grad, master, m, v, t, lr, scale, mistake=None):
    """The step on host copies, in minitrain's order (mistake: one of the usual slips, to name it)."""
    master, m, v = master.copy(), m.copy(), v.copy()
    b1, b2 = BETAS
    if mistake == "fp16 unscale":
        with np.errstate(over="ignore"):                    # 2**16 itself is inf in fp16
            g = (grad / scale).astype(np.float32)
    else:
        g = grad.astype(np.float32) / np.float32(1.0 if mistake == "scaled" else scale)
    if not np.isfinite(g).all():
        return param.copy(), master, m, v
    w = master.astype(np.float16) if mistake == "fp16 update" else master
    m *= b1
    m += (1.0 - b1) * g
    v *= b2
    v += (1.0 - b2) * (g * g)
    denom = v ** 0.5
    denom /= np.sqrt(1.0 - b2 ** t)
    denom += EPS
    w -= lr / (1.0 - b1 ** t) * (m / denom)
    master[...] = w
    return master.astype(param.dtype), master, m, v


MISTAKES = {"scaled": "Adam on the scaled gradient: divide the gradient by loss_scale before the moments see it",
            "fp16 unscale": "the gradient was unscaled in float16 (grad / loss_scale keeps fp16, where small "
                            "gradients underflow): convert it to float32 first, then divide",
            "fp16 update": "the update was computed in (or rounded to) float16: rounding each step loses updates "
                           "smaller than fp16's spacing; the master stays fp32 and only param is rounded"}


def _one(impl, param, grad, master, m, v, t, lr, scale, what):
    """Run impl on the learner's copies; compare with the rule; name the slip where one explains it."""
    p, g = to_learner(param), to_learner(grad)              # the device's arrays (CuPy under cuda)
    mm, mv, mv2 = np.array(master), np.array(m), np.array(v)  # the host's
    returned = impl(p, g, mm, mv, mv2, t, lr, scale, BETAS, EPS)
    want = _rule(param, grad, master, m, v, t, lr, scale)
    finite = bool(np.isfinite(grad.astype(np.float32) / scale).all())
    if type(returned) not in (bool, np.bool_) or bool(returned) != finite:
        raise Mismatch(f"{what}: returned {returned!r}, expected {finite} ("
                       + ("a step was made" if finite else "the gradient holds an inf or a NaN: skip the step") + ")")
    if not np.array_equal(host(g), grad, equal_nan=True):
        raise Mismatch(f"{what}: grad changed; leave it as it is (unscale a host copy)")
    got = (host(p), mm, mv, mv2)
    for k, name, before in ((2, "exp_avg", m), (3, "exp_avg_sq", v), (1, "master", master)):
        problem = compare(got[k], want[k], f"{what}: {name}", rtol=1e-6, atol=1e-30)
        if problem is None:
            continue
        slips = []                                          # one of the usual slips, if it explains what came out
        for slip, why in MISTAKES.items():
            theirs = _rule(param, grad, master, m, v, t, lr, scale, slip)[k]
            if finite and not np.array_equal(theirs, before) and np.allclose(got[k], theirs, rtol=1e-6, atol=1e-30):
                slips.append(why)
        if not finite:
            problem += f"; the step should have been skipped: {name} must not change"
        elif slips:
            problem += f"; {slips[0]}"
        elif np.array_equal(got[k], before):
            problem += f"; {name} is unchanged: update the caller's array in place ({name} -= ..., {name} += ...)"
        raise Mismatch(problem)
    if got[0].dtype != param.dtype:
        raise Mismatch(f"{what}: param became {got[0].dtype}; it stays {param.dtype}")
    rounded = mm.astype(param.dtype)
    problem = compare(got[0], rounded, f"{what}: param", exact=True)
    if problem:
        if not finite:
            problem += "; the step should have been skipped: param must not change"
        elif np.array_equal(got[0], param):
            problem += "; param is unchanged: write the rounded master into it in place (param[...] = ...)"
        raise Mismatch(problem + " (param must be the master rounded to " + str(param.dtype) + ")")
    return want


def _values(shape, seed, scale):
    rng = np.random.default_rng(seed)
    master = rng.standard_normal(shape).astype(np.float32)
    return master.astype(np.float16), master, lambda: (rng.standard_normal(shape) * scale).astype(np.float16)


def _zeros(shape):
    return np.zeros(shape, np.float32), np.zeros(shape, np.float32)


def _first(impl):
    param, master, grad = _values((3, 4), 0, 1024 * 0.05)
    _one(impl, param, grad(), master, *_zeros((3, 4)), 1, 1e-2, 1024.0, "step 1, loss scale 1024")


def _five(impl):
    param, master, _ = _values((7,), 1, 1)
    m, v = _zeros(7)
    rng = np.random.default_rng(2)
    for t, scale in zip(range(1, 6), (2.0 ** 15, 2.0 ** 14, 2.0 ** 14, 512.0, 1.0)):
        grad = (rng.standard_normal(7) * 1e-2 * scale).astype(np.float16)
        param, master, m, v = _one(impl, param, grad, master, m, v, t, 3e-3, scale,
                                   f"step {t} of 5 (loss scale {scale:g})")


def _skips(impl):
    param, master, _ = _values((6,), 3, 1)
    m, v = _zeros(6)
    good = np.full(6, 0.5, np.float16)
    param, master, m, v = _one(impl, param, good, master, m, v, 1, 1e-2, 8.0, "step 1, a clean gradient")
    for label, bad in (("an inf", np.inf), ("a -inf", -np.inf), ("a NaN", np.nan)):
        grad = good.copy()
        grad[4] = bad
        _one(impl, param, grad, master, m, v, 2, 1e-2, 8.0, f"step 2, a gradient with {label}")


def _small_grads(impl):
    param, master, _ = _values((8,), 4, 1)
    rng = np.random.default_rng(5)
    true = rng.uniform(1e-7, 2e-6, 8) * rng.choice([-1, 1], 8)     # below fp16's normal range (6.1e-5)
    grad = (true * 2.0 ** 15).astype(np.float16)
    _one(impl, param, grad, master, *_zeros(8), 1, 1e-3, 2.0 ** 15,
         "true gradients near 1e-6, loss scale 2**15 (fp16 holds the scaled ones, the true ones only coarsely)")


def _tiny_lr(impl):
    master = np.float32(1.0) + np.arange(6, dtype=np.float32) * np.float32(2.0 ** -10)   # fp16 values near 1
    param = master.astype(np.float16)
    m, v = _zeros(6)
    for t in range(1, 6):
        grad = np.full(6, 0.25 * 128, np.float16)
        param, master, m, v = _one(impl, param, grad, master, m, v, t, 1e-5, 128.0,
                                   f"step {t} of 5, lr 1e-5 on weights near 1 (fp16's spacing there: 0.001)")


def _mlp(seed):
    from ... import manual_seed, nn
    manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    model.to(np.float16)
    return model


def _trains_as_offload(impl):
    from ...autograd import Tensor
    from ...optim import Adam
    from ...parallel.offload import CPUOffloadOptimizer
    rng = np.random.default_rng(6)
    x, y = rng.standard_normal((16, 4)), rng.standard_normal((16, 4))
    lr, scale = 1e-2, 1024.0
    library, mine = _mlp(7), _mlp(7)
    optimizer = CPUOffloadOptimizer(library.parameters(), Adam, lr=lr, betas=BETAS, eps=EPS, loss_scale=scale)
    params = list(mine.parameters())
    state = [(host(q.data).astype(np.float32), *_zeros(q.shape)) for q in params]
    for t in range(1, 6):
        for model in (library, mine):
            model.zero_grad()
            out = model(Tensor(to_learner(x.astype(np.float16)))).float()
            (((out - Tensor(to_learner(y.astype(np.float32)))) ** 2).mean() * scale).backward()
        optimizer.step()
        for q, (master, m, v) in zip(params, state):
            if not impl(q.data, q.grad, master, m, v, t, lr, scale, BETAS, EPS):    # the model's own arrays
                raise Mismatch(f"step {t}: your step returned a falsy value on finite gradients")
        for (name, q), theirs, (master, _, _), master_theirs in zip(mine.named_parameters(), library.parameters(),
                                                                    state, optimizer.masters):
            for what, g, w, rtol in (("master", master, master_theirs, 1e-5), ("param", q.data, theirs.data, 1e-3)):
                problem = compare(host(g), host(w), f"after step {t}, {name}'s {what}", rtol=rtol, atol=1e-6)
                if problem:
                    raise Mismatch(problem + ": the MLP trained with your step drifted from CPUOffloadOptimizer's")


def checks():
    return [Check("one step (fp16 param and grad, loss scale 1024): moments, fp32 master, param", _first, 1),
            Check("five steps, the loss scale changing: the gradient is unscaled before Adam", _five, 1),
            Check("an inf or a NaN in the gradient: returns False and changes nothing", _skips, 2),
            Check("true gradients near 1e-6: unscaled in fp32, not fp16", _small_grads, 1),
            Check("lr 1e-5 on weights near 1: the fp32 master keeps updates fp16 would lose", _tiny_lr, 2),
            Check("a float16 MLP trained 5 steps with your step == with minitrain's CPUOffloadOptimizer",
                  _trains_as_offload, 3)]


def reference():
    """minitrain's CPUOffloadOptimizer over Adam, stepping one parameter that holds the given arrays."""
    from ...autograd import Tensor
    from ...optim import Adam
    from ...parallel.offload import CPUOffloadOptimizer

    def offload_step(param, grad, master, exp_avg, exp_avg_sq, step, lr, loss_scale, betas=BETAS, eps=EPS):
        q = Tensor(param, requires_grad=True)
        q.grad = grad
        optimizer = CPUOffloadOptimizer([q], Adam, lr=lr, betas=betas, eps=eps, loss_scale=float(loss_scale))
        optimizer.masters[0].data = master                    # the caller's host arrays, updated in place
        optimizer.optimizer.state[optimizer.masters[0]] = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
                                                           "step": step - 1}
        return optimizer.step()
    return offload_step
