"""Warm restarts: the first step of a 2-rank launch with an empty `CompileConfig.cache_dir` (cold) and of the same
launch again (warm, the cache filled by the cold one), at each depth, alternated over several runs; medians.

    .venv/bin/python benchmarks/warm_restart.py [--layers 8 32] [--runs 3] [--d-model 512] [--mode full|inductor]
        [--fresh-inductor-cache]

Each launch is `benchmarks/step_time.py --mode MODE --cache-dir DIR --losses` under torchrun (one thread per rank),
whose first step is, cold, Dynamo's tracing, AOTAutograd, the partition, the passes (and, under `inductor`,
Inductor's code generation and C++ compiles) and one training step (and the compile saved), warm, the saved compile
loaded and one training step. Each cold launch starts with an empty `cache_dir` and an empty Inductor cache
(`TORCHINDUCTOR_CACHE_DIR`); its warm launch reuses both, as a relaunch of the same job on the same machines does
(`--fresh-inductor-cache`: the warm launch gets an empty Inductor cache, as a relaunch on other machines that
carries `cache_dir` only). Also printed: each launch's second step, the first step's excess over it (what
compiling, or loading, adds), and whether every warm launch's losses equal its cold launch's bitwise. On a 2-core
machine shared with other work, runs move by a third: compare the ratio within a run.
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


def launch(mode: str, layers: int, d_model: int, cache_dir: str, inductor_cache: str, port: int) -> dict:
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
        "--cache-dir",
        cache_dir,
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
            "TORCHINDUCTOR_CACHE_DIR": inductor_cache,
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
    p.add_argument("--mode", choices=["full", "inductor"], default="full", help="step_time.py's mode")
    p.add_argument(
        "--fresh-inductor-cache", action="store_true", help="the warm launch starts with an empty Inductor cache"
    )
    p.add_argument("--port", type=int, default=29731)
    args = p.parse_args()
    rows = []
    for layers in args.layers:
        cold, warm = [], []
        for run in range(args.runs):  # cold, warm, cold, warm, ...: both see the same drift of the machine
            cache = tempfile.mkdtemp(prefix="fsdp2-warm-")
            try:
                inductor = os.path.join(cache, "inductor")
                cold.append(launch(args.mode, layers, args.d_model, cache, inductor, args.port))
                if args.fresh_inductor_cache:
                    inductor = os.path.join(cache, "inductor-warm")
                warm.append(launch(args.mode, layers, args.d_model, cache, inductor, args.port + 1))
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            print(
                f"# {layers} layers run {run}: cold {cold[-1]['first_step_s']:.1f} s, warm {warm[-1]['first_step_s']:.1f} s "
                f"(cache {cold[-1]['cache']} then {warm[-1]['cache']})",
                file=sys.stderr,
                flush=True,
            )
        rows.append((layers, cold, warm))
    print(
        "| layers | cold first step | warm first step | warm / cold | second step cold / warm "
        "| first minus second step, warm / cold | warm hits | losses equal |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for layers, cold, warm in rows:
        med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
        spread = lambda rs: f"{min(r['first_step_s'] for r in rs):.1f}-{max(r['first_step_s'] for r in rs):.1f}"  # noqa: E731
        extra = lambda rs: statistics.median(r["first_step_s"] - r["median_s"] for r in rs)  # noqa: E731
        print(
            f"| {layers} | {med(cold, 'first_step_s'):.1f} s ({spread(cold)}) | {med(warm, 'first_step_s'):.1f} s "
            f"({spread(warm)}) | {med(warm, 'first_step_s') / med(cold, 'first_step_s'):.2f}x | "
            f"{med(cold, 'median_s'):.1f} s / {med(warm, 'median_s'):.1f} s | "
            f"{extra(warm):.1f} s / {extra(cold):.1f} s = {extra(warm) / extra(cold):.2f}x | "
            f"{sum(r['cache'] == ['hit'] for r in warm)} of {len(warm)} | "
            f"{'yes' if all(c['losses'] == w['losses'] for c, w in zip(cold, warm)) else 'NO'} |"
        )


if __name__ == "__main__":
    main()
