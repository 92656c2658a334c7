"""Warm restarts: the first step of a 2-rank launch with `CompileConfig(compile_cache=True)` and an empty
`TORCHINDUCTOR_CACHE_DIR` (cold) and of the same launch again (warm, the cache filled by the cold one), at each
depth, alternated over several runs; medians.

    .venv/bin/python benchmarks/warm_restart.py [--layers 8 32] [--runs 3] [--d-model 512]
        [--modes full inductor fsdp2-compiled]

Each launch is `benchmarks/step_time.py --mode MODE --compile-cache --losses` under torchrun (one thread per rank;
`fsdp2-compiled`, the anchor, is `fully_shard` with each block compiled by `torch.compile` as torchtitan runs it,
whose relaunch reuses Inductor's own caches in the same directory),
with `TORCHINDUCTOR_CACHE_DIR` set to the run's directory: cold, Dynamo's tracing, AOTAutograd, the partition, the
passes (and, under `inductor`, Inductor's code generation and C++ compiles), the graphs stored in torch's
AOTAutograd cache and one training step; warm, Dynamo's tracing, the graphs loaded from that cache and one
training step. Each cold launch starts with an empty directory; its warm launch reuses it, as a relaunch of the
same job on the same machines does. Also printed: each warm launch's time from its process's start to the end of
its first step (imports, process group, the model built and wrapped: `torch.compile` imports Inductor when it
wraps, `shard_compile` when it first compiles), each launch's second step, the first step's excess over it (what
compiling, or loading, adds), how many warm launches only loaded (rank 0's `compile_cache.cache_events()` all
"hit"), and whether every warm launch's losses equal its cold launch's bitwise. On a 2-core machine shared with
other work, runs move by a third: compare the ratio within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def launch(mode: str, layers: int, d_model: int, cache_dir: str, port: int) -> dict:
    """One launch of step_time.py with `--compile-cache`, torch's compile cache directory set to `cache_dir`."""
    cmd = [
        TORCHRUN,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--nproc-per-node",
        "2",
        os.path.join(HERE, "step_time.py"),
        "--mode",
        mode,
        "--layers",
        str(layers),
        "--d-model",
        str(d_model),
        "--steps",
        "1",
        "--warmup",
        "1",
        *(["--compile-cache"] if mode != "fsdp2-compiled" else []),
        "--losses",
    ]
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=1800,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TORCHINDUCTOR_CACHE_DIR": cache_dir,
        },
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument(
        "--modes", nargs="+", choices=["full", "inductor", "fsdp2-compiled"], default=["full"], help="step_time.py's"
    )
    p.add_argument("--port", type=int, default=29731)
    args = p.parse_args()
    rows = []
    for layers in args.layers:
        runs = {mode: ([], []) for mode in args.modes}
        for run in range(args.runs):  # each mode cold then warm, modes alternated: all see the same drift
            for mode, (cold, warm) in runs.items():
                cache = tempfile.mkdtemp(prefix="fsdp2-warm-")
                try:
                    cold.append(launch(mode, layers, args.d_model, cache, args.port))
                    warm.append(launch(mode, layers, args.d_model, cache, args.port + 1))
                finally:
                    shutil.rmtree(cache, ignore_errors=True)
                print(
                    f"# {mode} {layers} layers run {run}: cold {cold[-1]['first_step_s']:.1f} s, warm "
                    f"{warm[-1]['first_step_s']:.1f} s (cache {cold[-1]['cache']} then {warm[-1]['cache']})",
                    file=sys.stderr,
                    flush=True,
                )
        rows += [(mode, layers, cold, warm) for mode, (cold, warm) in runs.items()]
    print(
        "| mode | layers | cold first step | warm first step | warm launch to first step done | warm / cold "
        "| second step cold / warm "
        "| first minus second step, warm / cold | warm hits | losses equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, layers, cold, warm in rows:
        med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
        spread = lambda rs: f"{min(r['first_step_s'] for r in rs):.1f}-{max(r['first_step_s'] for r in rs):.1f}"  # noqa: E731
        extra = lambda rs: statistics.median(r["first_step_s"] - r["median_s"] for r in rs)  # noqa: E731
        print(
            f"| {mode} | {layers} | {med(cold, 'first_step_s'):.1f} s ({spread(cold)}) | {med(warm, 'first_step_s'):.1f} s "
            f"({spread(warm)}) | {med(warm, 'launch_to_first_step_s'):.1f} s | "
            f"{med(warm, 'first_step_s') / med(cold, 'first_step_s'):.2f}x | "
            f"{med(cold, 'median_s'):.1f} s / {med(warm, 'median_s'):.1f} s | "
            f"{extra(warm):.1f} s / {extra(cold):.1f} s = {extra(warm) / extra(cold):.2f}x | "
            f"{sum(bool(r['cache']) and set(r['cache']) == {'hit'} for r in warm)} of {len(warm)} | "
            f"{'yes' if all(c['losses'] == w['losses'] for c, w in zip(cold, warm)) else 'NO'} |"
        )


if __name__ == "__main__":
    main()
