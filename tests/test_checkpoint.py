"""Checkpoints on ThreadWorld (in one process): slices, the rank files, resuming bit for bit under
every strategy, resharding between layouts with bit-identical logical tensors (optimizer state
included), corrupted or foreign checkpoints rejected by name, and the atomic commit."""
import json
import os
import shutil
import threading
import time

import numpy as np
import pytest

import minitrain as mt
from minitrain import checkpoint, nn, optim
from minitrain.backend import bfloat16
from minitrain.checkpoint import CheckpointError
from minitrain.checkpoint.storage import RankFile, write_rank_file
from minitrain.comm import ThreadWorld
from minitrain.nn import functional as F
from minitrain.parallel import (CPUOffloadOptimizer, DistributedDataParallel, FullyShardedDataParallel, LocalSGD,
                                ZeroRedundancyOptimizer, found_inf_on_any_rank)
from minitrain.parallel.pipeline import PipelineParallel
from minitrain.sharded import flat_range, whole

SIZES = [7, 9, 6, 3]                        # 153 parameters: not divisible by 2, 3 or 4
DATA = np.random.default_rng(0)
X = DATA.standard_normal((8, 12, 7))        # 8 global batches of 12 rows (divisible by 1..4)
Y = DATA.integers(0, 3, (8, 12))


# ---------------------------------------------------------------- slices
@pytest.mark.parametrize("shape", [(), (5,), (4, 6), (3, 4, 5), (2, 3, 2, 3)])
def test_flat_range_cuts_a_row_major_range_into_at_most_2d_minus_1_boxes(shape):
    n = int(np.prod(shape))
    full = np.arange(n).reshape(shape)
    rng = np.random.default_rng(len(shape))
    cuts = [(0, n), (0, 0)] + [tuple(sorted(rng.integers(0, n + 1, 2))) for _ in range(30)]
    for lo, hi in cuts:
        held = full.reshape(-1)[lo:hi].copy()               # what a ZeRO shard holds
        slices = flat_range(shape, lo, hi)
        assert len(slices) <= max(1, 2 * len(shape) - 1)
        assert sum(s.numel for s in slices) == hi - lo
        for s in slices:                                   # each box, cut from the holder, is that box
            box = full[tuple(slice(o, o + z) for o, z in zip(s.offsets, s.sizes))]
            assert np.array_equal(s.view(held), box), (shape, lo, hi, s)


def test_rank_file_round_trips_every_dtype_and_rejects_a_mismatched_header(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((3, 4)), "b": rng.standard_normal(5).astype(np.float32),
              "c": rng.standard_normal((2, 2)).astype(np.float16), "d": rng.standard_normal(7).astype(bfloat16),
              "e": rng.integers(0, 9, (2, 3)), "f": np.array(3.5), "g": np.zeros((0, 4))}
    path = tmp_path / "rank-00000.safetensors"
    written, size = write_rank_file(path, list(arrays.items()), {"rank": 0})
    assert size == os.path.getsize(path)
    f = RankFile(str(path), size)
    for key, a in arrays.items():
        begin, end, crc = written[key]
        got = f.read(key, a.dtype, a.shape, [begin, end], f"{crc & 0xFFFFFFFF:08x}")
        assert got.dtype == a.dtype and np.array_equal(got, a), key
    with pytest.raises(CheckpointError, match="header's entry for a"):
        f.read("a", np.float32, (3, 4), list(written["a"][:2]), "0")
    f.close()
    safetensors = pytest.importorskip("safetensors.numpy")       # the layout is safetensors'
    loaded = safetensors.load_file(str(path))
    assert np.array_equal(loaded["a"], arrays["a"])


# ---------------------------------------------------------------- strategies on ThreadWorld
class Job:
    """One rank's training under ``kind``: ``owner`` is what the checkpoint asks for its slices (the
    strategy's wrapper, or the module), ``opt`` the optimizer. bf16_*/fp16_*: mixed precision."""

    def __init__(self, comm, kind):
        self.comm, self.kind = comm, kind
        mt.set_default_dtype(np.float64)
        mt.manual_seed(0)
        model = nn.MLP(SIZES)
        self.mixed = kind.split("_")[0] in ("bf16", "fp16")
        if self.mixed:
            model.to(bfloat16 if kind.startswith("bf16") else np.float16)
        strategy = kind.split("_", 1)[1] if self.mixed else kind
        self.model, self.owner, self.pipe = model, model, None
        adam, sgd = (optim.Adam, dict(lr=0.01)), (optim.SGD, dict(lr=0.1, momentum=0.9))
        opt_class, opt_args = sgd if strategy.endswith("sgd") and strategy != "local_sgd" else adam
        params = model.parameters()
        if strategy in ("ddp", "ddp_sgd"):
            self.owner = DistributedDataParallel(model, comm)
        elif strategy == "local_sgd":
            self.owner = LocalSGD(model, comm, sync_every=2)
        elif strategy in ("fsdp", "fsdp_offload"):
            self.owner = FullyShardedDataParallel(model, comm, offload_params=strategy == "fsdp_offload")
            params = self.owner.parameters()
        elif strategy in ("1f1b", "pipedream_2bw", "interleaved_1f1b"):
            self.owner = self.pipe = PipelineParallel(model, comm, strategy, num_microbatches=2,
                                                      chunks=2 if strategy.startswith("interleaved") else 1)
            params = self.pipe.parameters()
        if strategy in ("zero1", "zero2", "zero2_sgd"):
            self.opt = ZeroRedundancyOptimizer(params, opt_class, comm, stage=int(strategy[4]), **opt_args)
        elif strategy == "fsdp_offload":
            self.opt = CPUOffloadOptimizer(params, opt_class, all_reduce_found_inf=found_inf_on_any_rank(comm), **opt_args)
        elif self.mixed:       # fp16 starts at a loss scale that overflows: it halves before any save
            scale = dict(init_scale=2.0 ** 18) if kind.startswith("fp16") else {}   # skips steps 0 and 2
            self.opt = optim.MixedPrecisionOptimizer(params, opt_class, all_reduce_found_inf=found_inf_on_any_rank(comm),
                                                    **scale, **opt_args)
        else:
            self.opt = opt_class(params, **opt_args)

    def step(self, i):
        x, y = X[i % len(X)], Y[i % len(Y)]
        if self.pipe is not None:
            self.opt.zero_grad()
            loss = self.pipe.train_step(x, y, F.cross_entropy)
            self.opt.step()
            return loss
        p, r = (1, 0) if self.comm is None else (self.comm.size, self.comm.rank)
        out = self.owner(mt.Tensor(x[r::p]).to(self.model[0].weight.dtype))
        loss = F.cross_entropy(out.float() if self.mixed else out, y[r::p])
        self.opt.zero_grad()
        with np.errstate(over="ignore", invalid="ignore"):       # fp16: the overflow the loss scale catches
            (self.opt.scale(loss) if hasattr(self.opt, "scale") else loss).backward()
            self.opt.step()
        if self.kind == "local_sgd":
            self.owner.step()
        return loss.item()

    def _key(self):       # local SGD: every replica's optimizer state is its own (as the job saves it)
        return f"optimizer.rank{self.comm.rank}" if self.kind == "local_sgd" else "optimizer"

    def save(self, directory, step):
        extra = self.owner.state_dict() if self.kind == "local_sgd" else None
        return checkpoint.save(directory, self.comm, step, self.owner, self.opt, extra=extra,
                               layout={"kind": self.kind}, optimizer_key=self._key())

    def load(self, path):
        loaded = checkpoint.load(path, self.comm, self.owner, self.opt, layout={"kind": self.kind},
                                 optimizer_key=self._key())
        if self.kind == "local_sgd":
            self.owner.load_state_dict(loaded.extra)
        return loaded


def _train_save_resume(comm, kind, path, steps=6, cut=3):
    """N steps straight; then cut steps, save, fresh objects, load, N - cut more: the losses.
    (Local SGD saves right after an averaging, every 2 steps here: the job allows no other point.)"""
    cut = 2 if kind == "local_sgd" else cut
    straight = Job(comm, kind)
    losses = [straight.step(i) for i in range(steps)]
    first = Job(comm, kind)
    for i in range(cut):
        first.step(i)
    saved = first.save(path, cut)
    second = Job(comm, kind)
    assert second.load(saved).step == cut
    return losses[cut:], [second.step(i) for i in range(cut, steps)]


@pytest.mark.parametrize("kind, p", [("single", 1), ("ddp", 2), ("zero1", 3), ("zero2_sgd", 2), ("fsdp", 3),
                                     ("fsdp_offload", 2), ("bf16_zero2", 2), ("fp16_ddp", 2), ("1f1b", 2),
                                     ("pipedream_2bw", 2), ("interleaved_1f1b", 2), ("local_sgd", 2)])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")   # fp16: the all-reduce's overflow
def test_resume_is_bit_exact_under_every_strategy(tmp_path, kind, p):
    for straight, resumed in ThreadWorld(p).run(_train_save_resume, kind, str(tmp_path)):
        assert straight == resumed, (kind, straight, resumed)


def job_state(job, path):
    checkpoint.load(path, None, job.owner, job.opt)
    state = {f"model/{n}": q.data.copy() for n, q in job.model.named_parameters()}
    inner = job.opt.optimizer if hasattr(job.opt, "masters") else job.opt
    params = job.opt.masters if hasattr(job.opt, "masters") else list(job.model.parameters())
    for (name, _), q in zip(job.model.named_parameters(), params):
        for k, v in inner.state.get(q, {}).items():
            state[f"optimizer/{name}/{k}"] = v.copy() if hasattr(v, "copy") else v
        if hasattr(job.opt, "masters"):
            state[f"optimizer/{name}/master"] = q.data.copy()
    return state


def _save_after(comm, kind, path, steps):
    job = Job(comm, kind)
    for i in range(steps):
        job.step(i)
    return job.save(path, steps)


def _load_then_save(comm, kind, source, path):
    job = Job(comm, kind)
    step = job.load(source).step
    return job.save(path, step)


def _single_state(path, mixed=False):
    """The checkpoint opened in one process (bf16 for a mixed-precision one)."""
    return job_state(Job(None, "bf16_single" if mixed else "single"), path)


@pytest.mark.parametrize("chain", [[("fsdp", 4), ("ddp", 2)], [("zero2", 3), ("fsdp", 2), ("zero1", 4)],
                                   [("1f1b", 2), ("zero1", 3)], [("bf16_zero2", 2), ("bf16_fsdp", 3)]],
                         ids=["zero3x4-ddpx2-one", "zero2x3-zero3x2-zero1x4", "pipex2-zero1x3", "bf16"])
def test_resharding_keeps_every_logical_tensor_bit_identical(tmp_path, chain):
    """Save under the first layout after 3 steps; load into each next layout and save again; every
    checkpoint of the chain, opened in one process, holds the same bits (parameters, Adam's moments
    and step counts, fp32 masters)."""
    mixed = chain[0][0].startswith("bf16")
    paths = [ThreadWorld(chain[0][1]).run(_save_after, chain[0][0], str(tmp_path / "0"), 3)[0]]
    for i, (kind, p) in enumerate(chain[1:], 1):
        paths.append(ThreadWorld(p).run(_load_then_save, kind, paths[-1], str(tmp_path / str(i)))[0])
    reference = _single_state(paths[0], mixed)
    assert any(k.endswith("exp_avg_sq") for k in reference) and (not mixed or any(k.endswith("master") for k in reference))
    for path in paths[1:]:
        state = _single_state(path, mixed)
        assert state.keys() == reference.keys()
        for key, value in reference.items():
            assert np.array_equal(np.asarray(state[key]), np.asarray(value)), (path, key)
    manifest = checkpoint.read_manifest(paths[0])     # each rank wrote its own pieces
    assert len(manifest["files"]) == chain[0][1]


def test_zero3_checkpoint_holds_what_the_ranks_hold_and_no_padding(tmp_path):
    def body(comm):
        job = Job(comm, "fsdp")
        job.step(0)
        path = job.save(str(tmp_path), 1)
        return path, job.owner.full_state_dict()
    path, full = ThreadWorld(4).run(body)[0]
    manifest = checkpoint.read_manifest(path)
    psi = sum(v.size for v in full.values())
    model_bytes = sum(p["data_offsets"][1] - p["data_offsets"][0] for k, t in manifest["tensors"].items()
                      if k.startswith("model/") for p in t["pieces"])
    assert model_bytes == 8 * psi                     # padding of the flat shards is never saved
    per_rank = [f["bytes"] for f in manifest["files"].values()]
    assert max(per_rank) < 3 * 8 * psi / 4 + 4096       # each rank wrote ~ its quarter (params + 2 moments)
    state = _single_state(path)
    for name, value in full.items():
        assert np.array_equal(state[f"model/{name}"], value)


# ---------------------------------------------------------------- the GPT
def _gpt_config():
    return nn.GPTConfig(vocab_size=23, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=0.1)


GPT_DATA = [(np.random.default_rng(i).integers(0, 23, (8, 8)), np.random.default_rng(i + 9).integers(0, 23, (8, 8)))
            for i in range(4)]


def _gpt_job(comm, dp, pp, tp, sp=False, dropout=0.1, schedule="1f1b"):
    from minitrain.parallel.gpt_3d import GPT3D
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = _gpt_config()
    config.dropout = dropout
    gpt = nn.GPT(config)
    if comm is None:
        model, params = gpt, gpt.parameters()
    else:
        model = GPT3D(gpt, comm, dp=dp, pp=pp, tp=tp, num_microbatches=2 if pp > 1 else 1, sequence_parallel=sp,
                      schedule=schedule)
        params = model.parameters()
    opt = optim.AdamW(params, lr=0.01)
    return model, opt, optim.lr_scheduler.LambdaLR(opt, optim.lr_scheduler.warmup_cosine(2, 8))


def _gpt_step(model, opt, scheduler, i):
    x, y = GPT_DATA[i % len(GPT_DATA)]
    if hasattr(model, "train_step"):
        model.zero_grad()
        loss = model.train_step(x, y)
    else:
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        loss = loss.item()
    opt.step()
    scheduler.step()
    return loss


def _gpt_save_resume(comm, path, pp, tp, sp):
    layout = {"pp": pp, "tp": tp, "sp": sp}
    straight = _gpt_job(comm, 1, pp, tp, sp)
    losses = [_gpt_step(*straight, i) for i in range(4)]
    first = _gpt_job(comm, 1, pp, tp, sp)
    for i in range(2):
        _gpt_step(*first, i)
    saved = checkpoint.save(path, comm, 2, first[0], first[1], first[2], layout=layout)
    second = _gpt_job(comm, 1, pp, tp, sp)
    checkpoint.load(saved, comm, second[0], second[1], second[2], layout=layout)
    return losses[2:], [_gpt_step(*second, i) for i in range(2, 4)], mt.random.get_state()


@pytest.mark.parametrize("pp, tp, sp", [(1, 2, True), (2, 1, False)], ids=["tp2+sp", "pp2"])
def test_gpt_resumes_bit_exact_with_dropout(tmp_path, pp, tp, sp):
    """Dropout masks come from every rank's generator: the checkpoint restores each rank's own. Each stage draws
    only its sites' masks, yet every rank's generator ends the step where one process's does (GPT3D's
    MaskStream), so they are the same on every rank."""
    results = ThreadWorld(pp * tp).run(_gpt_save_resume, str(tmp_path), pp, tp, sp)
    for straight, resumed, _ in results:
        assert straight == resumed
    assert all(state == results[0][2] for _, _, state in results)


def _gpt_resume_on_another_schedule(comm, path):
    straight = _gpt_job(comm, 1, 2, 1, schedule="gpipe")
    losses = [_gpt_step(*straight, i) for i in range(4)]
    first = _gpt_job(comm, 1, 2, 1)
    for i in range(2):
        _gpt_step(*first, i)
    saved = checkpoint.save(path, comm, 2, *first, layout={"world_size": 2, "pp": 2, "schedule": "1f1b", "zero_stage": 0})
    second = _gpt_job(comm, 1, 2, 1, schedule="gpipe")
    checkpoint.load(saved, comm, *second, layout={"world_size": 2, "pp": 2, "schedule": "gpipe", "zero_stage": 1})
    return losses[2:], [_gpt_step(*second, i) for i in range(2, 4)]


def test_gpt_with_dropout_resumes_bit_exact_on_another_schedule_and_zero_stage(tmp_path):
    """GPipe draws each stage's masks as 1F1B does, so the uninterrupted runs agree bit for bit; the resumed one
    must too: each stage its own generator, not rank 0's (the layouts differ only in what moves no draw)."""
    for straight, resumed in ThreadWorld(2).run(_gpt_resume_on_another_schedule, str(tmp_path)):
        assert straight == resumed
    streams = checkpoint.state.random_streams
    assert streams({"schedule": "zbv", "pp": 2}) != streams({"schedule": "1f1b", "pp": 2})    # the V moves stages
    # a manifest of an older version, without the keys added since (cp, ep): compared whole on its own keys
    own = checkpoint.state.own_generators
    older = {"strategy": "dp+pp", "pp": 2, "schedule": "1f1b"}
    assert own({**older, "cp": 1, "ep": 1}, older) and not own({**older, "schedule": "gpipe", "cp": 1}, older)
    assert own({**older, "schedule": "gpipe"}, older) and not own(older, None) and not own(None, older)


def _gpt_state(path):
    model, opt, scheduler = _gpt_job(None, 1, 1, 1)
    checkpoint.load(path, None, model, opt, scheduler)
    state = {n: q.data.copy() for n, q in model.named_parameters()}
    for n, q in model.named_parameters():
        state.update({f"{n}/{k}": v for k, v in opt.state[q].items()})
    return state, scheduler.last_epoch


def test_gpt_dp4_to_tp2_pp2_to_one_process_keeps_every_tensor(tmp_path):
    def first(comm):
        job = _gpt_job(comm, 4, 1, 1, dropout=0.0)
        for i in range(3):
            _gpt_step(*job, i)
        return checkpoint.save(str(tmp_path / "a"), comm, 3, *job)

    def second(comm, source):
        job = _gpt_job(comm, 1, 2, 2, dropout=0.0)
        checkpoint.load(source, comm, *job)
        return checkpoint.save(str(tmp_path / "b"), comm, 3, *job), job[0].full_state_dict()
    a = ThreadWorld(4).run(first)[0]
    b, gathered = ThreadWorld(4).run(second, a)[0]
    (sa, ea), (sb, eb) = _gpt_state(a), _gpt_state(b)
    for name, value in gathered.items():      # the tensor-parallel model's own view of what it loaded
        assert np.array_equal(value, sa[name]), name
    assert ea == eb == 3 and sa.keys() == sb.keys() and any(k.endswith("exp_avg") for k in sa)
    for key in sa:
        assert np.array_equal(sa[key], sb[key]), key
    pieces = checkpoint.read_manifest(b)["tensors"]["model/h.0.attn.c_attn.weight"]["pieces"]
    assert len(pieces) == 6                 # q, k, v row blocks of each of the 2 tensor-parallel ranks


# ---------------------------------------------------------------- broken checkpoints
@pytest.fixture
def saved(tmp_path):
    """A 2-rank ZeRO-3 checkpoint at step 2 (and an older one at step 1)."""
    def body(comm):
        job = Job(comm, "fsdp")
        job.step(0)
        job.save(str(tmp_path), 1)
        job.step(1)
        return job.save(str(tmp_path), 2)
    return ThreadWorld(2).run(body)[0]


def _load_into_ddp(path, p=2):
    def body(comm):
        Job(comm, "ddp").load(path)
    ThreadWorld(p).run(body)


def _flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_flipped_byte_is_caught_and_named(saved):
    manifest = checkpoint.read_manifest(saved)
    piece = manifest["tensors"]["optimizer/2.weight/exp_avg"]["pieces"][-1]
    path = os.path.join(saved, piece["file"])
    header = 8 + int.from_bytes(open(path, "rb").read(8), "little")
    _flip_byte(path, header + piece["data_offsets"][0] + 3)
    with pytest.raises(CheckpointError) as err:
        _load_into_ddp(saved)
    message = str(err.value)
    assert piece["file"] in message and "optimizer/2.weight/exp_avg" in message and "checksum" in message
    from minitrain.checkpoint.__main__ import main
    assert main(["verify", saved]) == 2


def test_a_missing_file_is_named(saved):
    os.remove(os.path.join(saved, "rank-00001.safetensors"))
    with pytest.raises(CheckpointError, match=r"rank-00001.safetensors is missing \(while reading tensor model/"):
        _load_into_ddp(saved)


def test_a_corrupt_header_or_a_truncated_file_is_named(saved):
    path = os.path.join(saved, "rank-00000.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:8] + b"#" + data[9:])            # the JSON header's first byte
    with pytest.raises(CheckpointError, match="rank-00000.safetensors: its header is unreadable"):
        _load_into_ddp(saved)
    open(path, "wb").write(data[:-5])
    with pytest.raises(CheckpointError, match="rank-00000.safetensors has .* bytes, the manifest says"):
        _load_into_ddp(saved)


def test_a_corrupt_manifest_is_named(saved):
    path = os.path.join(saved, "manifest.json")
    text = open(path).read().replace('"step": 2', '"step": 3')
    open(path, "w").write(text)
    with pytest.raises(CheckpointError, match="manifest.json fails its checksum"):
        _load_into_ddp(saved)
    with pytest.raises(CheckpointError, match="manifest.json fails its checksum"):
        checkpoint.latest(os.path.dirname(saved))


def test_pieces_that_leave_a_hole_are_named(saved):
    """A manifest (correctly signed) whose pieces of a tensor do not cover what a rank asks for."""
    from minitrain.checkpoint.manifest import _body_crc
    path = os.path.join(saved, "manifest.json")
    manifest = json.load(open(path))
    manifest["tensors"]["model/0.weight"]["pieces"].pop()
    manifest["checksum"] = _body_crc(manifest)
    json.dump(manifest, open(path, "w"))
    with pytest.raises(CheckpointError, match=r"the pieces of model/0.weight cover \d+ of the 63 elements this rank needs"):
        _load_into_ddp(saved)


def test_a_checkpoint_of_another_model_names_the_tensor(saved):
    def body(comm):
        mt.manual_seed(0)
        model = nn.MLP([7, 10, 6, 3])
        checkpoint.load(saved, comm, DistributedDataParallel(model, comm), optim.Adam(model.parameters()))
    with pytest.raises(CheckpointError, match=r"tensor model/0.weight has shape \(9, 7\) in the checkpoint, "
                                              r"\(10, 7\) in this job: the checkpoint is from another model"):
        ThreadWorld(2).run(body)
    with pytest.raises(CheckpointError, match="checkpoint's optimizer is Adam, this job's is SGD"):
        ThreadWorld(1).run(lambda comm: checkpoint.load(saved, comm, nn.MLP(SIZES), optim.SGD(
            nn.MLP(SIZES).parameters(), lr=0.1)))


def test_a_state_this_layout_cannot_hold_is_refused(tmp_path):
    """PipeDream-2BW's stashed weights W(t-1): a pipeline under another schedule, or DDP, has no place for them."""
    path = ThreadWorld(2).run(_save_after, "pipedream_2bw", str(tmp_path), 2)[0]
    with pytest.raises(CheckpointError, match="stashed weights W\\(t-1\\); only the pipedream_2bw schedule"):
        ThreadWorld(2).run(lambda comm: Job(comm, "1f1b").load(path))
    with pytest.raises(CheckpointError, match="no rank of this job reads 6 tensor\\(s\\).*model/0.weight/stash"):
        ThreadWorld(1).run(lambda comm: Job(comm, "ddp").load(path))


# ---------------------------------------------------------------- atomic commit, newest by manifest
def test_a_crash_in_the_middle_of_a_save_leaves_the_previous_checkpoint_newest(saved, monkeypatch):
    directory = os.path.dirname(saved)
    from minitrain.checkpoint import core
    real = core.write_rank_file

    def dies_on_rank_1(path, pieces, metadata, fsync=True):
        if metadata["rank"] == 1:                   # dies once rank 0 has written its file
            while not os.path.exists(path.replace("rank-00001", "rank-00000")):
                time.sleep(0.01)
            time.sleep(0.1)
            raise RuntimeError("killed while writing")
        return real(path, pieces, metadata, fsync)
    monkeypatch.setattr(core, "write_rank_file", dies_on_rank_1)

    def body(comm):
        job = Job(comm, "fsdp")
        job.load(saved)
        job.step(2)
        job.save(directory, 3)
    with pytest.raises(RuntimeError, match="killed while writing"):
        ThreadWorld(2).run(body)
    leftovers = [n for n in os.listdir(directory) if n.startswith(".tmp-step-00000003")]
    assert leftovers and not os.path.exists(os.path.join(directory, leftovers[0], "manifest.json"))
    assert checkpoint.latest(directory) == saved
    _load_into_ddp(checkpoint.latest(directory))


def test_a_full_disk_under_the_manifest_fails_the_save_and_leaves_no_half_made_folder(saved, monkeypatch):
    directory = os.path.dirname(saved)
    from minitrain.checkpoint import core

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(core, "write_manifest", full_disk)

    def body(comm):
        job = Job(comm, "ddp")
        job.load(saved)
        job.save(directory, 3)
    with pytest.raises(CheckpointError, match=r"saving step 3: \[rank 0\] committing .*No space left on device"):
        ThreadWorld(2).run(body)
    assert not [n for n in os.listdir(directory) if n.startswith(".tmp-step")]
    assert checkpoint.latest(directory) == saved


def test_pieces_that_leave_a_gap_are_refused_and_leave_no_half_made_folder(tmp_path):
    from minitrain.checkpoint.core import write_checkpoint
    from minitrain.sharded import Slice
    half = Slice((4, 2), (0, 0), (2, 2))                    # rows 2 and 3 held by nobody
    with pytest.raises(CheckpointError, match=r"tensor w \(4, 2\): the ranks' pieces cover 4 of its 8 elements"):
        write_checkpoint(str(tmp_path), None, 1, {"w": [(half, np.zeros((2, 2)))]}, {}, {}, None)
    assert os.listdir(tmp_path) == []


def test_the_newest_checkpoint_is_found_by_its_manifest_not_its_name(saved):
    directory = os.path.dirname(saved)
    os.rename(saved, os.path.join(directory, "aaa"))                                # step 2
    os.rename(os.path.join(directory, "step-00000001"), os.path.join(directory, "step-99999999"))
    assert checkpoint.latest(directory) == os.path.join(directory, "aaa")
    assert [s for s, _, _ in checkpoint.list_checkpoints(directory)] == [1, 2]
    assert checkpoint.find_latest(os.path.join(directory, "nothing")) is None


def test_saving_a_step_already_saved_is_refused_and_keep_drops_the_oldest(saved):
    directory = os.path.dirname(saved)
    before = checkpoint.read_manifest(saved)

    def body(comm, step):
        job = Job(comm, "ddp")
        job.load(saved)
        return checkpoint.save(directory, comm, step, job.owner, job.opt, layout={"kind": "ddp"}, keep=1)
    with pytest.raises(checkpoint.CheckpointError, match="step-00000002 already exists"):
        ThreadWorld(2).run(body, 2)
    assert checkpoint.read_manifest(saved) == before                  # the folder there is untouched
    assert not [n for n in os.listdir(directory) if n.startswith(".")]
    path = ThreadWorld(2).run(body, 3)[0]
    assert checkpoint.read_manifest(path)["layout"] == {"kind": "ddp"}
    assert [p for _, _, p in checkpoint.list_checkpoints(directory)] == [path]


def test_ddp_replicas_share_the_writing_and_each_slice_is_written_once(tmp_path):
    path = ThreadWorld(2).run(_save_after, "ddp", str(tmp_path), 1)[0]
    manifest = checkpoint.read_manifest(path)
    assert all(len(t["pieces"]) == 1 for t in manifest["tensors"].values())
    written = [f["bytes"] for f in manifest["files"].values()]
    assert min(written) > 0.3 * max(written)              # largest first, each to the least-loaded holder


def test_a_strategy_whose_slices_leave_a_gap_cannot_save(tmp_path):
    class HalfOfIt:                       # claims the first 2 of 4 rows of a (4, 3) tensor, on both ranks
        def __init__(self):
            self.q = nn.Parameter(np.zeros((2, 3)))

        def sharded_parameters(self):
            from minitrain.sharded import Slice
            return [(self.q, [("w", Slice((4, 3), (0, 0), (2, 3)))])]
    with pytest.raises(CheckpointError, match=r"tensor model/w \(4, 3\): the ranks' pieces cover 6 of its 12"):
        ThreadWorld(2).run(lambda comm: checkpoint.save(str(tmp_path), comm, 0, HalfOfIt()))
    assert checkpoint.latest(str(tmp_path)) is None


def test_inspect_prints_the_manifest_as_a_table(saved, capsys):
    from minitrain.checkpoint.__main__ import main
    assert main(["inspect", os.path.dirname(saved)]) == 0
    out = capsys.readouterr().out
    assert "step 2 (optimizer steps completed)" in out and "model/0.weight" in out and "(9, 7)" in out
    assert "rank-00001.safetensors" in out and "float64" in out
    assert main(["verify", saved]) == 0 and "every checksum matches" in capsys.readouterr().out


def test_a_layout_is_described_with_all_its_axes_their_product_the_world():
    """dp x pp x tp alone said '4 rank(s) = dp 2 x pp 1 x tp 1' of a dp2 x cp2 run."""
    layout = {"job": "gpt", "strategy": "dp+cp+ep2", "world_size": 4, "dp": 2, "pp": 1, "cp": 2, "tp": 1, "ep": 2,
              "precision": "fp64"}
    assert checkpoint.describe_layout(layout) == ("gpt job, strategy dp+cp+ep2, 4 rank(s) = dp 2 x pp 1 x cp 2 x tp 1 "
                                                  "(ep 2 inside dp), precision fp64")
    plain = checkpoint.describe_layout({**layout, "dp": 4, "cp": 1, "ep": 1})
    assert "rank(s) = dp 4 x pp 1 x tp 1, precision" in plain


def test_the_tool_names_a_directory_that_is_not_there_or_holds_no_checkpoint(saved, tmp_path, capsys):
    from minitrain.checkpoint.__main__ import main
    assert main(["list", os.path.dirname(saved)]) == 0 and "step        2" in capsys.readouterr().out
    for command in ("list", "inspect", "verify"):                 # a typo is not an empty listing
        assert main([command, str(tmp_path / "typo")]) == 2
        assert f"error: {tmp_path / 'typo'}: no such directory" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    assert main(["inspect", str(tmp_path / "a_file")]) == 2
    assert f"error: {tmp_path / 'a_file'}: a file, not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["list", str(tmp_path / "empty")]) == 1
    assert f"no complete checkpoint in {tmp_path / 'empty'}" in capsys.readouterr().err


def test_the_tool_marks_a_checkpoint_whose_rank_files_are_missing_or_cut_and_lists_one_checkpoint(saved, capsys):
    from minitrain.checkpoint.__main__ import main
    assert main(["list", saved]) == 0                             # one checkpoint, not a save directory
    assert capsys.readouterr().out.split() == ["step", "2", saved]
    older = os.path.join(os.path.dirname(saved), "step-00000001")
    os.remove(os.path.join(older, "manifest.json"))               # a step folder that lost its manifest
    assert main(["list", os.path.dirname(saved)]) == 2
    out, err = capsys.readouterr()
    assert out.split() == ["step", "2", saved] and f"damaged: {older} has no manifest.json" in err
    os.remove(os.path.join(saved, "rank-00001.safetensors"))     # a partial copy
    with open(os.path.join(saved, "rank-00000.safetensors"), "r+b") as f:
        f.truncate(100)
    assert main(["list", saved]) == 2
    assert (f"{saved}  (incomplete: rank-00000.safetensors has 100 bytes, the manifest says" in
            capsys.readouterr().out)
    assert main(["list", os.path.dirname(saved)]) == 2
    assert "; rank-00001.safetensors is missing)" in capsys.readouterr().out
    assert main(["inspect", saved]) == 2
    assert f"error: {saved} is incomplete: rank-00000.safetensors has 100 bytes" in capsys.readouterr().err
    with open(os.path.join(saved, "manifest.json"), "w") as f:    # a manifest cut short: named, not fatal
        f.write('{"format')
    assert main(["list", os.path.dirname(saved)]) == 2
    out, err = capsys.readouterr()
    assert f"damaged: {saved}: checkpoint manifest {saved}/manifest.json is not valid JSON" in err
    assert f"no complete checkpoint in {os.path.dirname(saved)}" in err and out == ""


def _end_a_wait_on(fifo):
    """Open and close a pipe's writing end: a reader blocked opening it reads an empty file instead."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:                                   # no reader waiting
        pass


def test_the_tool_names_a_save_still_being_written_and_what_it_cannot_read(saved, tmp_path, capsys, monkeypatch):
    """A save in progress (a .tmp-step folder, no manifest yet) is named, never read nor counted as damage; a
    manifest or rank file it cannot read (a folder in its place, no permission) and a folder it may not list
    end in one error line, exit status 2, never a traceback."""
    from minitrain.checkpoint import manifest, storage
    from minitrain.checkpoint.__main__ import main
    top = os.path.dirname(saved)
    unfinished = os.path.join(top, ".tmp-step-00000003-abcd")
    os.mkdir(unfinished)
    shutil.copy(os.path.join(saved, "rank-00000.safetensors"), unfinished)
    assert main(["list", top]) == 0
    out, err = capsys.readouterr()
    assert out.split()[-2:] == ["2", saved] and f"unfinished: {unfinished} (a save still being written" in err
    assert main(["inspect", unfinished]) == 1
    assert f"{unfinished} is a save still being written, or interrupted: it has no manifest.json" in capsys.readouterr().err
    shutil.copytree(saved, tmp_path / "first" / "run" / "step-00000002")     # a save directory inside it
    os.makedirs(tmp_path / "first" / ".tmp-step-00000001-x")
    assert main(["verify", str(tmp_path / "first")]) == 1
    assert (f"no complete checkpoint in {tmp_path / 'first'} (.tmp-step-00000001-x: a save still being written, or "
            f"interrupted); the folders in it that hold checkpoints: run\n") == capsys.readouterr().err
    monkeypatch.setattr(storage, "open", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")),
                        raising=False)
    assert main(["verify", saved]) == 2
    assert "error: cannot read the checkpoint file" in capsys.readouterr().err
    monkeypatch.undo()
    rank1 = os.path.join(saved, "rank-00001.safetensors")
    os.remove(rank1)
    os.mkdir(rank1)
    assert main(["verify", saved]) == 2 and f"{rank1} is not a file" in capsys.readouterr().err
    older = os.path.join(top, "step-00000001", "manifest.json")
    monkeypatch.setattr(manifest, "open", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")),
                        raising=False)
    assert main(["inspect", os.path.dirname(older)]) == 2
    assert f"error: cannot read the checkpoint manifest {older}: Permission denied" in capsys.readouterr().err
    monkeypatch.undo()
    os.remove(older)
    os.mkfifo(older)                                  # opened, it would wait for a writer forever
    hung = threading.Timer(5, _end_a_wait_on, [older])  # (a reader that opened it anyway: let it go, and fail)
    hung.start()
    try:
        assert main(["inspect", os.path.dirname(older)]) == 2
    finally:
        hung.cancel()
    assert f"error: cannot read the checkpoint manifest {older}: it is not a file" in capsys.readouterr().err
    assert main(["list", top]) == 2 and f"cannot read the checkpoint manifest {older}" in capsys.readouterr().err
    monkeypatch.setattr(os, "listdir", lambda path: (_ for _ in ()).throw(PermissionError(13, "Permission denied", path)))
    for command in ("list", "inspect"):
        assert main([command, top]) == 2
        out, err = capsys.readouterr()
        assert err == f"error: cannot read {top}: Permission denied\n", err


# ---------------------------------------------------------------- the optimizers' own state dicts
def test_mixed_precision_zero_and_fsdp_load_their_state_dicts(float64):
    def body(comm):
        a, b = Job(comm, "bf16_zero2"), Job(comm, "bf16_zero2")
        c = Job(comm, "fsdp")
        for i in range(2):
            a.step(i)
            c.step(i)
        b.opt.load_state_dict(a.opt.state_dict())
        b.model.load_state_dict(a.model.state_dict())
        assert [a.step(i) for i in range(2, 4)] == [b.step(i) for i in range(2, 4)]
        full = c.owner.state_dict()
        d = Job(comm, "fsdp")
        d.owner.load_state_dict(full)
        d.opt.load_state_dict(c.opt.state_dict())
        assert [c.step(i) for i in range(2, 4)] == [d.step(i) for i in range(2, 4)]
    ThreadWorld(2).run(body)
    mt.set_default_dtype(np.float32)
    a = nn.MLP(SIZES).to(np.float16)
    opt = optim.MixedPrecisionOptimizer(a.parameters(), optim.Adam, lr=0.1)
    opt.loss_scale, opt._good_steps = 512.0, 7
    other = optim.MixedPrecisionOptimizer(a.parameters(), optim.Adam, lr=0.1)
    other.load_state_dict(opt.state_dict())
    assert (other.loss_scale, other._good_steps) == (512.0, 7)


def test_data_position_carries_over_to_another_world_size_with_the_same_global_batch():
    """DistributedSampler: batch j of every rank together is global batch j of one process, whatever
    the number of ranks, except the last batch of an epoch, which padding fills when the ranks do not
    divide the samples (1438 digits on 4 ranks: 2 repeated)."""
    from minitrain.data import DataLoader, DistributedSampler
    n, batch = 1438, 64
    x = np.arange(n)

    def batches(world, start=0):
        loaders = [DataLoader((x,), batch // world, sampler=DistributedSampler(n, num_replicas=world, rank=r, seed=3)) for r in range(world)]
        for loader in loaders:
            loader.set_epoch(1)
            loader.load_state_dict({"epoch": 1, "batches_done": start, "seed": 3, "global_batch_size": batch})
        return [sorted(np.concatenate(parts).tolist()) for parts in zip(*[[b for (b,) in lo] for lo in loaders])]
    one, two, four = batches(1), batches(2), batches(4)
    assert len(one) == len(two) == len(four) == 23
    assert one == two and one[:-1] == four[:-1] and one[-1] != four[-1]
    assert batches(4, start=9)[:-1] == one[9:-1]             # resumed mid-epoch on 4 ranks
    with pytest.raises(ValueError, match="global batch of 32"):
        DataLoader((x,), 64).load_state_dict({"epoch": 0, "batches_done": 0, "seed": 0, "global_batch_size": 32})


def test_whole_slices_view_the_parameter_itself():
    a = np.arange(6.0).reshape(2, 3)
    view = whole(a.shape).view(a)
    view[0, 0] = 7
    assert a[0, 0] == 7
    with pytest.raises(ValueError, match="contiguous"):
        whole((3, 2)).view(a.T)
