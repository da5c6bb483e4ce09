"""Learning-rate schedulers with PyTorch's names, semantics and state (torch.optim.lr_scheduler):

    scheduler = CosineAnnealingLR(optimizer, T_max=100)
    for step in range(100):
        ...; optimizer.step(); scheduler.step()      # after the optimizer, as PyTorch >= 1.1

Construction sets group["initial_lr"] and takes the first step (last_epoch 0: the lr of the
first optimizer step); each step() advances last_epoch and writes the new lr into every
group. StepLR and CosineAnnealingLR use PyTorch's recursive ("chainable") forms, so their floats
are PyTorch's bit for bit; warmup_cosine is the GPT's default (linear warm-up, then cosine decay
to min_ratio x lr: nanoGPT's schedule), a callable object for LambdaLR, so its settings
travel with state_dict() as in PyTorch. state_dict() is JSON-able: checkpoints store it.
"""
import math
import types

from ..backend import is_int


class LRScheduler:
    def __init__(self, optimizer, last_epoch=-1):
        self.optimizer = optimizer
        for i, group in enumerate(optimizer.param_groups):
            if last_epoch == -1:
                group.setdefault("initial_lr", group["lr"])
            elif "initial_lr" not in group:
                raise KeyError(f"param 'initial_lr' is not specified in param_groups[{i}] when resuming a scheduler "
                               f"with last_epoch >= 0 (load the optimizer's state first)")
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._step_count = 0
        self._is_initial = True
        self.step()
        self._is_initial = False

    def get_lr(self):
        raise NotImplementedError

    def get_last_lr(self):
        return self._last_lr

    def step(self):
        """Advance one step (call it after ``optimizer.step()``) and set every group's lr."""
        self._step_count += 1
        self.last_epoch += 1
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self):
        """Everything but the optimizer (PyTorch's rule); JSON-able."""
        return {key: value for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state_dict):
        self.__dict__.update(state_dict)


class LambdaLR(LRScheduler):
    """lr = initial lr x ``lr_lambda(last_epoch)`` (one function, or one per group)."""

    def __init__(self, optimizer, lr_lambda, last_epoch=-1):
        groups = len(optimizer.param_groups)
        if isinstance(lr_lambda, (list, tuple)):
            if len(lr_lambda) != groups:
                raise ValueError(f"Expected {groups} lr_lambdas, but got {len(lr_lambda)}")
            self.lr_lambdas = list(lr_lambda)
        else:
            self.lr_lambdas = [lr_lambda] * groups
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [base_lr * fn(self.last_epoch) for fn, base_lr in zip(self.lr_lambdas, self.base_lrs)]

    def state_dict(self):
        """As PyTorch: a callable object's attributes are saved, a plain function's cannot be."""
        state = {key: value for key, value in self.__dict__.items() if key not in ("optimizer", "lr_lambdas")}
        state["lr_lambdas"] = [None if isinstance(fn, types.FunctionType) else dict(fn.__dict__)
                               for fn in self.lr_lambdas]
        return state

    def load_state_dict(self, state_dict):
        state = dict(state_dict)
        lambdas = state.pop("lr_lambdas")
        self.__dict__.update(state)
        for fn, saved in zip(self.lr_lambdas, lambdas):
            if saved is not None:
                fn.__dict__.update(saved)


class StepLR(LRScheduler):
    """Multiply the lr by ``gamma`` every ``step_size`` steps."""

    def __init__(self, optimizer, step_size, gamma=0.1, last_epoch=-1):
        if not (is_int(step_size) and step_size >= 1):     # (PyTorch: 0 divides by 0
            raise ValueError(f"StepLR: step_size must be an integer >= 1, got {step_size!r}")  # at the first step)
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return [group["lr"] for group in self.optimizer.param_groups]
        return [group["lr"] * self.gamma for group in self.optimizer.param_groups]


class CosineAnnealingLR(LRScheduler):
    """lr_t = eta_min + (lr_0 - eta_min)(1 + cos(pi t / T_max)) / 2, computed as PyTorch does, by
    recurrence from the previous lr (so another scheduler may change the lr in between)."""

    def __init__(self, optimizer, T_max, eta_min=0.0, last_epoch=-1):  # noqa: N803 (PyTorch's name)
        if not T_max > 0:                     # (PyTorch: 0 divides by 0 at the first step)
            raise ValueError(f"CosineAnnealingLR: T_max must be > 0, got {T_max!r}")
        self.T_max, self.eta_min = T_max, eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        groups = self.optimizer.param_groups
        if self._is_initial:
            return [group["lr"] for group in groups]
        if self._step_count == 1 and self.last_epoch > 0:
            return [self.eta_min + (base_lr - self.eta_min) * (1 + math.cos(self.last_epoch * math.pi / self.T_max)) / 2
                    for base_lr in self.base_lrs]
        if (self.last_epoch - 1 - self.T_max) % (2 * self.T_max) == 0:
            return [group["lr"] + (base_lr - self.eta_min) * (1 - math.cos(math.pi / self.T_max)) / 2
                    for base_lr, group in zip(self.base_lrs, groups)]
        return [(1 + math.cos(math.pi * self.last_epoch / self.T_max))
                / (1 + math.cos(math.pi * (self.last_epoch - 1) / self.T_max)) * (group["lr"] - self.eta_min) + self.eta_min
                for group in groups]


class warmup_cosine:  # noqa: N801 (used as a function: LambdaLR(opt, warmup_cosine(...)))
    """The factor for ``LambdaLR``: (step + 1) / warmup_steps during the warm-up, then a cosine from 1
    down to ``min_ratio`` at ``total_steps`` (and ``min_ratio`` after). PyTorch expresses it as
    ``LambdaLR(opt, warmup_cosine(...))`` too (the object is plain Python)."""

    def __init__(self, warmup_steps, total_steps, min_ratio=0.1):
        if warmup_steps < 0 or total_steps < 1 or not 0 <= min_ratio <= 1:
            raise ValueError(f"warmup_cosine needs warmup_steps >= 0, total_steps >= 1, 0 <= min_ratio <= 1; got "
                             f"{warmup_steps}, {total_steps}, {min_ratio}")
        self.warmup_steps, self.total_steps, self.min_ratio = warmup_steps, total_steps, min_ratio

    def __call__(self, step):
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
