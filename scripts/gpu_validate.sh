#!/usr/bin/env bash
# Validate minitrain on an NVIDIA machine, as is (no package installs; run from anywhere):
#
#     scripts/gpu_validate.sh OUT_DIR [STEP ...]
#
# STEPs, in this order by default: env tests suite mlp mlp2 gpt bench transport
#   env        versions, GPUs, the MPI library and whether it is CUDA-aware, optional packages
#   tests      tests/test_gpu.py (real-CuPy checks of what the CuPy stand-in checks)
#   suite      every job on the GPU and on the CPU at 1, 2, 4 ranks, compared (tests/programs/device_suite.py)
#   mlp        the main job at 1, 2, 4 ranks for each data-parallel strategy, and the full run (30 epochs, 4 ranks)
#   mlp2       offload, fp16, bf16, recompute, activation offload, every pipeline schedule, at 2 and 4 ranks
#   gpt        the GPT: one GPU, --tp, --sequence-parallel, --pp, --dp, pp x tp, recompute, offload, dropout, bf16,
#              bf16 with --cp, fp16 with experts over --ep and ZeRO
#   bench      scripts/bench_gpu.py: training step vs PyTorch CUDA at the three GPT sizes and two MLPs
#   transport  the device transports: tests/programs/transport_check.py, then scripts/bench_gpu_collectives.py
#              (ring all-reduce bus bandwidth per transport vs MPI's and NCCL's all-reduce), at 2 and 4 ranks
# Every step and every job inside it has a time limit (STEP_TIMEOUT, default 420 s; RUN_TIMEOUT per
# job, default 150 s), writes its log to OUT_DIR/<step>.log, and a failure is reported and the next
# one runs. OUT_DIR/figures.json collects every step's status and every job's figures.
# Works with Open MPI (mpirun; as root it adds --allow-run-as-root) or MPICH (mpiexec); set MPIRUN
# to choose the launcher, PYTHON the interpreter (default python3), BENCH_ARGS extra bench_gpu.py options,
# TRANSPORT_ARGS extra bench_gpu_collectives.py options (TRANSPORT_RANKS the transport step's rank counts, "2 4"),
# EPOCHS / GPT_STEPS the length of the mlp / gpt jobs (10 / 100). DRY_RUN=1 prints each job's command line instead of
# running it (what a step would launch, checked by tests/test_scripts.py on a machine without a GPU).
# MINITRAIN_TRANSPORT (auto | cuda-ipc | pinned-staging | cuda-aware-mpi), MINITRAIN_IPC_SYNC (event | host) and
# MINITRAIN_BACKEND (mpi | nccl) reach every rank (under Open MPI through -x).
# MPS (auto | 0): ranks sharing a GPU take turns on it unless NVIDIA's Multi-Process Service runs (a ring hop on an
# H200: 142 us without, 8 us with); auto starts a private MPS control daemon for the run when the steps' 4 ranks
# outnumber the GPUs and none answers already, and stops it at the end; 0 never does.
set -u
case "${1:-}" in     # before anything runs: --help prints the comment above; another option is not an OUT_DIR
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0;;
  -*) echo "gpu_validate.sh: unknown option '$1' (usage: scripts/gpu_validate.sh OUT_DIR [STEP ...]; --help)" >&2; exit 2;;
esac
OUT=${1:?usage: scripts/gpu_validate.sh OUT_DIR [STEP ...]}
shift
STEPS=${*:-env tests suite mlp mlp2 gpt bench transport}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-$(command -v python3)}   # absolute: a launcher may search another PATH (seen: mpirun found no mpi4py)
STEP_TIMEOUT=${STEP_TIMEOUT:-420}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
BENCH_ARGS=${BENCH_ARGS:-}
TRANSPORT_ARGS=${TRANSPORT_ARGS:-}
TRANSPORT_RANKS=${TRANSPORT_RANKS:-2 4}
EPOCHS=${EPOCHS:-10}                       # the mlp jobs' epochs (the full run: the job's default, 30)
GPT_STEPS=${GPT_STEPS:-100}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" MINITRAIN_DEVICE=cuda OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
       MKL_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
DRY_RUN=${DRY_RUN:-}
COMM_TIMEOUT=${COMM_TIMEOUT:-40}            # the jobs' stall threshold (hard timeout 3x: first-use kernel compiles)

GPUS=$("$PY" -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())" 2>/dev/null || echo 0)
MPS=${MPS:-auto}
case "$MPS" in auto|0) ;; *) echo "gpu_validate.sh: MPS must be auto or 0, got '$MPS'" >&2; exit 2;; esac
if [ -e "${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}/control" ]; then
  MPS_STATE="running already"
elif [ "$MPS" = 0 ]; then
  MPS_STATE="not started (MPS=0)"
elif [ "$GPUS" -eq 0 ]; then
  MPS_STATE="not needed (no GPU)"
elif [ "$GPUS" -ge 4 ]; then
  MPS_STATE="not needed ($GPUS GPUs for up to 4 ranks)"
elif ! command -v nvidia-cuda-mps-control > /dev/null; then
  MPS_STATE="not started: nvidia-cuda-mps-control not found ($GPUS GPU(s) for up to 4 ranks)"
else
  export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY=$OUT/mps-log
  CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/minitrain-mps.XXXXXX)     # short: the pipes are Unix sockets
  mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    MPS_STATE="started for this run ($GPUS GPU(s) for up to 4 ranks)"
    trap 'echo quit | nvidia-cuda-mps-control; rm -rf "$CUDA_MPS_PIPE_DIRECTORY"' EXIT
  else
    MPS_STATE="failed to start (see $CUDA_MPS_LOG_DIRECTORY)"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi
echo "MPS: $MPS_STATE"

LAUNCHER=${MPIRUN:-$(command -v mpirun || command -v mpiexec)}
if "$LAUNCHER" --version 2>&1 | grep -q "Open MPI\|OpenRTE"; then
  LAUNCH=("$LAUNCHER" --oversubscribe --bind-to none -x PYTHONPATH -x MINITRAIN_DEVICE -x OMP_NUM_THREADS)
  [ "$(id -u)" = 0 ] && LAUNCH+=(--allow-run-as-root)
  for var in MINITRAIN_TRANSPORT MINITRAIN_IPC_SYNC MINITRAIN_BACKEND MINITRAIN_CUDA_AWARE \
             CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; do                  # the transport knobs, MPS's pipes
    [ -n "${!var:-}" ] && LAUNCH+=(-x "$var")
  done
else
  LAUNCH=("$LAUNCHER")
fi
mpi() { local n=$1; shift; "${LAUNCH[@]}" -n "$n" "$PY" "$@"; }
: > "$OUT/steps.tsv"
: > "$OUT/runs.tsv"

# run NAME CMD...: one job with its time limit; its output goes to the step's log and OUT_DIR/runs/NAME.log
run() {
  local name=$1; shift
  if [ "$1" = mpi ]; then                  # `run NAME mpi N ARGS...`: the launcher's command line
    local n=$2; shift 2
    set -- "${LAUNCH[@]}" -n "$n" "$PY" "$@"
  fi
  mkdir -p "$OUT/runs"
  local start=$SECONDS rc
  echo "=== $name: $*"
  if [ -n "$DRY_RUN" ]; then printf '%s\t0\t0\n' "$name" >> "$OUT/runs.tsv"; return 0; fi
  timeout -k 10 "$RUN_TIMEOUT" "$@" > "$OUT/runs/$name.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/runs/$name.log"
  [ $rc = 124 ] || [ $rc = 137 ] && echo "*** $name: TIMED OUT after $RUN_TIMEOUT s"
  [ $rc != 0 ] && echo "*** $name: FAILED (exit $rc)"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$OUT/runs.tsv"
  return $rc
}

step_env() {
  nvidia-smi -L || true
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  "$LAUNCHER" --version 2>&1 | head -2
  "$PY" - <<'EOF'
import importlib.metadata, platform, sys
print("python", platform.python_version())
# the installed versions, read without importing each package (torch and sklearn take seconds to import)
for name, dist in (("numpy", "numpy"), ("cupy", None), ("torch", "torch"), ("mpi4py", "mpi4py"),
                   ("ml_dtypes", "ml_dtypes"), ("sklearn", "scikit-learn"), ("pytest", "pytest"), ("tqdm", "tqdm"),
                   ("threadpoolctl", "threadpoolctl"), ("matplotlib", "matplotlib")):
    try:
        print(f"{name:<14}", importlib.metadata.version(dist) if dist else importlib.import_module(name).__version__)
    except Exception as e:
        print(f"{name:<14} missing ({type(e).__name__})")
import cupy
print("GPUs", cupy.cuda.runtime.getDeviceCount(), [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode()
                                                for i in range(cupy.cuda.runtime.getDeviceCount())])
try:
    import torch
    print("torch cuda", torch.version.cuda, torch.cuda.is_available())
except Exception:
    pass
EOF
  mpi 2 -c "from mpi4py import MPI; from minitrain import comm, backend; c = comm.init(); from minitrain.comm.mpi import cuda_aware; \
from minitrain.comm.transport import describe; \
print(f'rank {c.rank}: local rank {backend.local_rank()}, GPU {backend.describe_device()}, MPI CUDA-aware: {cuda_aware()}, ' \
      + f'transport {describe(c)} ({c.transport_note}), ' + MPI.Get_library_version().splitlines()[0])"
}

step_tests() {
  if "$PY" -c "import pytest" 2>/dev/null; then
    "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py
    local rc=$?
    [ $rc = 5 ] && echo "(no test ran: no real GPU here)" && return 0
    return $rc
  else
    echo "(pytest is not installed: tests/test_gpu.py runs its tests itself)"
    "$PY" tests/test_gpu.py
  fi
}

step_suite() {
  local status=0
  for n in 1 2 4; do
    mkdir -p "$OUT/suite"
    run "suite_$n" mpi "$n" tests/programs/device_suite.py "$OUT/suite" || status=1
  done
  [ -n "$DRY_RUN" ] || "$PY" tests/programs/device_suite.py --compare "$OUT/suite" "$GPUS" || status=1
  return $status
}

step_mlp() {
  local status=0 flags
  run "mlp_full_4" mpi 4 -m minitrain.examples.mlp --no-progress --comm-timeout "$COMM_TIMEOUT" --json "$OUT/mlp_full_4.json" || status=1
  for n in 1 2 4; do
    for strategy in ddp local_sgd zero1 zero2 zero3; do
      run "mlp_${strategy}_$n" mpi "$n" -m minitrain.examples.mlp --no-progress --comm-timeout "$COMM_TIMEOUT" --epochs "$EPOCHS" --strategy "$strategy" \
          --json "$OUT/mlp_${strategy}_$n.json" || status=1
    done
  done
  return $status
}

step_mlp2() {
  local status=0 flags
  for n in 2 4; do
    for flags in "zero2 --offload" "zero3 --offload" "ddp --precision fp16" "ddp --precision bf16" \
                 "zero3 --precision bf16" "ddp --recompute full --layers 4" "ddp --offload-activations" \
                 "pipeline --schedule gpipe --layers 3" "pipeline --schedule 1f1b --layers 3" \
                 "pipeline --schedule interleaved_1f1b --chunks 2 --layers 7" \
                 "pipeline --schedule pipedream_2bw --layers 3"; do
      local name="mlp_$(echo "$flags" | tr -c 'a-z0-9\n' '_' | tr -s '_' | sed 's/^_//')_$n"
      # shellcheck disable=SC2086
      run "$name" mpi "$n" -m minitrain.examples.mlp --no-progress --comm-timeout "$COMM_TIMEOUT" --epochs "$EPOCHS" --strategy $flags \
          --json "$OUT/$name.json" || status=1
    done
  done
  return $status
}

step_gpt() {
  local status=0 spec n flags name
  run "gpt_1" "$PY" -m minitrain.examples.gpt --no-progress --comm-timeout "$COMM_TIMEOUT" --steps 300 --json "$OUT/gpt_1.json" || status=1
  for spec in "1|--recompute full" "1|--offload-activations" "1|--dropout 0.1" "2|--dp 2" "2|--tp 2" \
              "2|--tp 2 --sequence-parallel --dropout 0.1" "2|--pp 2 --microbatches 2" "2|--tp 2 --recompute selective" \
              "4|--tp 2 --pp 2 --microbatches 2" "4|--tp 4" "4|--tp 2 --dp 2 --sequence-parallel" \
              "4|--pp 2 --schedule interleaved_1f1b --chunks 2 --microbatches 2 --n-layer 4" \
              "1|--precision bf16" "2|--cp 2 --precision bf16" \
              "2|--moe-experts 4 --dp 2 --ep 2 --zero 1 --precision fp16"; do
    n=${spec%%|*}
    flags=${spec#*|}
    name="gpt_$(echo "$flags" | tr -c 'a-z0-9\n' '_' | tr -s '_' | sed 's/^_//')_$n"
    # shellcheck disable=SC2086
    run "$name" mpi "$n" -m minitrain.examples.gpt --no-progress --comm-timeout "$COMM_TIMEOUT" --steps "$GPT_STEPS" $flags --json "$OUT/$name.json" || status=1
  done
  return $status
}

step_bench() {
  # shellcheck disable=SC2086
  RUN_TIMEOUT=$STEP_TIMEOUT run "bench_gpu" "$PY" scripts/bench_gpu.py --unfused-timing ${BENCH_ARGS:-} \
      --json "$OUT/bench_gpu.json"
}

step_transport() {
  # The device transports (issue 16 part 2): first every transport's bytes on device arrays (awkward sizes,
  # dtypes, split communicators, a size mismatch on both ranks), then the ring all-reduce bus bandwidth per
  # transport, 1 KiB to 256 MiB, beside MPI's all-reduce staged alike and NCCL's where it runs; at 2 and 4 ranks.
  local status=0 n
  for n in $TRANSPORT_RANKS; do
    run "transport_check_$n" mpi "$n" tests/programs/transport_check.py "$OUT/transport_check_$n.json" --mismatch || status=1
    # shellcheck disable=SC2086
    RUN_TIMEOUT=$((STEP_TIMEOUT / 2 - 30)) run "transport_$n" mpi "$n" scripts/bench_gpu_collectives.py ${TRANSPORT_ARGS:-} \
        --json "$OUT/transport_$n.json" || status=1
  done
  return $status
}

failed=0
for step in $STEPS; do
  if ! declare -f "step_$step" > /dev/null; then
    echo "unknown step $step (steps: env tests suite mlp mlp2 gpt bench transport)"
    failed=1
    continue
  fi
  echo "##### $step (limit $STEP_TIMEOUT s)"
  start=$SECONDS
  export -f run mpi "step_$step"
  export OUT PY RUN_TIMEOUT STEP_TIMEOUT GPUS LAUNCHER BENCH_ARGS TRANSPORT_ARGS TRANSPORT_RANKS EPOCHS GPT_STEPS \
         COMM_TIMEOUT DRY_RUN
  LAUNCH_STR=$(printf '%q ' "${LAUNCH[@]}")
  # set -u in the step's shell too: a setting not exported to it stops the step by name instead of reaching
  # the jobs as an empty option (seen: every job refused "--comm-timeout ''" on the H200)
  timeout -k 10 "$STEP_TIMEOUT" bash -uc "LAUNCH=($LAUNCH_STR); step_$step" 2>&1 | tee "$OUT/$step.log"
  rc=${PIPESTATUS[0]}
  status=ok
  [ "$rc" != 0 ] && status=failed
  { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && status=timeout
  [ "$status" != ok ] && failed=1
  printf '%s\t%s\t%s\t%s\n' "$step" "$status" "$rc" "$((SECONDS - start))" >> "$OUT/steps.tsv"
  echo "##### $step: $status in $((SECONDS - start)) s"
done

MPS_STATE=$MPS_STATE "$PY" - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
figures = {"steps": {}, "runs": {}, "bench_gpu": None, "transport": {}, "mps": os.environ["MPS_STATE"]}
for line in open(os.path.join(out, "steps.tsv")):
    step, status, rc, seconds = line.rstrip("\n").split("\t")
    figures["steps"][step] = {"status": status, "exit_code": int(rc), "seconds": int(seconds)}
for line in open(os.path.join(out, "runs.tsv")):
    name, rc, seconds = line.rstrip("\n").split("\t")
    run = {"exit_code": int(rc), "seconds": int(seconds)}
    path = os.path.join(out, name + ".json")
    if os.path.exists(path):
        report = json.load(open(path))
        for key in ("final_loss", "test_accuracy", "final_val_loss", "initial_val_loss", "samples_per_second",
                    "steps_per_second", "tokens_per_second", "bytes_per_step"):
            if key in report:
                run[key] = report[key]
        run["devices"] = [r.get("device") for r in report.get("ranks", [])]
    figures["runs"][name] = run
if os.path.exists(os.path.join(out, "bench_gpu.json")):
    figures["bench_gpu"] = json.load(open(os.path.join(out, "bench_gpu.json")))
for path in glob.glob(os.path.join(out, "transport_*.json")):
    figures["transport"][os.path.basename(path)[:-5]] = json.load(open(path))
with open(os.path.join(out, "figures.json"), "w") as f:
    json.dump(figures, f, indent=1)
print(f"figures: {os.path.join(out, 'figures.json')}")
for step, s in figures["steps"].items():
    print(f"  {step:<10} {s['status']:<8} {s['seconds']:>5} s")
EOF
exit $failed
