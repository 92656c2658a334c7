"""Debugging artefacts of the graphs the fsdp2 backend compiled (`report.compiled_graphs()`), written to a folder:

    forward/00_captured.txt ...   the graph after every pass; collective / wait / cast lines annotated with their
                                  parameters and bucket (provenance)
    forward/graph.dot, .svg       the final graph, all-gathers, reduce-scatters, all-reduces (HSDP), waits and
                                  casts highlighted
    trace.json                    the simulated schedule (cost_model.simulate) as a Perfetto / Chrome trace
    memory.csv, memory.png        estimated live bytes over the step (the plot needs matplotlib, the `plots` extra)
    summary.txt                   the table `summarize` returns (also printed by `fsdp2-compile dump`)

`dump_from_env(record)` (called by the backend for every compiled graph) writes them to `$FSDP2_COMPILE_DUMP/rank<r>`.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import logging
from collections import Counter
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

import torch
from torch import fx

from .cost_model import PROFILES, HardwareProfile, Timeline, simulate
from .ir import BUCKET, COLLECTIVE_KINDS, PARAMS, WAIT, Role, collective_kind
from .report import DUMP_ENV, GraphRecord, NodeFacts, Snapshot, collective, compiled_graphs, saved_bytes

logger = logging.getLogger(__name__)

__all__ = ["DUMP_ENV", "annotate", "dump_from_env", "saved_bytes", "size_text", "summarize", "write_dump"]

_CAST = torch.ops.prims.convert_element_type.default
_NODE_NAME = re.compile(r"^\s*%(\w+) : ")
_NODE_LINE = re.compile(r"^\s*(?:%\w+ : |return\b)", re.MULTILINE)  # one per node, the output node included
_KINDS = set(COLLECTIVE_KINDS.values())
_COUNTED = {*_KINDS, Role.WAIT}
_NOT_LOWERED = {"unshard", "reduce_grad"}
_ANNOTATED = {*_COUNTED, "cast", *_NOT_LOWERED, "stash_grad", "add_pending_grad"}

COLOURS = {  # category -> (fill, stroke)
    "all_gather": ("#8fd18f", "#2e7d32"),
    "reduce_scatter": ("#f6a38e", "#c62828"),
    "all_reduce": ("#ce93d8", "#6a1b9a"),
    "wait": ("#ffe082", "#f57f17"),
    "cast": ("#90caf9", "#1565c0"),
    "placeholder": ("#eeeeee", "#9e9e9e"),
    "other": ("#ffffff", "#bdbdbd"),
}
_LEGEND = ("all_gather", "reduce_scatter", "all_reduce", "wait", "cast", "placeholder", "other")


# ---------------------------------------------------------------------------------------------- graph text


def _short_target(target: str) -> str:
    """'torch.ops._c10d_functional.wait_tensor.default' -> 'wait_tensor'."""
    parts = target.split(".")
    return parts[-2] if len(parts) >= 2 and parts[-1] in ("default", "Tensor", "dim", "int", "Scalar") else parts[-1]


def _node_category(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "placeholder"
    kind = collective_kind(node)
    if kind is not None:
        return str(kind)
    if node.target is WAIT:
        return "wait"
    if node.target is _CAST:
        return "cast"
    return "other"


def _note(facts: NodeFacts) -> str:
    params = facts.params
    shown = ", ".join(params[:6]) + (f", ... ({len(params)} params)" if len(params) > 6 else "")
    extra = "  (not lowered yet)" if facts.role in _NOT_LOWERED else f" role={facts.role}"
    return f"  # bucket={facts.bucket!r} params=[{shown}]{extra}"


def annotate(snapshot: Snapshot) -> str:
    """The snapshot's text with every collective, wait, cast and fsdp2 op line followed by
    `# bucket=... params=[...] role=...`, from the snapshot's node facts."""
    out = []
    for raw in snapshot.text.splitlines():
        m = _NODE_NAME.match(raw)
        facts = snapshot.nodes.get(m.group(1)) if m else None
        shown = facts is not None and facts.params and facts.role in _ANNOTATED
        out.append(raw + _note(facts) if shown else raw)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- summary


@dataclass
class PassStats:
    name: str
    nodes: int
    counts: Counter = field(default_factory=Counter)
    """Collectives by kind ("all_gather", "reduce_scatter", "all_reduce") and "wait"."""
    bytes_by_dtype: Counter = field(default_factory=Counter)
    """Bytes of the full (padded) buffers collectives move, by (kind, dtype name)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pass_stats(record: GraphRecord) -> list[PassStats]:
    """Per pass: node count (from the text), collectives by kind and their bytes by dtype (from the facts)."""
    stats = []
    for snap in record.snapshots:
        s = PassStats(snap.name, len(_NODE_LINE.findall(snap.text)))
        for facts in snap.nodes.values():
            if facts.role in _COUNTED:
                s.counts[facts.role] += 1
            if facts.role in _KINDS:
                s.bytes_by_dtype[(facts.role, _dtype_name(facts.dtype))] += facts.nbytes
        stats.append(s)
    return stats


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _labels(records: list[GraphRecord]) -> list[str]:
    seen: Counter = Counter()
    labels = []
    for r in records:
        labels.append(r.kind if seen[r.kind] == 0 else f"{r.kind}_{seen[r.kind]}")
        seen[r.kind] += 1
    return labels


def _profiles(records: list[GraphRecord], profile: HardwareProfile | None) -> list[HardwareProfile]:
    """Each graph's profile: the one its scheduler used, else `profile`, else the loopback one."""
    fallback = profile or PROFILES["cpu-gloo-loopback"]
    return [r.profile or fallback for r in records]


def _timelines(records: list[GraphRecord], profiles: list[HardwareProfile]) -> list[Timeline]:
    """Each final graph played with its scheduler's profile."""
    return [simulate(r.gm, p) for r, p in zip(records, profiles)]


def summarize(records: list[GraphRecord], profile: HardwareProfile | None = None) -> str:
    """The summary table: per graph and pass, per bucket, peak memory and exposed communication. Each graph is
    simulated with the profile its scheduler used (`profile` for records that do not name one)."""
    profiles = _profiles(records, profile)
    out = [f"cost model profile: {p.name} ({p.source})" for p in dict.fromkeys(profiles)] + [""]
    timelines = _timelines(records, profiles)
    for label, record, tl in zip(_labels(records), records, timelines):
        out.append(f"== {label} graph ({len(record.gm.graph.nodes)} nodes)")
        out.append(f"  {'pass':<22}{'nodes':>7}{'all_gather':>12}{'reduce_scat':>12}{'all_reduce':>12}{'wait':>6}"
                   "  bytes by dtype")
        for s in pass_stats(record):
            parts = [f"{k[0]} {k[1]} {_mib(v)}" for k, v in sorted(s.bytes_by_dtype.items())]
            out.append(
                f"  {s.name:<22}{s.nodes:>7}{s.counts['all_gather']:>12}{s.counts['reduce_scatter']:>12}"
                f"{s.counts['all_reduce']:>12}{s.counts['wait']:>6}  {'; '.join(parts) or '-'}"
            )
        out.append(f"  {'bucket':<22}{'collective':<16}{'dtype':<10}{'bytes':>16}  params")
        for node in record.gm.graph.nodes:
            c = collective(node)
            if c is not None:
                bucket = node.meta.get(BUCKET, "?") or "<root>"
                out.append(f"  {bucket:<22}{c.kind:<16}{_dtype_name(c.dtype):<10}{_mib(c.nbytes):>16}  {len(c.params)}")
        out.append(
            f"  estimate: step {tl.total_s * 1e3:.3f} ms, compute {tl.compute_s * 1e3:.3f} ms, "
            f"communication {tl.comm_s * 1e3:.3f} ms, exposed communication {tl.exposed_comm_s * 1e3:.3f} ms, "
            f"peak intermediate memory {_mib(tl.peak_bytes)}"
        )
        out.append("")
    total = sum(t.total_s for t in timelines)
    exposed = sum(t.exposed_comm_s for t in timelines)
    out.append(f"step estimate (all graphs): {total * 1e3:.3f} ms, exposed communication {exposed * 1e3:.3f} ms, "
               f"peak memory {_mib(_memory_curve(records, timelines)[1])}")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- DOT and SVG


def _node_label(node: fx.Node) -> str:
    target = node.target if node.op != "call_function" else _short_target(str(node.target))
    label = f"{node.name}: {target}" if node.op == "call_function" else f"{node.name} ({node.op})"
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        label += f" {_dtype_name(value.dtype)}{list(value.shape)}"
    if PARAMS in node.meta and _node_category(node) != "other":
        params = node.meta[PARAMS]
        label += f"  [{node.meta.get(BUCKET) or '<root>'}: {len(params)} param{'s' * (len(params) != 1)}]"
    return label


def write_dot(gm: fx.GraphModule, path: str) -> None:
    """The graph as Graphviz DOT text, collective / wait / cast nodes filled with their colour, plus a legend."""
    out = ["digraph G {", "  rankdir=TB; node [shape=box, fontname=monospace, fontsize=9, style=filled];"]
    out.append("  subgraph cluster_legend { label=legend;")
    for category in _LEGEND:
        fill, stroke = COLOURS[category]
        out.append(f'    legend_{category} [label="{category}", fillcolor="{fill}", color="{stroke}"];')
    out.append("  }")
    for node in gm.graph.nodes:
        fill, stroke = COLOURS[_node_category(node)]
        label = _node_label(node).replace("\\", "\\\\").replace('"', '\\"')
        out.append(f'  "{node.name}" [label="{label}", fillcolor="{fill}", color="{stroke}"];')
    for node in gm.graph.nodes:
        for producer in node.all_input_nodes:
            out.append(f'  "{producer.name}" -> "{node.name}";')
    out.append("}")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def write_svg(gm: fx.GraphModule, path: str, title: str = "") -> None:
    """The graph laid out one node per row in execution order; collectives, waits and casts are coloured and their
    data edges drawn (other edges are omitted to keep graphs of hundreds of nodes readable)."""
    nodes = list(gm.graph.nodes)
    row, top, left, box_w = 16, 70, 10, 560
    index = {n: i for i, n in enumerate(nodes)}
    width, height = box_w + 320, top + row * len(nodes) + 20
    out = [
        (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
         'font-size="10">'),
        f'<text x="{left}" y="16" font-size="13">{escape(title)} ({len(nodes)} nodes, execution order)</text>',
    ]
    for i, category in enumerate(_LEGEND):
        fill, stroke = COLOURS[category]
        x = left + i * 120
        out.append(f'<rect x="{x}" y="28" width="12" height="12" fill="{fill}" stroke="{stroke}"/>')
        out.append(f'<text x="{x + 16}" y="38">{category}</text>')
    out.append(f'<text x="{left}" y="56" fill="#555">arcs on the right: data edges into and out of '
               "collectives, waits and casts</text>")
    for node in nodes:
        y = top + index[node] * row
        category = _node_category(node)
        fill, stroke = COLOURS[category]
        weight = ' font-weight="bold"' if category not in ("other", "placeholder") else ""
        out.append(f'<rect x="{left}" y="{y}" width="{box_w}" height="{row - 3}" fill="{fill}" stroke="{stroke}"/>')
        out.append(f'<text x="{left + 4}" y="{y + 10}"{weight}>{escape(_node_label(node)[:95])}</text>')
    for node in nodes:
        if _node_category(node) in ("other", "placeholder"):
            continue
        edges = [(p, node) for p in node.all_input_nodes] + [(node, u) for u in node.users]
        stroke = COLOURS[_node_category(node)][1]
        for a, b in edges:
            if a not in index or b not in index:
                continue
            y1, y2 = top + index[a] * row + 6, top + index[b] * row + 6
            bend = left + box_w + 10 + min(300, abs(y2 - y1) // 6)
            out.append(f'<path d="M{left + box_w} {y1} C{bend} {y1} {bend} {y2} {left + box_w} {y2}" '
                       f'fill="none" stroke="{stroke}" stroke-width="1" opacity="0.7"/>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


# ---------------------------------------------------------------------------------------------- trace and memory


def trace_events(records: list[GraphRecord], timelines: list[Timeline]) -> dict:
    """Chrome / Perfetto trace: one process per graph, a compute and a communication thread, graphs back to back."""
    events, offset = [], 0.0
    for pid, (label, tl) in enumerate(zip(_labels(records), timelines), start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"{label} graph"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid, lane in ((1, "compute"), (2, "communication")):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
        for e in tl.events:
            tid = 2 if e.lane == "comm" else 1
            events.append({
                "ph": "X", "pid": pid, "tid": tid, "cat": e.lane,
                "name": e.name if e.lane != "wait" else f"wait ({e.name})",
                "ts": (offset + e.start_s) * 1e6, "dur": e.duration_s * 1e6,
            })
        offset += tl.total_s
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _memory_curve(records: list[GraphRecord], timelines: list[Timeline]) -> tuple[list[tuple[float, int]], int]:
    """(time, bytes) over the step: graphs back to back; after a forward graph its outputs stay alive."""
    points, offset, carried = [(0.0, 0)], 0.0, 0
    for record, tl in zip(records, timelines):
        points.extend((offset + t, carried + b) for t, b in tl.memory)
        offset += tl.total_s
        if record.kind == "forward":
            carried += saved_bytes(record.gm)
        elif record.kind == "backward":
            carried = 0
        points.append((offset, carried))
    return points, max(b for _, b in points)


def _graph_spans(records: list[GraphRecord], timelines: list[Timeline]) -> list[tuple[str, float, float]]:
    """(label, start, end) of each graph on the step's time axis (graphs back to back)."""
    ends = list(itertools.accumulate(t.total_s for t in timelines))
    return [(label, end - t.total_s, end) for label, t, end in zip(_labels(records), timelines, ends)]


def _unit(n: float) -> tuple[str, int]:
    return next(((u, k) for u, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if abs(n) >= k), ("B", 1))


def size_text(n: float) -> str:
    """Bytes in the unit that fits: '512 B', '3.25 KiB', '1.50 MiB', '2.00 GiB'."""
    unit, scale = _unit(n)
    return f"{n:,.0f} B" if scale == 1 else f"{n / scale:,.2f} {unit}"


def write_memory_csv(points: list[tuple[float, int]], path: str) -> None:
    """The memory curve as `time_ms,bytes` rows (always written: the plot needs matplotlib)."""
    with open(path, "w") as f:
        f.write("time_ms,bytes\n" + "".join(f"{t * 1e3:.6f},{b}\n" for t, b in points))


def write_memory_plot(points: list[tuple[float, int]], graphs: list[tuple[str, float, float]], path: str) -> bool:
    """A step chart of estimated live bytes over the step, one shaded band per graph (forward / backward), axes in ms
    and the byte unit that fits, the peak marked. Drawn with matplotlib (the `plots` extra); False when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        logger.info("memory plot skipped: matplotlib is not installed (pip install 'fsdp2_compile[plots]'); "
                    "memory.csv has the curve")
        return False
    unit, scale = _unit(max(b for _, b in points))
    times = [t * 1e3 for t, _ in points]
    mib = [b / scale for _, b in points]
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=100)
    for (label, start, end), shade in zip(graphs, itertools.cycle(("#e3f2fd", "#fff3e0"))):
        ax.axvspan(start * 1e3, end * 1e3, color=shade, zorder=0)
        ax.text((start + end) / 2 * 1e3, 1.01, label, transform=ax.get_xaxis_transform(), ha="center", va="bottom")
    ax.step(times, mib, where="post", color="#1565c0", linewidth=1.2)
    peak = max(range(len(points)), key=lambda i: points[i][1])
    ax.plot([times[peak]], [mib[peak]], "o", color="#c62828")
    ax.annotate(f"peak {size_text(points[peak][1])}", (times[peak], mib[peak]), textcoords="offset points",
                xytext=(6, -12), color="#c62828")
    ax.set_xlabel("simulated time in the step (ms)")
    ax.set_ylabel(f"live bytes beyond parameters ({unit})")
    ax.set_xlim(0, max(times[-1], 1e-9))
    ax.set_ylim(0, max(mib) * 1.15 or 1)
    ax.grid(True, color="#e0e0e0")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------- the folder


def write_graph(record: GraphRecord, folder: str, title: str) -> None:
    """The per-pass text files, DOT and SVG of one compiled graph into `folder`."""
    os.makedirs(folder, exist_ok=True)
    for i, snap in enumerate(record.snapshots):
        with open(os.path.join(folder, f"{i:02d}_{snap.name}.txt"), "w") as f:
            f.write(f"# {title} graph after pass {i}: {snap.name}\n{annotate(snap)}")
    write_dot(record.gm, os.path.join(folder, "graph.dot"))
    write_svg(record.gm, os.path.join(folder, "graph.svg"), f"{title} graph")


def write_dump(records: list[GraphRecord], out_dir: str, profile: HardwareProfile | None = None,
               graphs: bool = True) -> str:
    """Write every artefact for `records` into `out_dir` and return the summary text."""
    os.makedirs(out_dir, exist_ok=True)
    if graphs:
        for label, record in zip(_labels(records), records):
            write_graph(record, os.path.join(out_dir, label), label)
    timelines = _timelines(records, _profiles(records, profile))
    with open(os.path.join(out_dir, "trace.json"), "w") as f:
        json.dump(trace_events(records, timelines), f)
    points, _ = _memory_curve(records, timelines)
    write_memory_csv(points, os.path.join(out_dir, "memory.csv"))
    write_memory_plot(points, _graph_spans(records, timelines), os.path.join(out_dir, "memory.png"))
    summary = summarize(records, profile)
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(summary)
    return summary


def dump_from_env(record: GraphRecord | None = None) -> None:
    """If $FSDP2_COMPILE_DUMP is set: write `record`'s graphs (default: the last compiled one), and the trace / memory / summary of every graph
    compiled so far, into `$FSDP2_COMPILE_DUMP/rank<r>` (the backend calls this for every compiled graph)."""
    root = os.environ.get(DUMP_ENV)
    if not root:
        return
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    out_dir = os.path.join(root, f"rank{rank}")
    records = compiled_graphs()
    record = record or records[-1]
    labels = dict(zip(map(id, records), _labels(records)))
    label = labels.get(id(record), record.kind)
    write_graph(record, os.path.join(out_dir, label), label)
    write_dump(records, out_dir, graphs=False)
