"""python -m minitrain.plan mlp|gpt|params|calibrate ...: will it fit, how fast, which layout.

    python -m minitrain.plan mlp --strategy zero3 --hidden 1024 --world 4        # a job's own options
    python -m minitrain.plan gpt --tp 2 --pp 2 --microbatches 4 --world 8 --json
    python -m minitrain.plan gpt --n-layer 96 --n-embd 12288 --n-head 96 --block-size 2048 \\
        --vocab-size 51200 --batch-size 1536 --world 1024 --precision bf16 --machine a100-80gb --search
    python -m minitrain.plan gpt --model mixtral-8x7b --search      # dp x tp x pp x cp x ep on 1024 H100s
    python -m minitrain.plan gpt --moe-experts 4 --moe-top-k 2 --ep 2 --cp 2 --world 8 --dp 4
    python -m minitrain.plan params --num-params 7.5e9 --world 64 --zero 3 --accounting paper
    python -m minitrain.plan calibrate

The mlp and gpt sub-commands take every option of examples.mlp / examples.gpt (the ones that do
not change a step, such as --epochs or --lr, are accepted and ignored), so a job's command line can be
copied; --json prints one JSON object (--json PATH writes it there, as the jobs' --json does).
"""
import argparse
import functools
import json
import sys
import time

from .. import cli
from . import (Layout, LayoutError, MachineError, Params, check, corpus_vocab_size, gpt_from_args, load_machine,
               mlp_from_args, predict)
from .configs import NAMED
from .job_rules import LAYOUT_RULES, refuse_threads, refuse_unplanned
from .layout import PRECISIONS, SCHEDULES
from .search import search

STRATEGIES = ("ddp", "local_sgd", "zero1", "zero2", "zero3", "pipeline")
IGNORED = "does not change a step: accepted so that a job's options can be copied, and ignored (default: none)"
CHECKS = ("accepted so that a job's options can be copied; the step is priced with the checks on, as the "
          "calibration measured it (they cost a few percent of a step: scripts/bench_checks.py) (default: off)")


_positive = cli.positive_int
#: the jobs' options that do not change a step, checked as the jobs check them
IGNORED_TYPES = {"--epochs": cli.positive_int, "--steps": cli.positive_int, "--lr": cli.nonneg_float,
                 "--seed": cli.nonneg_int, "--comm-timeout": cli.comm_timeout, "--save-every": cli.positive_int,
                 "--sample-chars": cli.nonneg_int, "--warmup-steps": cli.nonneg_int, "--init-scale": cli.positive_float}


def _json_path(text):
    """--json's PATH: '-' is standard output, any other a file written at the end."""
    return text if text == "-" else cli.output_file(text)


def add_common(p, precision="fp32"):
    p.add_argument("--world", type=_positive, default=1, help="ranks (mpirun -n N)")
    p.add_argument("--precision", choices=list(PRECISIONS), default=precision,
                   help="fp16/bf16: mixed precision with fp32 master weights")
    p.add_argument("--accounting", choices=["minitrain", "paper"], default="minitrain",
                   help="minitrain: the bytes the jobs' ledger counts; paper: ZeRO's and Korthikanti's formulas")
    p.add_argument("--device-memory", type=cli.positive_float, default=None, metavar="BYTES",
                   help="memory per rank (default: the machine's); a layout fits if its heaviest rank fits")
    p.add_argument("--host-memory", type=cli.positive_float, default=None, metavar="BYTES",
                   help="one host's memory, shared by the ranks on it (a GPU machine's GPUs per node, a CPU's every "
                        "rank; default: the machine's): a layout that offloads fits if each rank's share holds what "
                        "it offloads")
    p.add_argument("--json", nargs="?", const="-", type=_json_path, metavar="PATH",
                   help="print JSON (or write it to PATH; default: a table)")
    p.add_argument("--search", action="store_true", help="rank every valid layout of this world that fits")
    p.add_argument("--top", type=_positive, default=10, help="--search: how many to print (JSON: all)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="BLAS threads per rank on a CPU (default: as the jobs take them: cores / ranks, at most "
                        "OMP_NUM_THREADS)")
    p.add_argument("--machine", metavar="NAME", help="machine constants: a JSON path, or cpu-2core / a100-80gb "
                                     "(default: ~/.cache/minitrain/machine.json if calibrated, else cpu-2core)")


def add_mlp(p):
    """examples/mlp.py's options (tests/test_plan.py checks that every one of them is accepted here)."""
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp", help="how the ranks share the work")
    p.add_argument("--sync-every", type=_positive, default=4, help="local_sgd: average parameters every N steps")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline: the schedule")
    p.add_argument("--microbatches", type=_positive, default=4, help="pipeline: micro-batches per step")
    p.add_argument("--chunks", type=_positive, default=None,
                   help="pipeline: model chunks per rank (interleaved_1f1b; default: 1; zbv is always 2), as the job")
    p.add_argument("--dp", type=_positive, default=1, help="pipeline: data-parallel replicas")
    p.add_argument("--batch-size", type=_positive, default=64, help="global batch size (all ranks together)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="adam", help="the optimizer, for its state's bytes")
    p.add_argument("--hidden", type=_positive, default=128, help="width of each hidden layer")
    p.add_argument("--layers", type=_positive, default=None,
                   help="number of hidden layers (default: 2; pipeline: max(2, stages)), as the job")
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0, help="ddp: gradient bucket size in MiB")
    p.add_argument("--offload", action="store_true", help="optimizer state and master weights on the host")
    p.add_argument("--recompute", choices=["none", "full"], default="none", help="full: sqrt(layers) segments")
    p.add_argument("--offload-activations", action="store_true", help="saved activations in host memory")
    for name in ("--epochs", "--lr", "--seed", "--trace", "--plot", "--comm-timeout", "--save-dir", "--save-every"):
        p.add_argument(name, type=IGNORED_TYPES.get(name), help=IGNORED)
    for name in ("--no-progress", "--resume", "--show-plan", "--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"):
        p.add_argument(name, action="store_true", help=IGNORED)
    p.add_argument("--no-check-collectives", action="store_true", help=CHECKS)


def add_gpt(p):
    """examples/gpt.py's options, plus the vocabulary, ZeRO over dp and the planner's precision."""
    p.add_argument("--batch-size", type=_positive, default=16, help="global batch: sequences per step")
    p.add_argument("--block-size", type=_positive, default=32, help="context length")
    p.add_argument("--n-layer", type=_positive, default=2, help="transformer blocks")
    p.add_argument("--n-head", type=_positive, default=4, help="attention heads")
    p.add_argument("--n-embd", type=_positive, default=64, help="embedding width")
    p.add_argument("--dropout", type=cli.probability, default=0.0, help="dropout probability (its masks' bytes)")
    p.add_argument("--recompute", choices=["none", "full", "selective"], default="none",
                   help="each block (full) or the attention core (selective)")
    p.add_argument("--offload-activations", action="store_true", help="saved activations in host memory")
    p.add_argument("--tp", type=_positive, default=1, help="tensor-parallel ranks")
    p.add_argument("--sequence-parallel", action="store_true", help="with --tp: split LayerNorm regions by sequence")
    p.add_argument("--pp", type=_positive, default=1, help="pipeline stages")
    p.add_argument("--dp", type=_positive, default=None, help="default: world / (pp·tp)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"], default="1f1b",
                   help="pipeline schedule (with --pp)")
    p.add_argument("--microbatches", type=_positive, default=1, help="micro-batches per replica and step")
    p.add_argument("--chunks", type=_positive, default=None,
                   help="virtual stages per rank (interleaved_1f1b; default: 1; zbv is always 2)")
    p.add_argument("--vocab-size", type=_positive, default=None, help="default: the gpt job's corpus")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage over dp")
    axes = p.add_argument_group("context and expert parallelism, mixture of experts "
                              "(plan/context.py, plan/experts.py)")
    axes.add_argument("--cp", type=_positive, default=1, help="context-parallel ranks: the sequence split over them")
    axes.add_argument("--cp-method", choices=["ring", "ulysses"], default="ring",
                      help="ring attention (zig-zag) or DeepSpeed-Ulysses' all-to-alls")
    axes.add_argument("--ep", type=_positive, default=1, help="expert-parallel ranks (divides dp): E/ep experts each")
    axes.add_argument("--moe-load", type=cli.positive_float, default=1.0,
                      help="the busiest rank's experts' rows over its own routed rows: 1 to ep, below 1 where a "
                           "capacity drops rows (the jobs print their run's)")
    axes.add_argument("--moe-experts", type=cli.nonneg_int, default=0, help="experts per MoE layer (0: dense)")
    axes.add_argument("--moe-top-k", type=_positive, default=2, help="experts each token is routed to")
    axes.add_argument("--moe-capacity-factor", type=cli.positive_float, default=None,
                      help="choices an expert takes per group: ceil(C·tokens·k/E) (default: dropless)")
    axes.add_argument("--moe-every", type=_positive, default=1, help="every N-th block's MLP is an MoE layer")
    axes.add_argument("--moe-aux-loss-coef", type=cli.nonneg_float, help=IGNORED)
    axes.add_argument("--moe-groups", type=_positive, default=None,
                      help="GShard's groups over the global batch (default: dp, as the job)")
    axes.add_argument("--ffn-hidden", type=_positive, default=None, help="the MLP's hidden width (default: 4·n_embd)")
    axes.add_argument("--expert-hidden", type=_positive, default=None,
                      help="each expert's hidden width (default: --ffn-hidden)")
    axes.add_argument("--moe-shared", type=cli.nonneg_int, default=0, help="shared experts every token goes through")
    axes.add_argument("--model", choices=sorted(NAMED), default=None,
                      help="a named configuration's sizes (plan/configs.py); options given beside it win (default: none, the sizes given)")
    for name in ("--steps", "--lr", "--seed", "--sample-chars", "--comm-timeout", "--save-dir", "--save-every",
                 "--lr-schedule", "--warmup-steps", "--init-scale"):
        p.add_argument(name, type=IGNORED_TYPES.get(name), help=IGNORED)
    for name in ("--no-progress", "--resume", "--show-plan", "--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"):
        p.add_argument(name, action="store_true", help=IGNORED)
    p.add_argument("--no-check-collectives", action="store_true", help=CHECKS)


def parser(defaults=None):
    top = argparse.ArgumentParser(prog="python -m minitrain.plan", description=__doc__.splitlines()[0],
                                  formatter_class=cli.HelpFormatter, allow_abbrev=False)
    sub = top.add_subparsers(dest="command", required=True, parser_class=functools.partial(argparse.ArgumentParser,
                                                                                           allow_abbrev=False))
    add_mlp(m := sub.add_parser("mlp", help="the mlp job (examples.mlp)", formatter_class=cli.HelpFormatter))
    add_common(m)
    add_gpt(g := sub.add_parser("gpt", help="the gpt job (examples.gpt), or any GPT by its sizes",
                                formatter_class=cli.HelpFormatter))
    add_common(g)
    if defaults:
        g.set_defaults(**defaults)
    top.jobs = {"mlp": m, "gpt": g}
    p = sub.add_parser("params", help="model states only, from a parameter count", formatter_class=cli.HelpFormatter)
    top.commands = {**top.jobs, "params": p}
    p.add_argument("--num-params", type=cli.positive_int, required=True, help="the model's parameters, e.g. 7.5e9 (required)")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage over the ranks")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="adam", help="the optimizer, for its state's bytes")
    p.add_argument("--offload", action="store_true", help="optimizer state on the host (ZeRO-Offload)")
    add_common(p, precision="fp16")
    sub.add_parser("calibrate", help="measure this machine (see minitrain/plan/calibrate.py)", add_help=False)
    sub.add_parser("validate", help="run the jobs, compare with the planner (minitrain/plan/validate.py)",
                   add_help=False)
    return top


def model_and_layout(args):
    if args.command == "mlp":
        return mlp_from_args(args, args.world)
    if args.command == "gpt":
        return gpt_from_args(args, args.world, args.vocab_size or corpus_vocab_size())
    layout = Layout(world=args.world, dp=args.world, zero=args.zero, precision=args.precision,
                    optimizer=args.optimizer, offload=args.offload, batch_size=args.world)
    return Params(int(args.num_params)), layout


def with_host_memory(parser, args, machine, model, layout):
    """The machine with --host-memory as its host's memory, or the option refused where it would change nothing: a
    device of its own (a GPU's, or --device-memory on a CPU) and nothing offloaded (the planner counts the host bytes
    of the mlp and params models' --offload; params' --search tries offload whatever was asked)."""
    own_device = machine.get("device_memory_bytes") is not None or args.device_memory is not None
    offloads = model.kind != "gpt" and (layout.offload or (args.search and model.kind == "params"))
    if own_device and not offloads:
        cli.refuse(parser, "--host-memory", "a layout that offloads nothing" if model.kind != "gpt" else "the gpt model",
                   "each rank holds everything on its device, so nothing is planned on the host; --offload puts "
                   "the mlp's and params' optimizer state there")
    return {**machine, "memory_bytes": int(args.host_memory)}


def fmt(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def show(result):
    mem, t, host, shared = result["memory_bytes"], result["step_time_s"], result["host_memory_bytes"], result["fits_counts_host"]
    device, host_share = result["device_memory_bytes"], result["host_capacity_bytes"]
    # the verdict on each memory: the device's alone where the host is checked apart (a GPU's, with --offload)
    device_fits = result["fits"] if shared or host is None else device is None or mem["total"] <= device
    lines = [f"{result['model']} ({result['num_params']:,} parameters) on {result['layout']['world']} rank(s): "
             f"{result['describe']}; {result['accounting']} accounting, machine {result['machine']}",
             "memory per rank (the heaviest): " + ", ".join(f"{c} {fmt(mem[c])}" for c in mem)
             + f"  -> {'fits' if device_fits else 'does NOT fit'}" + (f" in {fmt(device)}" if device else "")]
    if host:                                    # --offload
        lines.append("on the host (offloaded), per rank: " + ", ".join(f"{c} {fmt(v)}" for c, v in host.items())
                     + ("; on a CPU the host's memory is the device's: 'fits' counts both" if shared else
                        f"  -> {'fits' if host['total'] <= host_share else 'does NOT fit'} in its share of the host, "
                        f"{fmt(host_share)}" if host_share is not None else ""))
    if result["model"] != "params":             # model states alone: no step to time
        lines.append(f"step time: {t['total'] * 1e3:.3f} ms = compute {t['compute'] * 1e3:.3f} + comm "
                     f"{t['comm'] * 1e3:.3f} + bubble {t['bubble'] * 1e3:.3f} (bubble fraction "
                     f"{result['bubble_fraction']:.3f}); {result['flops_per_iteration']:.3e} FLOPs per iteration")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:
        from .calibrate import main as calibrate_main
        return calibrate_main(argv[1:])
    if argv[:1] == ["validate"]:
        from .validate import main as validate_main
        return validate_main(argv[1:])
    p = parser()
    args = p.parse_args(argv)
    if getattr(args, "model", None):              # the named sizes as defaults: options given beside them win
        p = parser(defaults=NAMED[args.model])
        args = p.parse_args(argv)
    if args.command in p.commands:                # what the job would refuse, or ignore, is not planned either
        command = p.commands[args.command]
        given = cli.given_options(parser().commands[args.command], argv[1:])    # a --model's sizes are not given
        if args.command in LAYOUT_RULES:
            LAYOUT_RULES[args.command](command, args, given)
        refuse_unplanned(command, args, given)
    try:
        machine = load_machine(args.machine)
        if getattr(args, "threads", None) is not None:
            refuse_threads(p.commands[args.command], args, machine)
        model, layout = model_and_layout(args)
        if args.host_memory is not None:
            machine = with_host_memory(p.commands[args.command], args, machine, model, layout)
        if args.search:
            started = time.perf_counter()
            out = search(model, layout, machine, args.accounting, args.device_memory)
            elapsed = time.perf_counter() - started
        else:
            check(model, layout)
            out = predict(model, layout, machine, args.accounting, args.device_memory)
    except LayoutError as e:
        p.exit(2, f"{p.prog} {args.command}: error: impossible layout: {e}\n")
    except MachineError as e:
        p.exit(2, f"{p.prog} {args.command}: error: {e}\n")
    if args.json:
        text = json.dumps(out, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
        return 0
    if not args.search:
        print(show(out))
        return 0
    timed = args.command != "params"              # params ranks by memory alone
    print(f"{len(out)} layouts fit ({elapsed:.2f} s)" + (f"; the {min(args.top, len(out))} "
                                                        f"{'fastest' if timed else 'smallest'}:" if out else ""))
    for rank, result in enumerate(out[:args.top], 1):
        mem, t = result["memory_bytes"], result["step_time_s"]
        print(f"{rank:>3}. {result['describe']:<52} {fmt(mem['total']):>11}"
              + (f"  {t['total']:.4g} s/step (bubble {result['bubble_fraction']:.3f})" if timed else ""))
    return 0


if __name__ == "__main__":
    cli.run_command(main)
