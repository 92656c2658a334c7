"""`fsdp2-compile plan`: per-rank memory, bytes on the wire and step time of a model at N ranks, or with --search
the best layouts for a global batch on a device."""

from __future__ import annotations

import argparse
import time

from fsdp2_compile.cli.arguments import mp_policy
from fsdp2_compile.cli.footprint import peak_rss_bytes
from fsdp2_compile.cli.model_loading import RunError, UsageError
from fsdp2_compile.cli.progress import Progress

__all__ = ["cmd_plan", "cmd_search"]


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
                mp_policy=mp_policy(ns.mp),
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
        base = Layout(ns.world_size, mp_policy=mp_policy(ns.mp), attention=ns.attention, compiler=ns.compiler)
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
