"""Grader: the learner's DynamicLossScaler: unscale_ divides in place and finds inf and NaN; on a
scripted run of clean and overflowing steps, under two settings of the factors and the interval,
the scale follows PyTorch's GradScaler rule (and torch._amp_update_scale_ itself where torch is
installed); and a float16 training run driven by it skips the same steps, ends with the same scale
and bit-identical weights as minitrain's MixedPrecisionOptimizer."""
import numpy as np

from ..comparing import compare, to_learner
from ..grading import Check, Mismatch
from ..oracles import has_torch, need_torch

TITLE = "dynamic loss scaling for float16 training"
ORDER = 180
KIND = "implement"
NOTEBOOK = "04_zero"
DEFINES = "DynamicLossScaler"
SCRIPT = (False, False, True, False, False, False, False, False, False, True, True, False, False, False, False)

STUB = '''"""Exercise dynamic_loss_scaling: dynamic loss scaling (Micikevicius et al. 2018, "Mixed Precision
Training"; PyTorch's GradScaler).

In float16 small gradients underflow to zero. So the loss is multiplied by a scale S before
backward (every gradient is then S times larger), and the gradients are divided by S, in float32,
before the optimizer step. Too large an S makes some gradient overflow to inf (or NaN): that step
must be skipped and S lowered. S is raised again after a run of clean steps.

Write the class DynamicLossScaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
growth_interval=2000) with
  self.scale          the current S (a float); the training loop multiplies the loss by it;
  unscale_(grads)     grads: a list of float32 arrays (the scaled gradients): divide each by the
                      scale, in place; return True if any of them holds an inf or a NaN;
  update(found_inf)   after each step: on an overflow multiply the scale by backoff_factor and
                      start counting clean steps afresh; after growth_interval clean steps in a
                      row multiply it by growth_factor (and start counting afresh).
The training loop (the grader's) skips the optimizer step when unscale_ returned True.

The test to pass: unscale_ on finite, inf, -inf and NaN gradients; the scale along a scripted run
of clean and overflowing steps, with two settings of the factors and the interval, equals PyTorch's
GradScaler rule (torch._amp_update_scale_ when torch is installed); a float16 training run with it
skips the same steps and ends with the same scale and the same weights, bit for bit, as minitrain's
MixedPrecisionOptimizer.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check dynamic_loss_scaling mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check dynamic_loss_scaling mine.py
Stuck?     python -m minitrain.exercises hint dynamic_loss_scaling
"""
import numpy as np


class DynamicLossScaler:
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        raise NotImplementedError("DynamicLossScaler: keep the scale and a count of clean steps")

    def unscale_(self, grads):
        raise NotImplementedError("DynamicLossScaler.unscale_")

    def update(self, found_inf):
        raise NotImplementedError("DynamicLossScaler.update")
'''

HINTS = (
    "State: the scale and the number of clean steps since the last change. unscale_: for g in grads: "
    "g /= self.scale (in place: g itself, not a new array); found = any(not np.isfinite(g).all() for "
    "g in grads). inf / S is still inf and NaN stays NaN, so checking after unscaling is fine.",
    "update(found_inf): on an overflow, scale *= backoff_factor and the clean-step count goes back to "
    "0. Otherwise count += 1, and when the count reaches growth_interval, scale *= growth_factor and "
    "count = 0. Forgetting to reset the count on an overflow grows the scale too early.",
    "The scale stays a power of two (2**16 times 2 or 0.5), so dividing by it is exact in float32: "
    "that is why the grader can ask for bit-identical weights. Keep self.scale a Python float.",
)


def _unscale(impl):
    scaler = impl(init_scale=8.0)
    cases = (("finite", [np.array([8.0, -16.0, 4.0], np.float32), np.array([[2.0]], np.float32)], False),
             ("an inf", [np.array([8.0, np.inf], np.float32)], True),
             ("a -inf", [np.array([1.0], np.float32), np.array([-np.inf, 0.0], np.float32)], True),
             ("a NaN", [np.array([np.nan, 1.0], np.float32)], True))
    for label, originals, overflow in cases:
        grads = [to_learner(g) for g in originals]        # on the GPU when the device is cuda
        found = scaler.unscale_(grads)
        if bool(found) != overflow:
            raise Mismatch(f"unscale_ on gradients with {label}: returned {found!r}, expected {overflow}")
        for i, (g, o) in enumerate(zip(grads, originals)):
            problem = compare(g, o / 8.0, f"unscale_ ({label}): gradient {i} after the call (scale 8)", exact=True)
            if problem:
                raise Mismatch(problem + " (divide each array in place by the scale)")


def _rule(script, init, growth, backoff, interval):
    scale, clean, out = init, 0, []
    for overflow in script:
        if overflow:
            scale, clean = scale * backoff, 0
        else:
            clean += 1
            if clean == interval:
                scale, clean = scale * growth, 0
        out.append(scale)
    return out


def _torch_rule(script, init, growth, backoff, interval):
    torch = need_torch()
    scale, tracker, out = torch.tensor([init]), torch.tensor([0], dtype=torch.int32), []
    for overflow in script:
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(overflow)]), growth, backoff, interval)
        out.append(float(scale[0]))
    return out


#: (growth_factor, backoff_factor, growth_interval): PyTorch's defaults, then other factors, so that a
#: scaler which doubles and halves whatever it was given is caught
SETTINGS = ((2.0, 0.5, 3), (4.0, 0.25, 2))


def _scripted(impl):
    for growth, backoff, interval in SETTINGS:
        scaler = impl(init_scale=2.0 ** 16, growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
        got = []
        for overflow in SCRIPT:
            scaler.update(overflow)
            got.append(float(scaler.scale))
        want = _rule(SCRIPT, 2.0 ** 16, growth, backoff, interval)
        if has_torch():
            oracle = _torch_rule(SCRIPT, 2.0 ** 16, growth, backoff, interval)
            assert oracle == want, f"the grader's rule {want} differs from torch's {oracle}"
        if got != want:
            step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            steps = ", ".join("overflow" if o else "clean" for o in SCRIPT[:step + 1])
            raise Mismatch(f"growth_factor={growth:g}, backoff_factor={backoff:g}, growth_interval={interval}, "
                           f"steps: {steps}: after step {step} the scale is {got[step]:g}, expected {want[step]:g} "
                           f"(GradScaler's rule, with the factors the scaler was given; the whole run: expected "
                           f"{[int(s) for s in want]}, got {[int(s) if s == int(s) else s for s in got]})")


def _train(make_optimizer, steps=12):
    """A float16 Linear(4, 3) trained with SGD on fp32 masters; returns (scales, skipped, weights)."""
    import minitrain as mt
    from minitrain.nn import Linear
    from minitrain.nn import functional as F
    mt.manual_seed(0)
    model = Linear(4, 3)
    model.to(np.float16)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 4)).astype(np.float16), to_learner(rng.integers(0, 3, 8))
    step, scale_of = make_optimizer(model)
    scales, skipped = [], []
    for _ in range(steps):
        model.zero_grad()
        loss = F.cross_entropy(model(mt.Tensor(x)).float(), y)
        with np.errstate(over="ignore", invalid="ignore"):        # the overflows are the point
            (loss * scale_of()).backward()
            skipped.append(not step())
        scales.append(float(scale_of()))
    return scales, skipped, [q.data.copy() for q in model.parameters()]


def _library(model):
    from minitrain.optim import SGD, MixedPrecisionOptimizer
    opt = MixedPrecisionOptimizer(model.parameters(), SGD, loss_scale="dynamic", init_scale=2.0 ** 24,
                                  growth_interval=2, lr=0.5)
    return opt.step, lambda: opt.loss_scale


def _learners(impl):
    def make(model):
        import minitrain as mt
        from minitrain.optim import SGD
        params = list(model.parameters())
        masters = [mt.Tensor(q.data.astype(np.float32), requires_grad=True) for q in params]
        opt = SGD(masters, lr=0.5)
        scaler = impl(init_scale=2.0 ** 24, growth_interval=2)

        def step():
            grads = [q.grad.astype(np.float32) for q in params]
            found = scaler.unscale_(grads)
            if not found:
                for m, g in zip(masters, grads):
                    m.grad = g
                opt.step()
                for q, m in zip(params, masters):
                    q.data[...] = m.data
            scaler.update(bool(found))
            return not found
        return step, lambda: scaler.scale
    return make


def _training(impl):
    want_scales, want_skipped, want_weights = _train(_library)
    scales, skipped, weights = _train(_learners(impl))
    if skipped != want_skipped:
        raise Mismatch(f"float16 training from a scale of 2**24: skipped steps {[i for i, s in enumerate(skipped) if s]}, "
                       f"minitrain's MixedPrecisionOptimizer skips {[i for i, s in enumerate(want_skipped) if s]}")
    if scales != want_scales:
        raise Mismatch(f"float16 training: scales {scales}, minitrain's MixedPrecisionOptimizer {want_scales}")
    for i, (got, want) in enumerate(zip(weights, want_weights)):
        problem = compare(got, want, f"float16 training: parameter {i} after 12 steps vs minitrain's "
                          "MixedPrecisionOptimizer", exact=True)
        if problem:
            raise Mismatch(problem)


def checks():
    return [Check("unscale_: divides in place, finds inf, -inf and NaN", _unscale, 1),
            Check("update: the scale follows GradScaler's rule on a scripted run", _scripted, 2),
            Check("float16 training: same skipped steps, scale and weights as MixedPrecisionOptimizer", _training, 3)]


def reference():
    from minitrain.backend import array_module

    class DynamicLossScaler:
        """torch.amp.GradScaler's rule, as minitrain's MixedPrecisionOptimizer applies it (its unscale
        multiplies by 1/S, exact for a power of two)."""

        def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
            self.scale, self.growth, self.backoff, self.interval = float(init_scale), growth_factor, backoff_factor, growth_interval
            self.clean = 0

        def unscale_(self, grads):
            for g in grads:
                g *= 1.0 / self.scale
            # one deliberate read of a flag per array (a GPU-to-host copy on the GPU)
            return any(not array_module(g).isfinite(g).all() for g in grads)

        def update(self, found_inf):
            if found_inf:
                self.scale *= self.backoff
                self.clean = 0
                return
            self.clean += 1
            if self.clean % self.interval == 0:
                self.scale *= self.growth
    return DynamicLossScaler
