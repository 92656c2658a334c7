"""Debugging artefacts of the graphs the fsdp2 backend compiled (`report.compiled_graphs()`), written to a folder:

    forward/00_captured.txt ...   the graph after every pass; collective / wait / cast lines annotated with their
                                  parameters and bucket (provenance)
    forward/graph.dot, .svg       the final graph, all-gathers, reduce-scatters, all-reduces (HSDP), waits and
                                  casts highlighted
    trace.json                    the simulated schedule (cost_model.simulate) as a Perfetto / Chrome trace
    memory.png                    estimated live bytes over the step
    summary.txt                   the table `summarize` returns (also printed by `fsdp2-compile dump`)

`dump_from_env(record)` (called by the backend for every compiled graph) writes them to `$FSDP2_COMPILE_DUMP/rank<r>`.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import struct
import zlib
from collections import Counter
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

import torch
from torch import fx

from .cost_model import PROFILES, HardwareProfile, Timeline, simulate
from .ir import BUCKET, COLLECTIVE_KINDS, PARAMS, WAIT, Role, collective_kind
from .report import DUMP_ENV, GraphRecord, NodeFacts, Snapshot, collective, compiled_graphs, saved_bytes

__all__ = ["DUMP_ENV", "annotate", "dump_from_env", "png_line_chart", "saved_bytes", "summarize", "write_dump"]

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


_FONT = {  # 3x5 glyphs, rows top to bottom, 3 bits each
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", " ": "000000000000000",
    "M": "101111111101101", "i": "010000010010010", "B": "110101110101110", "m": "000111111101101",
    "s": "011100010001110", "p": "110101110100100", "e": "111100111100111", "a": "000011101101011",
    "k": "100101110101101", "t": "010111010010011", "-": "000000111000000",
}


def png_line_chart(points: list[tuple[float, float]], width: int = 800, height: int = 360) -> bytes:
    """A PNG (RGB, 8 bit) of a line chart of `points` with axes, the peak and the end time written on it."""
    pixels = bytearray(b"\xff" * (width * height * 3))

    def put(x: int, y: int, rgb=(0, 0, 0)) -> None:
        if 0 <= x < width and 0 <= y < height:
            i = (y * width + x) * 3
            pixels[i : i + 3] = bytes(rgb)

    def line(x0: int, y0: int, x1: int, y1: int, rgb=(0, 0, 0)) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for k in range(steps + 1):
            put(round(x0 + (x1 - x0) * k / steps), round(y0 + (y1 - y0) * k / steps), rgb)

    def text(x: int, y: int, s: str, scale: int = 2) -> None:
        for ch in s:
            glyph = _FONT.get(ch, _FONT[" "])
            for bit, on in enumerate(glyph):
                if on == "1":
                    for dx in range(scale):
                        for dy in range(scale):
                            put(x + (bit % 3) * scale + dx, y + (bit // 3) * scale + dy)
            x += 4 * scale

    left, right, top, bottom = 60, width - 20, 30, height - 40
    t_max = max((t for t, _ in points), default=1.0) or 1.0
    v_max = max((v for _, v in points), default=1.0) or 1.0
    line(left, top, left, bottom)
    line(left, bottom, right, bottom)
    for k in range(5):  # ticks and a light grid
        y = bottom - (bottom - top) * k // 4
        x = left + (right - left) * k // 4
        line(left - 5, y, left, y)
        line(x, bottom, x, bottom + 5)
        if k:
            line(left + 1, y, right, y, (230, 230, 230))
    sx = lambda t: left + round((right - left) * t / t_max)
    sy = lambda v: bottom - round((bottom - top) * v / v_max)
    for (t0, v0), (t1, v1) in itertools.pairwise(points):
        line(sx(t0), sy(v0), sx(t1), sy(v0), (21, 101, 192))  # step chart: bytes change at node ends
        line(sx(t1), sy(v0), sx(t1), sy(v1), (21, 101, 192))
    text(left, 8, f"peak {v_max / 2**20:.2f} MiB")
    text(right - 120, height - 24, f"{t_max * 1e3:.3f} ms")
    text(left - 4, height - 24, "0")
    raw = b"".join(b"\x00" + bytes(pixels[y * width * 3 : (y + 1) * width * 3]) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


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
    with open(os.path.join(out_dir, "memory.png"), "wb") as f:
        f.write(png_line_chart(points))
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
