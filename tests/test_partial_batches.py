"""Exact global-batch semantics on any data size and any world: the last partial batch of every
epoch and batches that the ranks (or the micro-batches) do not divide. No sample is repeated or
dropped; each rank's (each micro-batch's) mean loss is weighted by its rows over the global batch's,
so DDP, local SGD (at its averaging steps: every step, SGD), ZeRO-1/2/3, the pipeline schedules,
tensor parallelism and the 3D GPT take the steps one process takes, and a resume on another world
size continues exactly. Float64, against one process at every step (the jobs' --json losses).

The digits' 1,438 training rows in global batches of 100 leave 38: at 3 ranks every batch is cut
34/33/33 and the last 13/13/12; --batch-size 479 leaves 1 row (two of 3 ranks have none; 7 of
m = 8 micro-batches are empty). The GPT's batches of 5 and 3 rows do not divide dp 2 or 4
(a replica with no row) nor m = 2 or 3."""
import json
import pathlib
import shutil
import sys

import numpy as np
import pytest

from minitrain import checkpoint
from minitrain.data import DataLoader, DistributedSampler, share_weight, split_sizes
from minitrain.examples import gpt, mlp
from minitrain.testing import run_mpi

PROGRAM = str(pathlib.Path(__file__).parent / "programs" / "partial_batches.py")
RTOL = 1e-10
MLP = "--no-progress --precision fp64 --epochs 2 --batch-size 100"
GPT = "--no-progress --precision fp64 --steps 6 --n-embd 32 --block-size 16 --sample-chars 1"


# ---------------------------------------------------------------- the sampler and the loader, every world
def rank_batches(n, batch, world, epoch=1, drop_last=False, start=0):
    """Per rank, the index batches its global-batch loader yields, and the global rows of each."""
    out = []
    for r in range(world):
        loader = DataLoader((np.arange(n),), batch, sampler=DistributedSampler(n, num_replicas=world, rank=r, seed=3),
                            drop_last=drop_last, global_batch=True)
        loader.set_epoch(epoch)
        if start:
            loader.load_state_dict({"epoch": epoch, "batches_done": start, "seed": 3, "global_batch_size": batch})
        mine = []
        for (b,) in loader:
            mine.append((b.tolist(), loader.global_rows))
        out.append(mine)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_every_sample_once_per_epoch_in_one_process_s_batches(world):
    n, batch = 23, 5                                   # 23 = 4 x 5 + 3: the last batch has fewer rows than 4 or 7 ranks
    one = [b for b, _ in rank_batches(n, batch, 1)[0]]
    ranks = rank_batches(n, batch, world)
    assert len(one) == 5 and all(len(r) == len(one) for r in ranks)
    for j, global_batch in enumerate(one):
        parts = [ranks[r][j][0] for r in range(world)]
        assert sorted(sum(parts, [])) == sorted(global_batch)            # no sample repeated or dropped
        assert [len(p) for p in parts] == split_sizes(len(global_batch), world)
        assert all(ranks[r][j][1] == len(global_batch) for r in range(world))
    seen = np.bincount(sum((b for r in ranks for b, _ in r), []), minlength=n)
    assert seen.tolist() == [1] * n


def test_full_batches_keep_pytorch_s_rows_where_the_ranks_divide_the_batch():
    """Bit-identical losses where the data divides: rank r's rows in order, as the padded layout gives them."""
    n, batch, world = 20, 8, 4
    for r in range(world):
        old = DataLoader((np.arange(n),), batch // world, sampler=DistributedSampler(n, num_replicas=world, rank=r, seed=3))
        new = DataLoader((np.arange(n),), batch, sampler=DistributedSampler(n, num_replicas=world, rank=r, seed=3), global_batch=True)
        assert [b.tolist() for (b,) in new][:2] == [b.tolist() for (b,) in old][:2]


def test_drop_last_drops_the_partial_batch_only():
    ranks = rank_batches(23, 5, 3, drop_last=True)
    assert all(len(r) == 4 for r in ranks)
    assert all(rows == 5 for r in ranks for _, rows in r)
    assert len(DataLoader((np.arange(23),), 5, drop_last=True, global_batch=True)) == 4
    assert len(DataLoader((np.arange(23),), 5, global_batch=True)) == 5


def test_the_position_carries_over_to_any_world_size():
    one = [sorted(b) for b, _ in rank_batches(1438, 100, 1)[0]]
    for world, start in ((4, 9), (3, 14), (2, 0)):
        ranks = rank_batches(1438, 100, world, start=start)
        assert [sorted(sum(parts, [])) for parts in zip(*[[b for b, _ in r] for r in ranks])] == one[start:]


def test_weights_make_the_ranks_mean_the_global_mean():
    rng = np.random.default_rng(0)
    values = rng.standard_normal(13)
    for world in (1, 2, 3, 4, 5, 20):
        shares = np.array_split(values, world)             # as uneven as split_sizes, some empty
        means = [s.mean() * share_weight(len(s), 13, world) if len(s) else 0.0 for s in shares]
        assert np.mean(means) == pytest.approx(values.mean(), rel=1e-14)
    assert share_weight(25, 100, 4) == 1.0


# ---------------------------------------------------------------- the jobs under mpiexec
def launch(tmp_path, n, runs):
    """One mpiexec launch of several job runs; returns {name: --json report}."""
    run_mpi([sys.executable, PROGRAM, tmp_path, *("|".join(r) for r in runs)], n=n, timeout=300)
    return {name: json.loads((tmp_path / f"{name}.json").read_text()) for name, _, _ in runs}


def reference(tmp_path, module, flags):
    """One process, in this process."""
    out = tmp_path / f"reference-{len(list(tmp_path.glob('reference-*')))}.json"
    assert {"mlp": mlp, "gpt": gpt}[module].main(flags.split() + ["--json", str(out)]) == 0
    return json.loads(out.read_text())


def assert_equal_steps(report, ref, name):
    first, losses = report["first_step"], report["losses"]
    expected = ref["losses"][first:]
    assert len(losses) == len(expected) > 0, f"{name}: {len(losses)} steps, one process {len(expected)}"
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    assert worst <= RTOL, f"{name}: relative difference {worst:.3g} from one process"
    if first == 0 and "final_val_loss" in ref:     # the GPT's validation: a replica may hold none of its rows
        assert report["final_val_loss"] == pytest.approx(ref["final_val_loss"], rel=RTOL), name


def keep_until(directory, step):
    for saved, _, path in checkpoint.list_checkpoints(directory):
        if saved > step:
            shutil.rmtree(path)


@pytest.mark.slow
def test_the_jobs_equal_one_process_on_every_step_the_last_partial_batch_included(tmp_path):
    adam, sgd = reference(tmp_path, "mlp", MLP), reference(tmp_path, "mlp", MLP + " --optimizer sgd")
    tiny = reference(tmp_path, "mlp", MLP.replace("100", "479"))
    gpt5, gpt3 = reference(tmp_path, "gpt", GPT + " --batch-size 5"), reference(tmp_path, "gpt", GPT + " --batch-size 3")
    ckpt = tmp_path / "ckpt"
    four = launch(tmp_path, 4, [
        ("zero3x4", "mlp", f"{MLP} --strategy zero3 --save-dir {ckpt} --save-every 7"),
        ("gpt_tp2_pp2", "gpt", f"{GPT} --batch-size 5 --tp 2 --pp 2 --microbatches 3"),
        ("gpt_dp2_tp2", "gpt", f"{GPT} --batch-size 3 --dp 2 --tp 2 --microbatches 2"),
        ("gpt_dp2_pp2", "gpt", f"{GPT} --batch-size 5 --dp 2 --pp 2 --microbatches 2"),
        ("gpt_dp4", "gpt", f"{GPT} --batch-size 3"),
        ("pipeline_dp2", "mlp", f"{MLP} --strategy pipeline --dp 2 --microbatches 3")])
    assert [s for s, _, _ in checkpoint.list_checkpoints(ckpt)] == [7, 14, 21, 28, 30]
    for name, ref in (("zero3x4", adam), ("gpt_tp2_pp2", gpt5), ("gpt_dp2_tp2", gpt3), ("gpt_dp2_pp2", gpt5),
                      ("gpt_dp4", gpt3), ("pipeline_dp2", adam)):
        assert_equal_steps(four[name], ref, name)
    for name in ("zero3x4", "pipeline_dp2"):      # the global batch's loss, not rank 0's replica's share
        assert four[name]["final_loss"] == pytest.approx(adam["final_loss"], rel=RTOL), name
    second = tmp_path / "ckpt-x3"
    shutil.copytree(ckpt, second)
    keep_until(ckpt, 14)                     # the last step of the first epoch (15 steps of 100, 100, ..., 38)
    keep_until(second, 21)                   # mid-epoch
    three = launch(tmp_path, 3, [
        *[(s, "mlp", f"{MLP} --strategy {s}") for s in ("ddp", "zero1", "zero2", "zero3")],
        ("local_sgd", "mlp", f"{MLP} --optimizer sgd --strategy local_sgd --sync-every 1"),
        ("zero3_tiny", "mlp", MLP.replace("100", "479") + " --strategy zero3"),
        ("ddp_resumed", "mlp", f"{MLP} --save-dir {second} --resume")])
    for name in ("ddp", "zero1", "zero2", "zero3"):
        assert_equal_steps(three[name], adam, name)
    assert_equal_steps(three["local_sgd"], sgd, "local_sgd")
    assert_equal_steps(three["zero3_tiny"], tiny, "zero3_tiny")
    assert three["ddp_resumed"]["first_step"] == 21
    assert_equal_steps(three["ddp_resumed"], adam, "ZeRO-3 x 4 -> DDP x 3")
    two = launch(tmp_path, 2, [
        *[(s, "mlp", f"{MLP} --strategy pipeline --schedule {s} --microbatches 3") for s in ("1f1b", "gpipe", "zb_h1")],
        ("pipeline_tiny", "mlp", MLP.replace("100", "479")
         + " --strategy pipeline --microbatches 8"),
        ("gpt_tp2", "gpt", f"{GPT} --batch-size 5 --tp 2 --microbatches 2"),
        ("ddp_resumed", "mlp", f"{MLP} --save-dir {ckpt} --resume")])
    for name in ("1f1b", "gpipe", "zb_h1"):
        assert_equal_steps(two[name], adam, f"pipeline {name}")
    assert_equal_steps(two["pipeline_tiny"], tiny, "pipeline_tiny")
    assert_equal_steps(two["gpt_tp2"], gpt5, "gpt_tp2")
    assert two["ddp_resumed"]["first_step"] == 14
    assert_equal_steps(two["ddp_resumed"], adam, "ZeRO-3 x 4 -> DDP x 2")
