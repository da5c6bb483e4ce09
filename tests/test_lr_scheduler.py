"""LR schedulers against torch.optim.lr_scheduler (2.13): the same learning rate at every step, bit
for bit, also when the schedule is saved half-way (as JSON, as a checkpoint stores it) and a new
scheduler continues from that state."""
import json
import warnings

import numpy as np
import pytest

import minitrain as mt
from minitrain import nn, optim
from minitrain.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, StepLR, warmup_cosine

torch = pytest.importorskip("torch")
TORCH = torch.optim.lr_scheduler

CASES = {
    "StepLR": (lambda o: StepLR(o, step_size=7, gamma=0.5), lambda o: TORCH.StepLR(o, step_size=7, gamma=0.5)),
    "CosineAnnealingLR": (lambda o: CosineAnnealingLR(o, T_max=13, eta_min=0.01),
                          lambda o: TORCH.CosineAnnealingLR(o, T_max=13, eta_min=0.01)),
    "LambdaLR(warmup_cosine)": (lambda o: LambdaLR(o, warmup_cosine(5, 30, min_ratio=0.1)),
                                lambda o: TORCH.LambdaLR(o, warmup_cosine(5, 30, min_ratio=0.1)),
                                # PyTorch's rule: a callable object's attributes travel with the state
                                lambda o: LambdaLR(o, warmup_cosine(1, 99, min_ratio=0.5))),
    "LambdaLR(two groups)": (lambda o: LambdaLR(o, [lambda e: 0.9 ** e, lambda e: 1 / (1 + e)]),
                             lambda o: TORCH.LambdaLR(o, [lambda e: 0.9 ** e, lambda e: 1 / (1 + e)])),
}


def _optimizers():
    mt.manual_seed(0)
    ours = optim.SGD([{"params": nn.Linear(2, 2).parameters()}, {"params": nn.Linear(2, 1).parameters(), "lr": 0.05}],
                     lr=0.3)
    theirs = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))]},
                              {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.05}], lr=0.3)
    return ours, theirs


@pytest.mark.parametrize("name", CASES)
def test_scheduler_gives_pytorchs_learning_rates_also_after_a_json_round_trip(name):
    make_ours, make_theirs, *resume = CASES[name]
    make_resumed = resume[0] if resume else make_ours
    ours_opt, theirs_opt = _optimizers()
    ours, theirs = make_ours(ours_opt), make_theirs(theirs_opt)
    seen, expected = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                  # torch: "step() before optimizer.step()"
        for step in range(40):
            seen.append([g["lr"] for g in ours_opt.param_groups])
            expected.append([g["lr"] for g in theirs_opt.param_groups])
            theirs_opt.step()
            theirs.step()
            ours.step()
            if step == 16:                               # a checkpoint: a new optimizer and scheduler resume
                state = json.loads(json.dumps(ours.state_dict()))
                groups = json.loads(json.dumps([{k: v for k, v in g.items() if k != "params"}
                                                for g in ours_opt.param_groups]))
                ours_opt, _ = _optimizers()
                ours = make_resumed(ours_opt)
                for group, saved in zip(ours_opt.param_groups, groups):
                    group.update(saved)
                ours.load_state_dict(state)
    assert seen == expected
    assert ours.get_last_lr() == [g["lr"] for g in theirs_opt.param_groups]


def test_warmup_cosine_rises_linearly_then_decays_to_the_floor():
    f = warmup_cosine(4, 20, min_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and f(20) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert np.all(np.diff([f(s) for s in range(4, 21)]) < 0)
    with pytest.raises(ValueError):
        warmup_cosine(-1, 10)


def test_a_scheduler_resumed_with_last_epoch_needs_the_optimizers_initial_lr():
    opt = optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(KeyError, match="initial_lr"):
        StepLR(opt, 3, last_epoch=5)
