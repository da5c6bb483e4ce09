"""Checkpoint save and load throughput (MB/s) and per-rank peak extra memory, against np.save /
np.load of the same bytes by the same ranks in the same run.

    python scripts/bench_checkpoint.py [--ranks 2] [--hidden 2048] [--layers 4] [--repeats 3] [--json out.json]

Each rank holds its ZeRO-3 (FullyShardedDataParallel) shard of an MLP of layers x (hidden x hidden)
with fp32 Adam after one step: parameters and two moments, 12 bytes per parameter / p. save writes
the rank's pieces into its safetensors-layout file, fsyncs it, and rank 0 commits the manifest;
the anchor writes the same arrays with np.save one after the other into one file per rank and
fsyncs it (and both again without fsync). load reads the checkpoint back into the same layout,
and into DDP on the same ranks (a reshard: every rank reads the whole model); the anchor np.loads
the rank's file. Rates are the rank's bytes over the slowest rank's time (median of the repeats;
reads come from the page cache on both sides). Peak extra memory: tracemalloc's peak during the call
minus what was live before (for load, minus the optimizer state it creates), against one shard
(this rank's state) and against the largest piece. Goals: extra memory <= one shard per rank,
save >= 0.5x np.save's rate.
"""
import argparse
import json
import os
import shutil
import tempfile
import time
import tracemalloc

import numpy as np

from minitrain import cli


def worker(args):
    import minitrain as mt
    from minitrain import checkpoint, nn, optim
    from minitrain.comm import init, ring_all_gather
    from minitrain.parallel import DistributedDataParallel, FullyShardedDataParallel
    comm = init()
    p, r = comm.size, comm.rank
    mt.manual_seed(0)
    sizes = [args.hidden] * (args.layers + 1)
    model = nn.MLP(sizes)
    fsdp = FullyShardedDataParallel(model, comm)
    opt = optim.Adam(fsdp.parameters(), lr=1e-3)
    x = np.random.default_rng(r).standard_normal((8, args.hidden)).astype(np.float32)
    nn.functional.cross_entropy(fsdp(mt.Tensor(x)), np.zeros(8, np.int64)).backward()
    opt.step()
    placements = checkpoint.sharded_parameters(fsdp)
    pieces = [s.view(q.data) for q, slices in placements for _, s in slices]
    state, _ = opt.sharded_state_dict({id(q): slices for q, slices in placements})
    pieces += [a for entries in state.values() for _, a in entries]
    shard_bytes = sum(a.nbytes for a in pieces)
    largest = max(a.nbytes for a in pieces)
    root = args.dir
    anchor = os.path.join(root, f"np-{r:05d}.npy")

    def slowest(seconds):
        return float(ring_all_gather(comm, np.array([seconds]), total=p).max())

    def timed(fn):
        comm.barrier()
        t0 = time.perf_counter()
        out = fn()
        return slowest(time.perf_counter() - t0), out

    def np_save(fsync):
        with open(anchor, "wb") as f:
            for a in pieces:
                np.save(f, a)
            f.flush()
            if fsync:
                os.fsync(f.fileno())

    def np_load():
        with open(anchor, "rb") as f:
            return [np.load(f) for _ in pieces]

    ddp_model = nn.MLP(sizes)
    ddp = DistributedDataParallel(ddp_model, comm)
    ddp_opt = optim.Adam(ddp_model.parameters(), lr=1e-3)
    times = {k: [] for k in ("save", "np_save", "save_nosync", "np_save_nosync", "load", "np_load", "reshard")}
    for rep in range(args.repeats):
        t, path = timed(lambda: checkpoint.save(os.path.join(root, "ckpt"), comm, 2 * rep, fsdp, opt))
        times["save"].append(t)
        times["np_save"].append(timed(lambda: np_save(True))[0])
        times["save_nosync"].append(timed(lambda: checkpoint.save(os.path.join(root, "ckpt"), comm, 2 * rep + 1,
                                                                  fsdp, opt, fsync=False))[0])
        times["np_save_nosync"].append(timed(lambda: np_save(False))[0])
        times["load"].append(timed(lambda: checkpoint.load(path, comm, fsdp, opt))[0])
        times["np_load"].append(timed(np_load)[0])
        times["reshard"].append(timed(lambda: checkpoint.load(path, comm, ddp, ddp_opt))[0])
        if r == 0:                                 # keep this repeat's (fsynced) checkpoint only
            for _, _, old in checkpoint.list_checkpoints(os.path.join(root, "ckpt")):
                if old != path:
                    shutil.rmtree(old)
        comm.barrier()
    model_bytes = checkpoint.read_manifest(path)
    model_bytes = sum(pc["data_offsets"][1] - pc["data_offsets"][0] for t in model_bytes["tensors"].values()
                      for pc in t["pieces"])
    tracemalloc.start()

    def extra(fn, created=lambda: 0):
        comm.barrier()
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1] - before - created()
    save_extra = extra(lambda: checkpoint.save(os.path.join(root, "mem"), comm, 0, fsdp, opt))
    state = None                                   # drop the views of the old optimizer state, and the state:
    pieces.clear()
    opt.state.clear()                              # a fresh optimizer, whose state load creates

    def created():
        return sum(v.nbytes for entry in opt.state.values() for v in entry.values() if hasattr(v, "nbytes"))
    load_extra = extra(lambda: checkpoint.load(path, comm, fsdp, opt), created)
    tracemalloc.stop()
    row = np.array([shard_bytes, largest, save_extra, load_extra], np.float64)
    rows = ring_all_gather(comm, row, total=row.size * p).reshape(p, -1)
    if r == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"ranks": p, "psi": model.num_parameters(), "model_bytes": model_bytes,
                       "shard_bytes": rows[:, 0].tolist(), "largest_piece": rows[:, 1].tolist(),
                       "save_extra": rows[:, 2].tolist(), "load_extra": rows[:, 3].tolist(),
                       "seconds": {k: float(np.median(v)) for k, v in times.items()}}, f)


def fmt(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    ap.add_argument("--ranks", type=cli.positive_int, default=2, help="ranks saving and loading (mpiexec -n)")
    ap.add_argument("--hidden", type=cli.positive_int, default=2048, help="width of each layer")
    ap.add_argument("--layers", type=cli.positive_int, default=4, help="hidden x hidden layers")
    ap.add_argument("--repeats", type=cli.positive_int, default=3, help="saves and loads timed (the median is kept)")
    ap.add_argument("--dir", type=cli.output_folder, help="where to write (default: a temporary directory)")
    ap.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the results as JSON (default: none written)")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        return worker(args)
    from minitrain.testing import run_worker
    root = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir)
    try:
        res = run_worker(__file__, args.ranks, ["--hidden", args.hidden, "--layers", args.layers,
                                                "--repeats", args.repeats, "--dir", root])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    s, shard = res["seconds"], max(res["shard_bytes"])
    mb = shard / 1e6
    print(f"p={res['ranks']}: MLP {args.layers} x {args.hidden}x{args.hidden} ({res['psi']:,} parameters), ZeRO-3 + "
          f"fp32 Adam; {fmt(shard)} per rank (params + 2 moments), {fmt(res['model_bytes'])} in all")
    print(f"\n{'':<28}{'minitrain':>12}{'np.save/load':>14}{'ratio':>8}")
    for name, ours, anchor in (("save + fsync", "save", "np_save"), ("save, no fsync", "save_nosync", "np_save_nosync"),
                               ("load, same layout", "load", "np_load")):
        print(f"{name:<28}{mb / s[ours]:>8.0f} MB/s{mb / s[anchor]:>10.0f} MB/s{s[anchor] / s[ours]:>7.2f}x")
    whole = res["model_bytes"] / 1e6
    print(f"{'load, resharded to DDP':<28}{whole / s['reshard']:>8.0f} MB/s  (each rank reads the whole "
          f"{fmt(res['model_bytes'])})")
    print(f"\npeak extra memory per rank (tracemalloc): save {fmt(max(res['save_extra']))} = "
          f"{max(res['save_extra']) / shard:.3f} shard, load {fmt(max(res['load_extra']))} = "
          f"{max(res['load_extra']) / shard:.3f} shard (one shard: {fmt(shard)}; largest piece "
          f"{fmt(max(res['largest_piece']))}; load's count leaves out the optimizer state it creates)")
    print(f"goals: save >= 0.5x np.save ({s['np_save'] / s['save']:.2f}x with fsync), extra memory <= 1 shard")
    from minitrain.testing import mpi_library_name
    print(f"MPI: {mpi_library_name()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
