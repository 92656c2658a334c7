"""`fsdp2-compile`: dump the graphs the compiler produces for a model, or plan its memory and time at N ranks.

Exit codes: 0 ok, 1 runtime failure (the factory raised or returned the wrong thing, compilation failed),
2 usage error (bad arguments, a TARGET that cannot be imported or names nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from fsdp2_compile.cli.arguments import PROG, check_args, keep_gathered_arg, positive_bytes
from fsdp2_compile.cli.dump_command import cmd_dump
from fsdp2_compile.cli.model_loading import RunError, UsageError
from fsdp2_compile.cli.plan_command import cmd_plan

__all__ = ["main"]

# torch and the compiler are imported inside the commands: `fsdp2-compile --help` answers without them.

TARGET_HELP = (
    "module:factory or path/to/file.py:factory; the factory returns (model, args) or (model, args, loss_fn) "
    "(default loss: sum of the first floating-point output)"
)


REPLICATE_HELP = (
    "HSDP: R replicas of N/R shards, on the mesh R x N/R (replicate x shard); gradients are reduce-scattered over "
    "N/R ranks, then all-reduced over R (default 1: shard over all N ranks; N must be a multiple of R)"
)

TP_HELP = (
    "tensor parallelism of degree T inside FSDP: mesh N/T x T (dp x tp), or R x N/(R T) x T with --replicate; the "
    "factory's TP plan (factory.tp_plan) or a default for Linear layers named like torchtitan / Hugging Face "
    "(q/k/v/gate/up column-wise, o/down/proj row-wise) is applied to every block on the tp mesh, then the model is "
    "sharded over dp (default 1: no TP; N must be a multiple of R x T)"
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # exit code 2 with the usage, as argparse does, but through UsageError
        self.print_usage(sys.stderr)
        raise UsageError(message)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """What both subcommands take: the model, the ranks and the mixed precision."""
    parser.add_argument("target", metavar="TARGET", help=TARGET_HELP)
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks (N)")
    parser.add_argument("--replicate", type=int, metavar="R", help=REPLICATE_HELP)
    parser.add_argument("--tp", type=int, metavar="T", help=TP_HELP)
    parser.add_argument("--mp", choices=["bf16"], help="mixed precision: bf16 parameters, fp32 gradient reduction")
    parser.add_argument(
        "--seq-len",
        type=int,
        metavar="S",
        help="sequence length: passed to the factory as its seq_len=, max_seq_len= or seq= argument (default: the "
        "factory's own)",
    )
    parser.add_argument(
        "--local-batch",
        type=int,
        metavar="B",
        help="samples per data-parallel rank: passed to the factory as its batch= argument (default: the factory's "
        "own)",
    )


def _add_keep_gathered(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--keep-gathered",
        type=keep_gathered_arg,
        metavar="F|BYTES",
        help="selective unsharding (CompileConfig.keep_gathered): keep the last buckets of the "
        "forward gathered for backward, within this fraction of the gathered parameter bytes "
        "or this many bytes",
    )
    parser.add_argument(
        "--memory-budget",
        type=positive_bytes,
        metavar="BYTES",
        help="CompileConfig.memory_budget_bytes: gathered parameter bytes alive at once; what the "
        "prefetch window leaves keeps the last buckets gathered for backward",
    )


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog=PROG,
        formatter_class=fmt,
        description="Inspect what the fsdp2 compiler does to a model, or plan its memory and time at N ranks.\n"
        "Both run in one process under a fake process group (no peers, no accelerator needed).",
        epilog="examples:\n"
        f"  {PROG} dump examples/llama.py:llama_tiny --world-size 4 --out /tmp/dump\n"
        f"  {PROG} plan examples/llama.py:llama3_70b --world-size 1024\n"
        f"  {PROG} plan examples/llama.py:llama3_70b --world-size 1024 --replicate 8   # HSDP, 8 x 128\n"
        f"  {PROG} plan examples/llama.py:llama3_8b --world-size 64 --tp 8   # FSDP 8 x TP 8\n"
        f"  python -m fsdp2_compile plan examples/llama.py:llama3_8b --world-size 64 --json\n\n"
        "exit codes: 0 ok, 1 runtime failure, 2 usage error",
    )
    sub = parser.add_subparsers(dest="command", metavar="{dump,plan}", parser_class=_Parser)

    dump = sub.add_parser(
        "dump",
        formatter_class=fmt,
        help="compile a model and write its graphs after every pass, SVG/DOT, trace, memory chart and a summary",
        description="Shard TARGET's model over N ranks (rank 0, fake process group), compile it with the fsdp2 "
        "backend, run forward + loss + backward once, and write to --out:\n"
        "  <graph>/NN_<pass>.txt   the graph after every pass, collectives annotated with params/bucket\n"
        "  <graph>/graph.svg, .dot the final graph, collectives / waits / casts highlighted\n"
        "  trace.json              simulated schedule (open in ui.perfetto.dev or chrome://tracing)\n"
        "  memory.png              estimated live bytes over the step (--memory-plot memory.svg: SVG)\n"
        "  summary.txt             the table also printed on stdout\n"
        "Blocks of the model's longest nn.ModuleList are sharded first (FSDP2's pattern), then the root.\n"
        "In a real run, FSDP2_COMPILE_DUMP=DIR writes the same artefacts to DIR/rank<r>.",
        epilog=f"examples:\n  {PROG} dump examples/llama.py:llama3_8b --world-size 8 --mp bf16 --out /tmp/llama\n"
        f"  {PROG} dump examples/llama.py:llama_tiny --world-size 4 --replicate 2 --out /tmp/hsdp\n"
        f"  {PROG} dump mypkg.models:make_model --world-size 2 --no-reshard",
    )
    _add_model_args(dump)
    dump.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False")
    dump.add_argument("--no-block-shard", action="store_true", help="shard only the root (one bucket)")
    _add_keep_gathered(dump)
    dump.add_argument("--hardware", help="cost-model profile for the trace (default cpu-gloo-loopback)")
    dump.add_argument("--out", default="fsdp2_dump", help="output folder (default ./fsdp2_dump)")
    dump.add_argument(
        "--memory-plot",
        default="memory.png",
        metavar="NAME",
        help="file name of the memory chart in --out; its extension picks the format, .png or .svg (default memory.png)",
    )
    dump.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    dump.set_defaults(run=cmd_dump)

    plan = sub.add_parser(
        "plan",
        formatter_class=fmt,
        help="per-rank memory, bytes on the wire and step time at N ranks (meta device)",
        description="Plan TARGET's model at N ranks without its memory: build it (on the meta device), shard it "
        "with the real shard() for the per-rank parameter / gradient / AdamW bytes, compile reduced "
        "copies (1 and 2 blocks when the factory takes layers=) through the real pipeline for "
        "collectives, activations and the simulated step of every cost-model profile, scaled to the "
        "full block count.",
        epilog=f"examples:\n  {PROG} plan examples/llama.py:llama3_70b --world-size 1024\n"
        f"  {PROG} plan examples/llama.py:llama3_70b --world-size 1024 --replicate 8\n"
        f"  {PROG} plan examples/llama.py:llama3_8b --world-size 64 --hardware h100-nvlink --json",
    )
    _add_model_args(plan)
    plan.add_argument("--hardware", help="only this cost-model profile (default: all of hardware.PROFILES)")
    plan.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False")
    _add_keep_gathered(plan)
    plan.add_argument(
        "--attention",
        choices=["fused", "math"],
        default="fused",
        help="scaled_dot_product_attention as flash / memory-efficient (default) or unfused math",
    )
    plan.add_argument(
        "--ac",
        choices=["none", "full", "selective"],
        default="none",
        help="activation checkpointing per block (selective: torchtitan's per-op policy); a model "
        "already wrapped in checkpoint_wrapper is planned as it is",
    )
    plan.add_argument(
        "--compiler",
        choices=["aot_eager", "inductor", "inductor-blocks"],
        default="aot_eager",
        help="kernels the plan assumes: eager (default), Inductor-fused elementwise, or Inductor on "
        "each block only (torchtitan's per-block compile)",
    )
    plan.add_argument(
        "--pp",
        type=int,
        metavar="P",
        help="pipeline parallelism of degree P: mesh P x N/P (pp x dp), with --replicate / --tp inside; the blocks "
        "split into P x V stages as torchtitan splits them (default 1: no PP)",
    )
    plan.add_argument(
        "--microbatches",
        type=int,
        metavar="M",
        help="micro-batches per step under --pp; must divide the local batch (default: torchtitan's, the local "
        "batch: micro-batches of one sample)",
    )
    plan.add_argument(
        "--pp-schedule",
        choices=["1F1B", "GPipe", "Interleaved1F1B"],
        default="1F1B",
        help="pipeline schedule (default 1F1B)",
    )
    plan.add_argument(
        "--stages-per-rank",
        type=int,
        metavar="V",
        help="stages per pp rank for Interleaved1F1B (default 2, torchtitan's)",
    )
    plan.add_argument(
        "--float8",
        action="store_true",
        help="torchao float8 training with float8 all-gather of the blocks' Linear weights; needs --mp bf16 and "
        "a profile with float8 matmuls (default: those profiles only)",
    )
    plan.add_argument(
        "--search",
        action="store_true",
        help="enumerate layouts and knobs (tp, pp, replicate, AC, resharding, prefetch, keep_gathered, float8) at "
        "--world-size and --global-batch on --hardware, and print the five that fit memory with the most tokens/s "
        "per GPU; --tp / --pp / --replicate, when given, pin that degree",
    )
    plan.add_argument("--global-batch", type=int, metavar="B", help="with --search: samples per step, all ranks")
    plan.add_argument(
        "--device-memory",
        type=positive_bytes,
        metavar="BYTES",
        help="with --search: the device's memory (default: the profile's, 80 GiB on the H100 ones)",
    )
    plan.add_argument(
        "--emit-config", metavar="PATH", help="with --search: write the best layout's recipe (JSON) to PATH"
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    plan.set_defaults(run=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
        if ns.command is None:
            parser.print_help()
            return 2
        # degrees given on the command line (--search keeps them), then their default 1
        ns.pinned = {k: getattr(ns, k, None) for k in ("tp", "pp", "replicate") if getattr(ns, k, None) is not None}
        for k in ("tp", "pp", "replicate"):
            if hasattr(ns, k) and getattr(ns, k) is None:
                setattr(ns, k, 1)
        check_args(ns)
        return ns.run(ns)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        if os.environ.get("FSDP2_COMPILE_DEBUG"):
            traceback.print_exc()
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # anything else is a runtime failure; the traceback only on request
        print(f"{PROG}: error: {type(e).__name__}: {e} (set FSDP2_COMPILE_DEBUG=1 for the traceback)", file=sys.stderr)
        if os.environ.get("FSDP2_COMPILE_DEBUG"):
            traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
