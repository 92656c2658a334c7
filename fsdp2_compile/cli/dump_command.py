"""`fsdp2-compile dump`: shard and compile a model under the fake process group, run one step, write the graphs
after every pass and the simulated step to --out."""

from __future__ import annotations

import argparse
import os

from fsdp2_compile.cli.arguments import mesh_words, mp_policy
from fsdp2_compile.cli.model_loading import RunError, UsageError
from fsdp2_compile.cli.progress import Progress

__all__ = ["cmd_dump"]


def cmd_dump(ns: argparse.Namespace) -> int:
    with Progress(4, ns.quiet) as progress:
        progress.step(f"importing torch, the compiler and {ns.target}")
        from fsdp2_compile.api import shard_compile
        from fsdp2_compile.cli.model_loading import fake_group, load_target, sized_call
        from fsdp2_compile.compiler.graph_records import clear_compiled_graphs, compiled_graphs
        from fsdp2_compile.config import CompileConfig
        from fsdp2_compile.core.hardware import PROFILES
        from fsdp2_compile.debug.dump import write_dump
        from fsdp2_compile.planner.block_sharding import shard_blocks
        from fsdp2_compile.planner.reduced_depth import block_list
        from fsdp2_compile.planner.tensor_parallel import apply_tp, plan_meshes, plan_text, tp_plan_for

        factory = load_target(ns.target)
        call = sized_call(factory, ns.seq_len, ns.local_batch)
        hardware = ns.hardware or "cpu-gloo-loopback"
        mp = mp_policy(ns.mp)
        reshard = False if ns.no_reshard else None  # None: FSDP2's default (the root keeps its parameters)
        where = mesh_words(ns.world_size, ns.replicate, ns.tp)
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
