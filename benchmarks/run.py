"""Run the step-time benchmark for every mode on plain loopback and on a loopback shaped to 1 Gbit/s (a network
namespace with `tc ... tbf`, needs root and iproute2), then compile times at 4, 8, 16 and 32 layers, and print a
Markdown table with ratios against FSDP2 eager measured in the same run, and against the floor: max(compute alone
— one rank's share of the batch on one process, no communication — and the bytes a step moves over the shaped
link; on loopback the floor is the compute alone).

    .venv/bin/python benchmarks/run.py [--modes fsdp2 plain full inductor keep-quarter backend-route] [--steps 6]
        [--quick] [--optimizer-in-backward]
    .venv/bin/python benchmarks/run.py --compile-only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
NETNS = "fsdp2bench"


def shaped_link(rate: str) -> list[str]:
    """A network namespace whose loopback is shaped to `rate`; returns the command prefix to run inside it."""
    subprocess.run(["ip", "netns", "add", NETNS], capture_output=True)
    subprocess.run(["ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(
        ["ip", "netns", "exec", NETNS, "tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate,
         "burst", "1mb", "latency", "200ms"],
        check=True,
    )
    return ["ip", "netns", "exec", NETNS]


CRASHES: list[str] = []
"""Jobs that died and were run again (printed with the table)."""


def job(prefix: list[str], mode: str, extra: list[str], port: int, ranks: int = 2) -> dict:
    """One step_time.py run; a job whose ranks die (fully_shard's eager run on gloo aborted in 2 of 4 runs here,
    "terminate called without an active exception") is run once more on another port and recorded in CRASHES."""
    for attempt in range(2):
        cmd = [*prefix, TORCHRUN, "--master-addr", "127.0.0.1", "--master-port", str(port + 1000 * attempt),
               "--nproc-per-node", str(ranks), os.path.join(HERE, "step_time.py"), "--mode", mode, *extra]
        # one thread per rank, as torchrun gives each of several ranks: the compute-alone job too (one core, as a rank)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if not out.returncode and lines:
            return json.loads(lines[-1])
        CRASHES.append(f"{mode} ({' '.join(prefix[-1:]) or 'loopback'}): {out.stderr.strip().splitlines()[-1:]}")
        print(f"# {mode} failed (attempt {attempt + 1}): {out.stderr[-300:]}", file=sys.stderr, flush=True)
    raise RuntimeError(f"{' '.join(cmd)} failed twice:\n{out.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["fsdp2", "plain", "full", "inductor"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rate", default="1gbit", help="tc rate of the shaped link, in bits/s units tc takes (e.g. 1gbit)")
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--quick", action="store_true", help="a 2-layer d=256 model, to try the harness")
    p.add_argument("--compile-only", action="store_true", help="only the compile times at 4, 8, 16 and 32 layers")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="every mode steps an AdamW per parameter from its post-accumulate-grad hook (FSDP2's recipe)")
    args = p.parse_args()
    if args.compile_only:
        _print_compile_times(compile_times(29700))
        return
    size = ["--layers", "2", "--d-model", "256", "--vocab", "2048", "--seq", "128"] if args.quick else []
    extra = [*size, "--steps", str(args.steps), "--batch", str(args.batch)]
    extra += ["--optimizer-in-backward"] if args.optimizer_in_backward else []
    port = 29700
    compute = job([], "compute", [*size, "--steps", str(args.steps), "--batch", str(args.batch // 2)], port, ranks=1)
    print(f"# compute alone (one rank's share) median {compute['median_s']:.3f} s", file=sys.stderr, flush=True)
    results = {}
    for net, prefix in (("loopback", []), (args.rate, shaped_link(args.rate))):
        for mode in args.modes:
            port += 1
            results[(net, mode)] = r = job(prefix, mode, extra, port)
            print(f"# {net:9s} {mode:9s} median {r['median_s']:.3f} s  first step {r['first_step_s']:.1f} s  "
                  f"RSS {max(r['peak_rss_mib']):.0f} MiB", file=sys.stderr, flush=True)
    compile_s = {} if args.quick else compile_times(port + 1)

    base = {net: results[(net, "fsdp2")] for net, _ in results if (net, "fsdp2") in results}
    link_bytes_per_s = _rate_bytes_per_s(args.rate)
    print(f"compute alone (one rank's share of the batch, one process with one thread as each rank has, eager, no "
          "communication): "
          f"{compute['median_s']:.3f} s\n")
    print("| link | mode | step (median) | vs FSDP2 eager | floor | vs floor | peak RSS / rank | RSS vs eager "
          "| collectives / step | MB / step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (net, mode), r in results.items():
        eager = base.get(net)
        ratio = f"{r['median_s'] / eager['median_s']:.2f}x" if eager else "-"
        rss = max(r["peak_rss_mib"])
        rss_ratio = f"{rss / max(eager['peak_rss_mib']):.2f}x" if eager else "-"
        moved = r["bytes_per_step"] or results.get((net, "full"), {}).get("bytes_per_step") or 0
        floor = compute["median_s"] if net == "loopback" else max(compute["median_s"], moved / link_bytes_per_s)
        colls = r["collectives_per_step"] or "-"
        mb = f"{r['bytes_per_step'] / 1e6:.1f}" if r["bytes_per_step"] else "-"
        print(f"| {net} | {mode} | {r['median_s']:.3f} s | {ratio} | {floor:.3f} s | {r['median_s'] / floor:.2f}x "
              f"| {rss:.0f} MiB | {rss_ratio} | {colls} | {mb} |")
    print("\nfloor: max(compute alone, MB / step at the shaped link's rate); fsdp2 rows use our full pipeline's "
          "MB / step (FSDP2 moves the same parameter and gradient bytes); MB / step counts every collective's full "
          "buffer (gathered parameters, gradients to reduce) of one step's forward and backward graphs")
    if compile_s:
        _print_compile_times(compile_s)
    if CRASHES:
        print(f"\njobs that died and were run again: {'; '.join(CRASHES)}")
    first = next(iter(results.values()))
    print(f"\nmodel: {first['params'] / 1e6:.1f} M parameters, {first['world']} ranks, gloo; {args.steps} timed steps")


def compile_times(port: int) -> dict[int, tuple[float, float]]:
    """At 4, 8, 16 and 32 layers, the full pipeline on loopback: (first step minus a median step, seconds spent
    compiling by torch's own timers). The first includes what any first step does once (the optimizer's state
    allocated, memory touched for the first time), which grows with depth too."""
    compile_s = {}
    for layers in (4, 8, 16, 32):
        r = job([], "full", ["--layers", str(layers), "--steps", "1", "--warmup", "1"], port + layers)
        compile_s[layers] = (r["first_step_s"] - r["median_s"], r["compile_s"])
        print(f"# compile {layers} layers: first step - median {compile_s[layers][0]:.1f} s, compiling "
              f"{compile_s[layers][1]:.1f} s", file=sys.stderr, flush=True)
    return compile_s


def _print_compile_times(compile_s: dict[int, tuple[float, float]]) -> None:
    print("\n| layers | first step - median step | vs 4 layers | compiling (torch's timers, slowest rank) "
          "| vs 4 layers |\n|---|---|---|---|---|")
    (first4, compiling4) = compile_s[4]
    for layers, (first, compiling) in compile_s.items():
        print(f"| {layers} | {first:.1f} s | {first / first4:.2f}x | {compiling:.1f} s "
              f"| {compiling / compiling4:.2f}x |")


def _rate_bytes_per_s(rate: str) -> float:
    """tc's rate units ("1gbit", "100mbit", "500kbit") in bytes per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    unit = next(u for u in units if rate.endswith(u))
    return float(rate[: -len(unit)]) * units[unit] / 8


if __name__ == "__main__":
    main()
