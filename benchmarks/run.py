"""Run the step-time benchmark for every mode on plain loopback and on a loopback shaped to 1 Gbit/s (a network
namespace with `tc ... tbf`, needs root and iproute2), then compile times at 4, 8, 16 and 32 layers, and print a
Markdown table with ratios against FSDP2 eager measured in the same run, and against the floor: max(compute alone
— one rank's share of the batch on one process, no communication — and the bytes a step moves over the shaped
link; on loopback the floor is the compute alone).

    .venv/bin/python benchmarks/run.py [--modes fsdp2 plain full inductor keep-quarter backend-route] [--steps 6]
        [--quick] [--optimizer-in-backward] [--json results.json]
    .venv/bin/python benchmarks/run.py --compile-only [--json results.json]
    .venv/bin/python benchmarks/run.py --markdown benchmarks/results.json   # render a results file, run nothing
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
NETNS = "fsdp2bench"


def shaped_link(rate: str) -> list[str]:
    """A network namespace whose loopback is shaped to `rate`; returns the command prefix to run inside it."""
    subprocess.run(["ip", "netns", "add", NETNS], capture_output=True)
    subprocess.run(["ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            NETNS,
            "tc",
            "qdisc",
            "replace",
            "dev",
            "lo",
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "1mb",
            "latency",
            "200ms",
        ],
        check=True,
    )
    return ["ip", "netns", "exec", NETNS]


CRASHES: list[str] = []
"""Jobs that died and were run again (printed with the table)."""


def job(prefix: list[str], mode: str, extra: list[str], port: int, ranks: int = 2) -> dict:
    """One step_time.py run; a job whose ranks die (fully_shard's eager run on gloo aborted in 2 of 4 runs here,
    "terminate called without an active exception") is run once more on another port and recorded in CRASHES."""
    for attempt in range(2):
        cmd = [
            *prefix,
            TORCHRUN,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port + 1000 * attempt),
            "--nproc-per-node",
            str(ranks),
            os.path.join(HERE, "step_time.py"),
            "--mode",
            mode,
            *extra,
        ]
        # one thread per rank, as torchrun gives each of several ranks: the compute-alone job too (one core, as a rank)
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
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
    p.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        help="every mode steps an AdamW per parameter from its post-accumulate-grad hook (FSDP2's recipe)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results to PATH (what --markdown reads)")
    p.add_argument(
        "--markdown",
        metavar="PATH",
        help="run nothing: print the Markdown table of the results JSON at PATH (written by --json)",
    )
    args = p.parse_args()
    if args.markdown:
        with open(args.markdown) as f:
            print(render_markdown(json.load(f)))
        return
    report = dict(
        command=" ".join([".venv/bin/python", "benchmarks/run.py", *sys.argv[1:]]),
        commit=_commit(),
        date=time.strftime("%Y-%m-%d"),
        rate=args.rate,
        steps=args.steps,
        compute_s=None,
        rows=[],
        compile=[],
        crashes=CRASHES,
    )
    if args.compile_only:
        report["compile"] = compile_times(29700)
        return _finish(report, args.json)
    size = ["--layers", "2", "--d-model", "256", "--vocab", "2048", "--seq", "128"] if args.quick else []
    extra = [*size, "--steps", str(args.steps), "--batch", str(args.batch)]
    extra += ["--optimizer-in-backward"] if args.optimizer_in_backward else []
    port = 29700
    compute = job([], "compute", [*size, "--steps", str(args.steps), "--batch", str(args.batch // 2)], port, ranks=1)
    report["compute_s"] = compute["median_s"]
    print(f"# compute alone (one rank's share) median {compute['median_s']:.3f} s", file=sys.stderr, flush=True)
    for net, prefix in (("loopback", []), (args.rate, shaped_link(args.rate))):
        for mode in args.modes:
            port += 1
            r = job(prefix, mode, extra, port)
            report["rows"].append(
                dict(
                    link=net,
                    mode=mode,
                    median_s=r["median_s"],
                    peak_rss_mib=max(r["peak_rss_mib"]),
                    collectives_per_step=r["collectives_per_step"],
                    bytes_per_step=r["bytes_per_step"],
                )
            )
            report.update(params=r["params"], world=r["world"])
            print(
                f"# {net:9s} {mode:9s} median {r['median_s']:.3f} s  first step {r['first_step_s']:.1f} s  "
                f"RSS {max(r['peak_rss_mib']):.0f} MiB",
                file=sys.stderr,
                flush=True,
            )
    report["compile"] = [] if args.quick else compile_times(port + 1)
    _finish(report, args.json)


def _finish(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    print(render_markdown(report))


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    return out.stdout.strip() or "unknown"


def render_markdown(report: dict, compile_table: bool = True) -> str:
    """The results of one run as Markdown: a caption naming the command and the commit (no date: the commit dates
    it), the step table with ratios against FSDP2 eager and against the floor, and the compile times (unless
    `compile_table` is False)."""
    lines = [f"Measured at {report['commit']} with `{report['command']}`"]
    if report.get("params"):
        lines[0] += (
            f": GPT of {report['params'] / 1e6:.1f} M parameters, {report['world']} ranks on gloo, median of "
            f"{report['steps']} steps; compute alone (one rank's share of the batch, one thread, no "
            f"communication) {report['compute_s']:.3f} s."
        )
    rows = {(r["link"], r["mode"]): r for r in report["rows"]}
    if rows:
        lines += [
            "",
            "| link | mode | step (median) | vs FSDP2 eager | floor | vs floor | peak RSS / rank "
            "| RSS vs eager | collectives / step | MB / step |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
    link_bytes_per_s = _rate_bytes_per_s(report["rate"])
    for (net, mode), r in rows.items():
        eager = rows.get((net, "fsdp2"))
        ratio = f"{r['median_s'] / eager['median_s']:.2f}x" if eager else "-"
        rss = r["peak_rss_mib"]
        rss_ratio = f"{rss / eager['peak_rss_mib']:.2f}x" if eager else "-"
        moved = r["bytes_per_step"] or rows.get((net, "full"), {}).get("bytes_per_step") or 0
        compute = report["compute_s"]
        floor = compute if net == "loopback" else max(compute, moved / link_bytes_per_s)
        colls = r["collectives_per_step"] or "-"
        mb = f"{r['bytes_per_step'] / 1e6:.1f}" if r["bytes_per_step"] else "-"
        lines.append(
            f"| {net} | {mode} | {r['median_s']:.3f} s | {ratio} | {floor:.3f} s | "
            f"{r['median_s'] / floor:.2f}x | {rss:.0f} MiB | {rss_ratio} | {colls} | {mb} |"
        )
    if rows:
        lines += [
            "",
            "floor: max(compute alone, MB / step at the shaped link's rate); fsdp2 rows use the full "
            "pipeline's MB / step (FSDP2 moves the same parameter and gradient bytes).",
        ]
    if compile_table and report["compile"]:
        first4, compiling4 = report["compile"][0]["first_minus_median_s"], report["compile"][0]["compiling_s"]
        lines += [
            "",
            "| layers | first step - median step | vs 4 layers | compiling (torch's timers, slowest rank) "
            "| vs 4 layers |",
            "|---|---|---|---|---|",
        ]
        for c in report["compile"]:
            lines.append(
                f"| {c['layers']} | {c['first_minus_median_s']:.1f} s | "
                f"{c['first_minus_median_s'] / first4:.2f}x | {c['compiling_s']:.1f} s | "
                f"{c['compiling_s'] / compiling4:.2f}x |"
            )
    if report.get("crashes"):
        lines += ["", f"jobs that died and were run again: {'; '.join(report['crashes'])}"]
    return "\n".join(lines)


def compile_times(port: int) -> list[dict]:
    """At 4, 8, 16 and 32 layers, the full pipeline on loopback: the first step minus a median step, and the
    seconds spent compiling by torch's own timers. The first includes what any first step does once (the
    optimizer's state allocated, memory touched for the first time), which grows with depth too."""
    compile_s = []
    for layers in (4, 8, 16, 32):
        r = job([], "full", ["--layers", str(layers), "--steps", "1", "--warmup", "1"], port + layers)
        compile_s.append(
            dict(layers=layers, first_minus_median_s=r["first_step_s"] - r["median_s"], compiling_s=r["compile_s"])
        )
        print(
            f"# compile {layers} layers: first step - median {compile_s[-1]['first_minus_median_s']:.1f} s, "
            f"compiling {r['compile_s']:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    return compile_s


def _rate_bytes_per_s(rate: str) -> float:
    """tc's rate units ("1gbit", "100mbit", "500kbit") in bytes per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    unit = next(u for u in units if rate.endswith(u))
    return float(rate[: -len(unit)]) * units[unit] / 8


if __name__ == "__main__":
    main()
