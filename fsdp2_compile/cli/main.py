"""`fsdp2-compile`: dump the graphs the compiler produces for a model, or plan its memory and time at N ranks.

Exit codes: 0 ok, 1 runtime failure (the factory raised or returned the wrong thing, compilation failed),
2 usage error (bad arguments, a TARGET that cannot be imported or names nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import traceback

from fsdp2_compile.cli.model_loading import RunError, UsageError

__all__ = ["main"]

# torch and the compiler are imported inside the commands: `fsdp2-compile --help` answers without them.

PROG = "fsdp2-compile"
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

LARGE_WORLD = 100_000
"""--world-size above this warns with the memory and time the fake process group's run will need."""
BASE_BYTES = 400 * 2**20
"""Peak RSS of `dump` / `plan` at a small --world-size (torch, the compiler, tests/cli_factories.py's models)."""
BYTES_PER_RANK = 2**10
"""Peak RSS per rank of --world-size, measured (peak RSS with /usr/bin/time, 2026-11-30): `dump` of
tests/cli_factories.py:tiny 404 MB at 1,000 ranks, 496 MB at 100,000, 782 MB at 400,000, 1.39 GB at 1,000,000
(about 1 KiB per rank: the fake group's and the meshes' per-rank lists); `plan ...:wide_meta` grows slower (402 MB at
1,000, 636 MB at 1,000,000)."""
SECONDS_PER_MILLION_RANKS = 45
"""Extra run time per million ranks, measured with the same runs (`dump` 7 s at 1,000 ranks, 51 s at 1,000,000)."""


# ---------------------------------------------------------------------------------------------- helpers


class Progress:
    """The CLI's long phases on stderr: a tqdm bar (phase i of n, elapsed time ticking every second) when tqdm is
    installed and stderr is a terminal, else one `[  1.2 s] phase ...` line per phase and `done` at the end;
    nothing when quiet."""

    def __init__(self, total: int | None = None, quiet: bool = False, stream=None):
        self.stream = stream or sys.stderr
        self.quiet, self.start, self.bar = quiet, time.perf_counter(), None
        if not quiet and self.stream.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(
                total=total,
                file=self.stream,
                desc=PROG,
                leave=False,
                mininterval=0,
                bar_format="{desc} [phase {n_fmt}/{total_fmt}, {elapsed}]",
            )
            self.stop = threading.Event()
            threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while not self.stop.wait(1.0):
            self.bar.refresh()

    def step(self, message: str) -> None:
        """A new phase begins (the previous one is done)."""
        if self.bar is not None:
            self.bar.set_description_str(f"{PROG}: {message}", refresh=False)
            self.bar.update(1)
        elif not self.quiet:
            print(f"{PROG}: [{time.perf_counter() - self.start:5.1f} s] {message} ...", file=self.stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if self.bar is not None:
            self.stop.set()
            self.bar.close()
        if not self.quiet and exc_type is None:
            print(f"{PROG}: [{time.perf_counter() - self.start:5.1f} s] done", file=self.stream, flush=True)


def _mp_policy(name: str | None):
    import torch

    from fsdp2_compile.config import MixedPrecisionPolicy

    if name is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _mesh_words(world_size: int, replicate: int, tp: int = 1) -> str:
    """'4 ranks', '4 ranks, mesh 2 x 2 (replicate x shard)' or '4 ranks, mesh 2 x 2 (dp x tp)'."""
    if tp > 1:
        if replicate == 1:
            return f"{world_size} ranks, mesh {world_size // tp} x {tp} (dp x tp)"
        return f"{world_size} ranks, mesh {replicate} x {world_size // (replicate * tp)} x {tp} (replicate x dp x tp)"
    if replicate == 1:
        return f"{world_size} ranks"
    return f"{world_size} ranks, mesh {replicate} x {world_size // replicate} (replicate x shard)"


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux: ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_estimate(world_size: int) -> int:
    """Rough peak RSS of a run at `world_size` ranks (BASE_BYTES + BYTES_PER_RANK x N; a large model adds its own)."""
    return BASE_BYTES + BYTES_PER_RANK * world_size


def check_out_folder(path: str) -> None:
    """Create the --out folder and write a probe file there, so a bad path fails before minutes of compiling."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UsageError(
            f"--out {path!r} is not a folder this process can write to ({e.strerror or e}); "
            "pass --out with a writable folder"
        ) from e


def check_args(ns: argparse.Namespace) -> None:
    """Cheap checks of the parsed arguments, before importing torch or the model (UsageError names the argument)."""
    if ns.world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {ns.world_size}")
    if ns.replicate < 1:
        raise UsageError(f"--replicate must be >= 1, got {ns.replicate}")
    if ns.tp < 1:
        raise UsageError(f"--tp must be >= 1, got {ns.tp}")
    if ns.seq_len is not None and ns.seq_len < 1:
        raise UsageError(f"--seq-len must be >= 1, got {ns.seq_len}")
    if ns.local_batch is not None and ns.local_batch < 1:
        raise UsageError(f"--local-batch must be >= 1, got {ns.local_batch}")
    if ns.tp > 1 and ns.world_size % (ns.replicate * ns.tp):
        raise UsageError(
            f"--world-size {ns.world_size} is not a multiple of --replicate {ns.replicate} x --tp {ns.tp}: the mesh "
            f"is replicate x dp x tp; pass a --world-size that is a multiple of {ns.replicate * ns.tp}"
        )
    pp = getattr(ns, "pp", 1)
    if pp < 1:
        raise UsageError(f"--pp must be >= 1, got {pp}")
    if pp > 1 and ns.world_size % (pp * ns.replicate * ns.tp):
        raise UsageError(
            f"--world-size {ns.world_size} is not a multiple of --pp {pp} x --replicate {ns.replicate} x --tp "
            f"{ns.tp}: the mesh is pp x replicate x dp x tp; pass a --world-size that is a multiple of "
            f"{pp * ns.replicate * ns.tp}"
        )
    if pp == 1 and ns.command == "plan" and not ns.search:
        for flag, value in (("--microbatches", ns.microbatches), ("--stages-per-rank", ns.stages_per_rank)):
            if value is not None:
                raise UsageError(f"{flag} needs --pp P with P > 1 (pipeline parallelism)")
    if getattr(ns, "float8", False):
        from fsdp2_compile.planner.devices import device_for

        if ns.mp != "bf16":
            raise UsageError("--float8 needs --mp bf16: torchao's float8 training keeps the rest in bf16")
        if ns.hardware is not None and not device_for(ns.hardware).float8_flops:
            raise UsageError(
                f"--float8 on --hardware {ns.hardware}: that profile has no float8 matmul; use a profile with "
                "float8 (h100-nvlink, h100-infiniband) or leave --hardware out"
            )
    if ns.world_size % ns.replicate:
        raise UsageError(
            f"--world-size {ns.world_size} is not a multiple of --replicate {ns.replicate}: HSDP needs "
            f"--world-size = --replicate x shard size; pass a --replicate that divides {ns.world_size} or a "
            f"--world-size that is a multiple of {ns.replicate}"
        )
    if ns.hardware is not None:
        from fsdp2_compile.core.hardware import PROFILES

        if ns.hardware not in PROFILES:
            raise UsageError(f"--hardware {ns.hardware!r} is not one of: {', '.join(PROFILES)}")
    if ns.command == "dump":
        check_out_folder(ns.out)
        if os.path.basename(ns.memory_plot) != ns.memory_plot or not ns.memory_plot.endswith((".png", ".svg")):
            raise UsageError(f"--memory-plot {ns.memory_plot!r}: a file name ending in .png or .svg")
    if ns.command == "plan":
        _check_search_args(ns)
    if ns.world_size > LARGE_WORLD:
        from fsdp2_compile.debug.sizes import size_text

        seconds = SECONDS_PER_MILLION_RANKS * ns.world_size / 1e6
        print(
            f"{PROG}: warning: --world-size {ns.world_size:,} is simulated in this one process (the fake process "
            f"group keeps per-rank state): expect about {size_text(memory_estimate(ns.world_size))} of memory "
            f"(measured: {size_text(BYTES_PER_RANK)} per rank plus {size_text(BASE_BYTES)}, more for a large "
            f"model) and about {seconds:.0f} s more run time",
            file=sys.stderr,
            flush=True,
        )


def _check_search_args(ns: argparse.Namespace) -> None:
    """--search's own flags: --global-batch and --hardware needed, the single-layout knobs refused."""
    search_only = [
        f
        for f, v in (
            ("--global-batch", ns.global_batch),
            ("--emit-config", ns.emit_config),
            ("--device-memory", ns.device_memory),
        )
        if v is not None
    ]
    if not ns.search:
        if search_only:
            raise UsageError(f"{search_only[0]} needs --search")
        return
    if ns.global_batch is None or ns.global_batch < 1:
        raise UsageError("--search needs --global-batch B (samples per step over all ranks, >= 1)")
    if ns.hardware is None:
        raise UsageError("--search needs --hardware PROFILE (the device the layouts are ranked on)")
    given = [
        f
        for f, v in (
            ("--ac", ns.ac != "none"),
            ("--no-reshard", ns.no_reshard),
            ("--float8", ns.float8),
            ("--keep-gathered", ns.keep_gathered is not None),
            ("--memory-budget", ns.memory_budget is not None),
            ("--microbatches", ns.microbatches is not None),
            ("--stages-per-rank", ns.stages_per_rank is not None),
            ("--pp-schedule", ns.pp_schedule != "1F1B"),
            ("--local-batch", ns.local_batch is not None),
        )
        if v
    ]
    if given:
        raise UsageError(f"{given[0]} with --search: the search enumerates it; leave it out")
    if ns.global_batch % (ns.world_size // (ns.pp * ns.tp)) and "tp" in ns.pinned and "pp" in ns.pinned:
        dp = ns.world_size // (ns.pp * ns.tp)
        raise UsageError(
            f"--global-batch {ns.global_batch} is not a multiple of the data-parallel size {dp} (--world-size "
            f"{ns.world_size} / (--pp {ns.pp} x --tp {ns.tp})): each dp rank takes global batch / dp samples; pass "
            f"a multiple of {dp}"
        )


# ---------------------------------------------------------------------------------------------- commands


def cmd_dump(ns: argparse.Namespace) -> int:
    with Progress(4, ns.quiet) as progress:
        progress.step(f"importing torch, the compiler and {ns.target}")
        from fsdp2_compile.api import shard_compile
        from fsdp2_compile.cli.model_loading import fake_group, load_target, sized_call
        from fsdp2_compile.compiler.report import clear_compiled_graphs, compiled_graphs
        from fsdp2_compile.config import CompileConfig
        from fsdp2_compile.core.hardware import PROFILES
        from fsdp2_compile.debug.dump import write_dump
        from fsdp2_compile.planner.block_sharding import shard_blocks
        from fsdp2_compile.planner.reduced_depth import block_list
        from fsdp2_compile.planner.tensor_parallel import apply_tp, plan_meshes, plan_text, tp_plan_for

        factory = load_target(ns.target)
        call = sized_call(factory, ns.seq_len, ns.local_batch)
        hardware = ns.hardware or "cpu-gloo-loopback"
        mp = _mp_policy(ns.mp)
        reshard = False if ns.no_reshard else None  # None: FSDP2's default (the root keeps its parameters)
        where = _mesh_words(ns.world_size, ns.replicate, ns.tp)
        tp_text = ""
        with fake_group(ns.world_size):
            mesh, tp_mesh = plan_meshes(ns.world_size, ns.replicate, ns.tp)
            progress.step(f"building {ns.target}")
            model, args, loss_fn = call(factory)
            if tp_mesh is not None:
                _, blocks = block_list(model)
                if blocks is None:
                    raise UsageError("--tp needs a model with an nn.ModuleList of blocks to apply the TP plan to")
                try:
                    plan, source = tp_plan_for(factory, blocks[0])
                except ValueError as e:
                    raise UsageError(f"--tp {ns.tp}: {e}") from e
                tp_text = plan_text(plan, source)
                try:
                    apply_tp(model, tp_mesh, plan)
                except Exception as e:
                    raise RunError(f"applying the TP plan failed: {type(e).__name__}: {e}") from e
            progress.step(f"sharding over {where} (rank 0, fake process group), compiling forward and backward")
            if not ns.no_block_shard:
                shard_blocks(model, mesh, reshard_after_forward=reshard, mp_policy=mp)
            clear_compiled_graphs()
            shard_compile(
                model,
                mesh,
                reshard_after_forward=reshard,
                mp_policy=mp,
                compile_config=CompileConfig(
                    hardware=hardware,
                    check_rank_consistency=False,
                    keep_snapshots=True,
                    keep_gathered=ns.keep_gathered,
                    memory_budget_bytes=ns.memory_budget,
                ),
            )
            try:
                loss = loss_fn(model(*args))
                loss.backward()
            except RunError:
                raise
            except Exception as e:
                raise RunError(f"forward/backward of the compiled model failed: {type(e).__name__}: {e}") from e
            records = compiled_graphs()
            if not records:
                raise RunError("nothing was compiled (did the model run any sharded parameter?)")
            progress.step(f"simulating the step and writing {len(records)} graphs to {ns.out}")
            summary = write_dump(records, ns.out, PROFILES[hardware], memory_plot=ns.memory_plot)
    print(f"sharded over {where}")
    if tp_text:
        print(f"tensor parallel {ns.tp}: {tp_text}")
    print(summary, end="")
    print(f"artefacts in {os.path.abspath(ns.out)}")
    return 0


def cmd_plan(ns: argparse.Namespace) -> int:
    if ns.search:
        return cmd_search(ns)
    start = time.perf_counter()
    with Progress(None, ns.quiet) as progress:
        progress.step(f"importing torch, the compiler and {ns.target}")
        import json

        from fsdp2_compile.cli.model_loading import fake_group, load_target, sized_call
        from fsdp2_compile.core.hardware import PROFILES
        from fsdp2_compile.planner.devices import device_for
        from fsdp2_compile.planner.format import format_plan
        from fsdp2_compile.planner.layout import Layout
        from fsdp2_compile.planner.plan import make_plan

        factory = load_target(ns.target)
        call = sized_call(factory, ns.seq_len, ns.local_batch)
        # --float8 without --hardware: the profiles that have float8 matmuls
        profiles = (
            [ns.hardware] if ns.hardware else [n for n in PROFILES if not ns.float8 or device_for(n).float8_flops]
        )
        try:
            layout = Layout(
                ns.world_size,
                replicate=ns.replicate,
                tp=ns.tp,
                reshard_after_forward=False if ns.no_reshard else None,
                mp_policy=_mp_policy(ns.mp),
                attention=ns.attention,
                ac=ns.ac,
                compiler=ns.compiler,
                keep_gathered=ns.keep_gathered,
                memory_budget_bytes=ns.memory_budget,
                pp=ns.pp,
                microbatches=ns.microbatches,
                pp_schedule=ns.pp_schedule,
                stages_per_rank=ns.stages_per_rank,
                float8=ns.float8,
            )
        except ValueError as e:
            raise UsageError(str(e)) from e
        with fake_group(ns.world_size):
            try:
                plan = make_plan(factory, layout, call=call, profiles=profiles, progress=progress.step)
            except (RunError, UsageError):
                raise
            except ValueError as e:
                if ns.tp > 1 and "TP plan" in str(e):
                    raise UsageError(f"--tp {ns.tp}: {e}") from e
                if str(e).startswith("--"):  # the pipeline's checks against the model name their option
                    raise UsageError(str(e)) from e
                raise RunError(f"planning failed: {type(e).__name__}: {e}") from e
            except Exception as e:
                raise RunError(f"planning failed: {type(e).__name__}: {e}") from e
    seconds, rss = time.perf_counter() - start, peak_rss_bytes()
    if ns.json:
        out = plan.to_json()
        out["planner"] = {"wall_s": seconds, "peak_rss_bytes": rss}
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plan, seconds, rss), end="")
    return 0


def cmd_search(ns: argparse.Namespace) -> int:
    with Progress(None, ns.quiet) as progress:
        progress.step(f"importing torch, the compiler and {ns.target}")
        import json

        from fsdp2_compile.cli.model_loading import fake_group, load_target, sized_call
        from fsdp2_compile.planner.format import format_search
        from fsdp2_compile.planner.layout import Layout
        from fsdp2_compile.planner.recipe import recipe_of, write_recipe
        from fsdp2_compile.planner.search import search

        factory = load_target(ns.target)
        call = sized_call(factory, ns.seq_len, ns.local_batch)
        base = Layout(ns.world_size, mp_policy=_mp_policy(ns.mp), attention=ns.attention, compiler=ns.compiler)
        degrees = {k: ns.pinned.get(k) for k in ("tp", "pp", "replicate")}
        with fake_group(ns.world_size):
            try:
                result = search(
                    factory,
                    ns.world_size,
                    ns.global_batch,
                    ns.hardware,
                    base=base,
                    call=call,
                    device_memory=ns.device_memory,
                    degrees=degrees,
                    progress=progress.step,
                )
            except (RunError, UsageError):
                raise
            except ValueError as e:
                raise UsageError(str(e)) from e
    if ns.emit_config:
        best = result.top[0]
        write_recipe(
            ns.emit_config,
            recipe_of(
                best.candidate.layout,
                best.candidate.local_batch,
                ns.hardware,
                best.to_json(),
                best.plan.tp_plan,
                seq_len=ns.seq_len,
                global_batch=ns.global_batch,
            ),
        )
    if ns.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(format_search(result), end="")
        if ns.emit_config:
            print(f"recipe of #1 written to {ns.emit_config}")
    return 0


# ---------------------------------------------------------------------------------------------- parser


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


def keep_gathered_arg(text: str) -> int | float:
    """`--keep-gathered`: a fraction of the gathered parameter bytes ("0.25") or a number of bytes ("16777216")."""
    try:
        value = float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        value = None
    if value is None or (isinstance(value, float) and not 0.0 <= value <= 1.0) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: use a fraction in [0, 1] (e.g. 0.25) or a number of bytes")
    return value


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
        type=_positive_bytes,
        metavar="BYTES",
        help="CompileConfig.memory_budget_bytes: gathered parameter bytes alive at once; what the "
        "prefetch window leaves keeps the last buckets gathered for backward",
    )


def _positive_bytes(text: str) -> int:
    """`--memory-budget`: a positive number of bytes."""
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: use a positive number of bytes (e.g. 268435456)")
    return int(text)


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
        type=_positive_bytes,
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
