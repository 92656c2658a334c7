"""Where a first step's compile time goes, in one process (fake process group: no peers, no communication).

    .venv/bin/python benchmarks/compile_profile.py [--layers 4 32] [--d-model 128] [--gc-deferral both]

For each depth, in a fresh interpreter: the GPT of `examples/gpt.py` (blocks sharded, then the root, with
`shard_compile`), one forward and backward on a tiny batch; prints wall and CPU seconds of that first step, the
time Python's garbage collector took in it (full collections counted apart), and torch's own compile phases
(Dynamo's `compile_times()`: Dynamo's tracing, its nested-region reuse check and stamp-out, guards,
AOTAutograd's metadata pass and joint trace, the lazy backward compile). The step itself is tiny, so the first
step is nearly all compile time. Compare depths within one run: on a 2-core machine the figures move by a third
between runs. `--gc-deferral both` runs each depth with `CompileConfig(defer_full_gc=True)` and `False`,
alternated, to show what deferring full collections while the backend compiles buys.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

PHASES = (
    "bytecode_tracing",
    "invoke_subgraph_reuse_lookup",
    "invoke_subgraph_reuse_stamp_out",
    "build_guards",
    "aot_collect_metadata",
    "aot_trace_joint_graph",
    "OutputGraph.call_user_compiler",
    "backward._backward_impl",
)


def _one(layers: int, d_model: int, defer_full_gc: bool = True) -> dict:
    """The first step of a `layers`-deep GPT in this process."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "examples"))
    import torch
    from gpt import GPT, GPTConfig
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2_compile as fc
    from fsdp2_compile._torch_private import compile_times, fake_process_group

    fake_process_group(rank=0, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=1024, block_size=64, n_layer=layers, n_head=4, d_model=d_model))
    for block in model.blocks:
        fc.shard(block, mesh)
    fc.shard_compile(model, mesh, compile_config=fc.CompileConfig(defer_full_gc=defer_full_gc))
    tokens = torch.randint(0, 1024, (2, 64))

    collected = {"s": 0.0, "full": 0, "started": 0.0}

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            collected["started"] = time.perf_counter()
        else:
            collected["s"] += time.perf_counter() - collected["started"]
            collected["full"] += info["generation"] == 2

    gc.callbacks.append(timed)
    wall, cpu = time.perf_counter(), time.process_time()
    model(tokens).float().mean().backward()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    gc.callbacks.remove(timed)
    names, seconds = compile_times(repr="csv", aggregate=True)
    measured = dict(zip(names, seconds))
    phases = {name: float(measured.get(name, 0.0)) for name in PHASES}
    return dict(
        layers=layers,
        defer_full_gc=defer_full_gc,
        wall_s=wall,
        cpu_s=cpu,
        gc_s=collected["s"],
        full_collections=collected["full"],
        phases=phases,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[4, 32])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument(
        "--gc-deferral",
        choices=("on", "off", "both"),
        default="on",
        help="CompileConfig.defer_full_gc for each run; both: on and off alternated per depth",
    )
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # worker: one depth, JSON on stdout
    p.add_argument("--defer", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(_one(args.one, args.d_model, bool(args.defer))))
        return
    settings = {"on": [1], "off": [0], "both": [1, 0]}[args.gc_deferral]
    rows = []
    for layers in args.layers:
        for defer in settings:
            out = subprocess.run(
                [sys.executable, __file__, "--one", str(layers), "--d-model", str(args.d_model), "--defer", str(defer)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    print("| layers | GC deferral | first step (wall) | CPU | GC (full collections) | " + " | ".join(PHASES) + " |")
    print("|---" * (5 + len(PHASES)) + "|")
    for r in rows:
        print(
            f"| {r['layers']} | {'on' if r['defer_full_gc'] else 'off'} | {r['wall_s']:.2f} s | {r['cpu_s']:.2f} s "
            f"| {r['gc_s']:.2f} s ({r['full_collections']}) | "
            + " | ".join(f"{r['phases'][k]:.2f}" for k in PHASES)
            + " |"
        )
    base = rows[0]
    for r in rows[1:]:
        if r["defer_full_gc"] == base["defer_full_gc"] and r["layers"] != base["layers"]:
            print(
                f"\n{r['layers']} / {base['layers']} layers: wall {r['wall_s'] / base['wall_s']:.2f}x, "
                f"CPU {r['cpu_s'] / base['cpu_s']:.2f}x"
            )


if __name__ == "__main__":
    main()
