"""The docs' figures, drawn with matplotlib (the `plots` extra) into docs/img/ as SVG; `make figures` runs it all.

    .venv/bin/python benchmarks/figures.py [--only timeline memory data-flow plan] [--out docs/img]

- step_timeline.svg: one profiled step (`exposed_comm.py`, rank 0) of `fully_shard` eager and of `shard_compile`,
  each in its own torchrun inside run.py's 1 Gbit/s namespace (root and iproute2): compute phases, the
  collectives on gloo's thread and the waits the step blocked on, on one time axis (a few minutes on 2 cores);
- memory.svg: `fsdp2-compile dump examples/llama.py:llama_tiny --world-size 4 --memory-plot memory.svg`'s chart;
- data_flow.svg: model -> capture -> the pass list, read from the code -> runtime;
- plan_check.svg: the planner's predictions over the published and measured figures of the committed
  benchmarks/plan_check.json (`.venv/bin/python benchmarks/plan_check.py --json benchmarks/plan_check.json`
  writes it, about 3 minutes; it is not rerun here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import run  # noqa: E402

SVG = {"svg.fonttype": "none", "svg.hashsalt": "fsdp2_compile", "font.size": 9}
"""Text stays text and ids do not change between runs: small SVGs that diff."""

MODEL = ["--layers", "4", "--d-model", "384", "--heads", "6", "--vocab", "4096", "--seq", "128", "--batch", "8"]
"""The timeline's GPT: small enough to compile and run in a minute per mode on 2 cores."""

COLORS = {
    "forward": "#90caf9",
    "backward": "#ffcc80",
    "optimizer": "#a5d6a7",
    "all_gather": "#43a047",
    "reduce_scatter": "#e53935",
    "all_to_all": "#e53935",
    "all_reduce": "#e53935",
    "wait": "#fdd835",
}


def save(fig, path: str) -> None:
    with plt.rc_context(SVG):
        fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    print(f"wrote {os.path.relpath(path, ROOT)} ({os.path.getsize(path) / 1024:.0f} KiB)", flush=True)


# ---------------------------------------------------------------------------------------------- step timeline


def profile_step(mode: str, prefix: list[str], port: int, out: str) -> dict:
    """`exposed_comm.py --mode MODE --json` in its own torchrun (two ranks, one thread each), the fastest of three
    profiled steps; its events."""
    path = os.path.join(out, f"{mode}.json")
    cmd = [*prefix, run.TORCHRUN, "--master-addr", "127.0.0.1", "--master-port", str(port), "--nproc-per-node", "2"]
    cmd += [os.path.join(HERE, "exposed_comm.py"), "--mode", mode, *MODEL, "--repeat", "3", "--json", path]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    with open(path) as f:
        return json.load(f)


def color_of(name: str) -> str:
    return next((c for key, c in COLORS.items() if key in name), "#9e9e9e")


def timeline(out_dir: str, rate: str = "1gbit") -> None:
    prefix = run.shaped_link(rate)
    with tempfile.TemporaryDirectory() as tmp:
        steps = {
            "fully_shard, eager hooks": profile_step("fsdp2", prefix, 29810, tmp),
            "shard_compile, the compiled schedule": profile_step("full", prefix, 29820, tmp),
        }
    draw_timeline(steps, os.path.join(out_dir, "step_timeline.svg"), rate)


def draw_timeline(steps: dict[str, dict], path: str, rate: str) -> None:
    """Two stacked timelines on one time axis from the forward's start (the barrier before it left out), three lanes
    each: compute phases, collectives, blocked waits."""
    lanes = ("phase", "collective", "wait")
    names = {"phase": "compute", "collective": "collectives\n(gloo thread)", "wait": "blocked on\ncommunication"}
    starts = {t: next(e["start_ms"] for e in step["events"] if e["name"] == "forward") for t, step in steps.items()}
    end = max(e["start_ms"] + e["ms"] - starts[t] for t, step in steps.items() for e in step["events"])
    fig, axes = plt.subplots(len(steps), 1, figsize=(10, 1.2 + 1.4 * len(steps)), sharex=True)
    for ax, (title, step) in zip(axes, steps.items()):
        events = [dict(e, start_ms=e["start_ms"] - starts[title]) for e in step["events"]]
        events = [e for e in events if e["start_ms"] + e["ms"] > 0]
        for y, lane in enumerate(reversed(lanes)):
            bars = [e for e in events if e["lane"] == lane]
            ax.broken_barh(
                [(e["start_ms"], e["ms"]) for e in bars],
                (y - 0.4, 0.8),
                facecolors=[COLORS["wait"] if lane == "wait" else color_of(e["name"]) for e in bars],
                edgecolor="none",
            )
            for e in bars if lane == "phase" else ():
                if e["ms"] > end / 10:
                    ax.text(e["start_ms"] + e["ms"] / 2, y, e["name"], ha="center", va="center")
        ax.set_yticks(range(len(lanes)), [names[lane] for lane in reversed(lanes)])
        ax.set_title(f"{title}: step {step['step_ms']:.0f} ms, blocked {step['waited_ms']:.0f} ms", loc="left")
        ax.grid(True, axis="x", color="#e0e0e0")
        ax.set_axisbelow(True)
    axes[-1].set_xlim(0, end * 1.01)
    axes[-1].set_xlabel(f"ms from the forward's start (rank 0 of two, gloo over a {rate}/s link)")
    kinds = ("forward", "backward", "optimizer", "all_gather", "reduce_scatter", "wait")
    labels = ("forward", "backward", "optimizer", "all-gather", "reduce-scatter (eager: all-reduce)", "blocked")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds]
    fig.legend(handles, labels, loc="lower center", ncols=len(kinds), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    save(fig, path)


# ---------------------------------------------------------------------------------------------- memory chart


def memory(out_dir: str) -> None:
    """The CLI's own chart, as docs/debugging.md's dump section runs it."""
    with tempfile.TemporaryDirectory() as tmp:
        cli = [sys.executable, "-m", "fsdp2_compile", "dump", "examples/llama.py:llama_tiny", "--world-size", "4"]
        cli += ["--out", tmp, "--memory-plot", "memory.svg", "-q"]
        subprocess.run(cli, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        path = shutil.copy(os.path.join(tmp, "memory.svg"), os.path.join(out_dir, "memory.svg"))
    print(f"wrote {os.path.relpath(path, ROOT)} ({os.path.getsize(path) / 1024:.0f} KiB)", flush=True)


# ---------------------------------------------------------------------------------------------- data flow


def pass_list() -> list:
    """The compiler's pass list, as the backend runs it."""
    from fsdp2_compile.compiler.pass_list import PASSES

    return list(PASSES)


BEFORE = [
    ("model", "shard(module, mesh): parameters become DTensor\nshards, read through fsdp2::unshard"),
    ("capture", "torch.compile(backend='fsdp2'): Dynamo graph,\nAOTAutograd joint graph, partition"),
]
AFTER = [
    ("checks, compile", "collectives safe, same schedule on every rank;\naot_eager or Inductor compiles the graph"),
    ("runtime", "each step runs the compiled graphs: collectives\non the group's one-thread twin (gloo) or NCCL"),
]
SCHEDULER = "schedule"
"""The pass that is the scheduler: cost-model order, marked in the figure."""


def data_flow(out_dir: str) -> None:
    draw_data_flow(os.path.join(out_dir, "data_flow.svg"))


def draw_data_flow(path: str) -> None:
    """Boxes top to bottom: model, capture, one box per pass of the pass list in order (what it provides beside it;
    the scheduler marked), checks and compile, runtime; arrows between them."""
    passes = pass_list()
    rows = [(name, text, "stage") for name, text in BEFORE]
    for p in passes:
        provides = ", ".join(sorted(map(str, getattr(p, "provides", ()))))
        text = f"provides {provides}" if provides else ""
        if p.__name__ == SCHEDULER:
            text = f"the scheduler: cost-model order; {text}"
        rows.append((p.__name__, text, "pass"))
    rows += [(name, text, "stage") for name, text in AFTER]
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(rows) + 0.2))
    ax.set_xlim(0, 10)
    ax.set_ylim(-len(rows) + 0.5, 0.5)
    ax.axis("off")
    first, last = len(BEFORE), len(BEFORE) + len(passes) - 1
    ax.add_patch(plt.Rectangle((0.1, -last - 0.45), 9.8, last - first + 0.9, fill=False, ls="--", ec="#757575", lw=0.8))
    ax.text(9.8, -first, "the pass list, in order", ha="right", va="center", color="#616161")
    for i, (name, text, kind) in enumerate(rows):
        y = -i
        face = "#e3f2fd" if kind == "stage" else "#ffe0b2" if name == SCHEDULER else "#fff3e0"
        ax.add_patch(plt.Rectangle((0.3, y - 0.3), 4.0, 0.6, fc=face, ec="#424242", lw=0.8))
        ax.text(2.3, y, name, ha="center", va="center", family="monospace" if kind == "pass" else None)
        ax.text(4.5, y, text, ha="left", va="center", color="#424242", fontsize=8)
        if i:
            ax.annotate("", (2.3, y + 0.3), (2.3, y + 0.7), arrowprops=dict(arrowstyle="->", color="#424242"))
    fig.tight_layout()
    save(fig, path)


# ---------------------------------------------------------------------------------------------- planner check

LABELS = {
    "tt8": "8B, 8 H100, eager (calibration)",
    "tt8c": "8B, 8 H100, torch.compile",
    "tt128": "8B, 128 H100, eager",
    "tt128c": "8B, 128 H100, torch.compile",
    "tt8f8": "8B, 8 H100, compile, float8",
    "tt128f8": "8B, 128 H100, compile, float8",
    "tt70": "70B, 256 H100, FSDP x TP",
    "tt405": "405B, 512 H100, Interleaved 1F1B",
    "tt405-1f1b": "405B, 512 H100, 1F1B",
    "gpt-lo": "GPT 29.5M, 2 CPU ranks, loopback",
    "gpt-1g": "GPT 29.5M, 2 CPU ranks, 1 Gbit/s",
}
"""Short names of plan_check.py's rows (a row not named here shows its key)."""


def plan(out_dir: str, source: str = os.path.join(HERE, "plan_check.json")) -> None:
    with open(source) as f:
        table = json.load(f)["table"]
    draw_plan(table, os.path.join(out_dir, "plan_check.svg"))


def draw_plan(table: list[dict], path: str) -> None:
    """Predicted over published, one row per run as in docs/planner.md's table, two panels: speed (tokens/s per rank;
    the CPU runs' step time) and peak memory; predicted = published marked, the +-15% band shaded, each point
    labelled with both figures."""
    runs = list(dict.fromkeys(r["row"] for r in table))
    speed = "tokens/s per rank (CPU GPT: step time)"
    panels = {speed: {}, "peak memory": {}}
    for r in table:
        if r["quantity"] == "tokens/s per rank":
            panels[speed][r["row"]] = (r["published"], r["predicted"], "{:,.0f}")
        elif r["quantity"] == "step time":
            panels[speed][r["row"]] = (r["published"], r["predicted"], "{:.2f} s")
        else:
            unit = "GiB" if r["published"] > 4 * 2**30 else "MiB"
            scale = 2**30 if unit == "GiB" else 2**20
            panels["peak memory"][r["row"]] = (r["published"] / scale, r["predicted"] / scale, "{:.1f} " + unit)
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.32 * len(runs) + 1.5), sharey=True)
    ys = {row: len(runs) - 1 - i for i, row in enumerate(runs)}
    for ax, (what, points) in zip(axes, panels.items()):
        ax.axvspan(0.85, 1.15, color="#eeeeee", label="within 15%")
        ax.axvline(1.0, color="#616161", lw=0.8, label="predicted = published")
        for row, (published, predicted, fmt) in points.items():
            ratio = predicted / published
            ax.plot([ratio], [ys[row]], "o", ms=4, color="#1565c0" if 0.85 <= ratio <= 1.15 else "#c62828")
            text = f"{fmt.format(predicted)} / {fmt.format(published)}"
            ax.annotate(text, (ratio, ys[row]), textcoords="offset points", xytext=(6, -3), fontsize=7)
        ax.set_xlim(0.7, 1.45)
        ax.set_xlabel("predicted / published or measured")
        ax.set_title(what, loc="left")
        ax.grid(True, axis="x", color="#eeeeee")
    axes[0].set_yticks(list(ys.values()), [LABELS.get(row, row) for row in ys])
    axes[0].set_ylim(-0.7, len(runs) - 0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncols=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    save(fig, path)


FIGURES = {"timeline": timeline, "memory": memory, "data-flow": data_flow, "plan": plan}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=list(FIGURES), default=list(FIGURES))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name in args.only:
        FIGURES[name](args.out)


if __name__ == "__main__":
    main()
