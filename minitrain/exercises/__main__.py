"""``python -m minitrain.exercises {list, stub NAME DEST, check NAME PATH [--reference]}``."""
import argparse
import importlib.util
import pathlib
import shutil
import sys

import numpy as np

HERE = pathlib.Path(__file__).parent
EXERCISES = {
    "ring_all_reduce": "the ring all-reduce on point-to-point calls (notebook 02_collectives)",
    "one_f_one_b": "the 1F1B pipeline schedule (notebook 05_pipeline)",
    "megatron_f_g": "Megatron's f and g around a column/row-parallel MLP (notebook 06_tensor_parallel)",
}


def load_function(path, name):
    spec = importlib.util.spec_from_file_location(f"exercise_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise SystemExit(f"{path} defines no function {name}()")
    return getattr(module, name)


def check_ring_all_reduce(impl):
    """The library's collective checks, plus the ring's bandwidth bound, at p = 1..4."""
    from minitrain.comm import ThreadWorld
    from minitrain.testing import check_all_reduce

    results = []

    def bandwidth(comm):
        n = 1200
        before = comm.stats.bytes_sent
        impl(comm, np.ones(n, np.float32), op="sum")
        sent = comm.stats.bytes_sent - before
        bound = 2 * (comm.size - 1) * -(-n // comm.size) * 4
        assert sent <= bound, (f"[rank {comm.rank}] sent {sent} bytes for {n} float32 at p={comm.size}: "
                               f"a ring sends at most 2(p-1)·ceil(N/p)·4 = {bound}")

    for p in (1, 2, 3, 4):
        for label, fn in (("exact on every length, dtype and op", lambda c: check_all_reduce(c, impl)),
                          ("bytes sent within the ring's bound", bandwidth)):
            try:
                ThreadWorld(p, timeout=20).run(fn)
                results.append((f"p={p}: {label}", None))
            except BaseException as e:   # the learner's code may raise anything
                results.append((f"p={p}: {label}", e))
    return results


def check_one_f_one_b(impl):
    """The schedule checker, the bubble formula and 1F1B's in-flight bound, at p = 1..4, m = 1..8."""
    from minitrain.parallel.pipeline.schedules import Action, formula_bubble_fraction, simulate

    def as_actions(schedule, p):
        rows = []
        for s, row in enumerate(schedule):
            actions = []
            for item in row:
                kind, mb = (item.kind, item.microbatch) if isinstance(item, Action) else item
                prev, nxt = (s - 1 if s > 0 else None), (s + 1 if s < p - 1 else None)
                actions.append(Action(kind, mb, 0, prev, nxt) if kind == "F" else Action(kind, mb, 0, nxt, prev))
            rows.append(actions)
        return rows

    results = []
    for p in (1, 2, 3, 4):
        for label in ("deadlock-free, every unit once", "bubble (p-1)/(m+p-1)", "in flight <= min(p-s, m)"):
            try:
                for m in range(1, 9):
                    schedule = impl(p, m)
                    if len(schedule) != p:
                        raise AssertionError(f"p={p}, m={m}: {len(schedule)} stages instead of {p}")
                    sim = simulate(as_actions(schedule, p), 1.0, 2.0)
                    if label.startswith("bubble"):
                        expected = formula_bubble_fraction("1f1b", p, m)
                        assert abs(sim["bubble_fraction"] - expected) < 1e-9, \
                            f"p={p}, m={m}: bubble {sim['bubble_fraction']:.4f}, expected {expected:.4f}"
                    if label.startswith("in flight"):
                        bound = [min(p - s, m) for s in range(p)]
                        assert all(a <= b for a, b in zip(sim["peak_activations"], bound)), \
                            f"p={p}, m={m}: in flight {sim['peak_activations']}, 1F1B keeps {bound}"
                results.append((f"p={p}: {label}", None))
            except BaseException as e:   # the learner's code may raise anything
                results.append((f"p={p}: {label}", e))
    return results


def check_megatron_f_g(impl):
    """A column-then-row-parallel MLP built with the learner's f and g equals the unsplit MLP: output,
    input gradient and weight gradients, at t = 1..4."""
    import minitrain as mt
    from minitrain.backend import to_host
    from minitrain.comm import ThreadWorld
    from minitrain.nn import functional as F

    f_class, g_class = impl()
    rng = np.random.default_rng(0)
    x, A, B, dy = (rng.standard_normal(s) for s in ((5, 6), (6, 12), (12, 3), (5, 3)))
    xt, At, Bt = (mt.Tensor(a, requires_grad=True) for a in (x, A, B))
    y = (xt @ At).relu() @ Bt
    y.backward(dy)

    def run(comm):
        n = 12 // comm.size
        xs = mt.Tensor(x, requires_grad=True)
        a = mt.Tensor(A[:, comm.rank * n:(comm.rank + 1) * n].T.copy(), requires_grad=True)   # Linear: (out, in)
        b = mt.Tensor(B[comm.rank * n:(comm.rank + 1) * n].T.copy(), requires_grad=True)
        out = g_class.apply(F.linear(F.linear(f_class.apply(xs, comm), a).relu(), b), comm)
        out.backward(dy)
        return tuple(to_host(v) for v in (out.data, xs.grad, a.grad.T, b.grad.T))   # (GPU: copied back)

    results = []
    for t in (1, 2, 3, 4):
        try:
            outputs = ThreadWorld(t, timeout=20).run(run)
        except BaseException as e:   # the learner's code may raise anything
            results += [(f"t={t}: {label}", e) for label in ("forward", "input gradient", "weight gradients")]
            continue
        n = 12 // t
        for label, ok, why in (
                ("forward", all(np.allclose(o[0], y.numpy()) for o in outputs), "the output is not X A B"),
                ("input gradient", all(np.allclose(o[1], to_host(xt.grad)) for o in outputs), "dX is not the full dX"),
                ("weight gradients", all(np.allclose(o[2], to_host(At.grad)[:, r * n:(r + 1) * n]) and
                                         np.allclose(o[3], to_host(Bt.grad)[r * n:(r + 1) * n]) for r, o in enumerate(outputs)),
                 "dA_r / dB_r differ from the slices of dA / dB")):
            results.append((f"t={t}: {label}", None if ok else AssertionError(why)))
    return results


def _reference(name):
    if name == "megatron_f_g":
        from minitrain.parallel import tensor_parallel as tp
        return lambda: (tp.CopyToTensorParallelRegion, tp.ReduceFromTensorParallelRegion)
    if name == "one_f_one_b":
        from minitrain.parallel.pipeline.schedules import one_f_one_b
        return one_f_one_b
    from minitrain import comm as library
    return getattr(library, name)


CHECKS = {"ring_all_reduce": check_ring_all_reduce, "one_f_one_b": check_one_f_one_b,
          "megatron_f_g": check_megatron_f_g}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minitrain.exercises", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list")
    stub = sub.add_parser("stub")
    stub.add_argument("name", choices=sorted(EXERCISES))
    stub.add_argument("dest")
    check = sub.add_parser("check")
    check.add_argument("name", choices=sorted(EXERCISES))
    check.add_argument("path", nargs="?")
    check.add_argument("--reference", action="store_true", help="grade minitrain's own implementation")
    args = ap.parse_args(argv)

    if args.command == "list":
        for name, what in EXERCISES.items():
            print(f"{name:<20} {what}  (stub: {HERE / (name + '_stub.py')})")
        return 0
    if args.command == "stub":
        shutil.copy(HERE / f"{args.name}_stub.py", args.dest)
        print(f"wrote {args.dest}; then: python -m minitrain.exercises check {args.name} {args.dest}")
        return 0
    if args.reference:
        impl = _reference(args.name)
    elif args.path:
        impl = load_function(args.path, args.name)
    else:
        ap.error("check needs PATH (or --reference)")
    results = CHECKS[args.name](impl)
    failed = 0
    for label, error in results:
        if error is None:
            print(f"  PASS  {label}")
        else:
            failed += 1
            first = (str(error).splitlines() or [""])[0]
            notes = "; ".join(getattr(error, "__notes__", []))
            print(f"  FAIL  {label}\n        {type(error).__name__}: {first}" + (f" ({notes})" if notes else ""))
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
