"""The dropless MoE of tests/dropless_moe_workers.py (torchtitan's recipe) on 4 gloo ranks (dp_shard_mod_ep 2 x
ep 2), STEPS AdamW steps per mode: what is compiled and how often, and the step time against `fully_shard`.

    .venv/bin/python benchmarks/dropless_moe.py [--steps 20]   # TORCH_LOGS=recompiles adds Dynamo's reasons

Modes: fsdp2 (`fully_shard`, eager), graph-breaks (`shard_compile` under Dynamo's defaults: each `.tolist()` of the
token counts breaks the graph), unbacked (`shard_compile` with `torch._dynamo.config.patch(capture_scalar_outputs=
True)` around the steps: the counts become unbacked sizes inside one graph). Prints one line per mode (rank 0):
graphs and recompiles after the first step and after the last, Dynamo's graph breaks, the unbacked sizes read
from data in the compiled graphs, whether losses and parameters equal `fully_shard`'s bitwise on every rank, and
the median step time after two warm-up steps (the slowest rank's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from dropless_moe_workers import MODES, compile_modes  # noqa: E402
from harness import run_ranks  # noqa: E402

WARMUP = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    ranks = run_ranks(compile_modes, 4, args.steps, timeout=1800)
    base = [r["fsdp2"] for r in ranks]
    for mode in MODES:
        runs = [r[mode] for r in ranks]
        step = statistics.median(max(r["times"][i] for r in runs) for i in range(WARMUP, args.steps))
        line = f"{mode:13s} step {step * 1e3:7.1f} ms (median of {args.steps - WARMUP}, slowest rank)"
        if mode != "fsdp2":
            first, last = runs[0]["compile_counts"]
            bitwise = all(
                r["losses"] == b["losses"] and all(torch.equal(p, b["params"][n]) for n, p in r["params"].items())
                for r, b in zip(runs, base)
            )
            line += (
                f" | after step 1: {first.forward} forward + {first.backward} backward graphs, {first.frames} frames,"
                f" {first.recompiles} recompiles | after step {args.steps}: {last.forward} + {last.backward} graphs,"
                f" {last.recompiles} recompiles | graph breaks {runs[0]['graph_breaks']}"
                f" | unbacked sizes {runs[0]['unbacked']} | bitwise vs fsdp2 {bitwise}"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
