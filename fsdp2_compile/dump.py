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
from .graph import BUCKET, PARAMS, ROLE
from .report import GraphRecord, collective, collectives, compiled_graphs

__all__ = ["DUMP_ENV", "annotate", "dump_from_env", "png_line_chart", "saved_bytes", "summarize", "write_dump"]

DUMP_ENV = "FSDP2_COMPILE_DUMP"

_funcol = torch.ops._c10d_functional
_AG, _RS, _AR = "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"
_COLLECTIVE_KIND = {_AG: "all_gather", _RS: "reduce_scatter", _AR: "all_reduce"}
_CAST = "convert_element_type"
_LOWERING_OPS = {_AG, _RS, _AR, "wait_tensor", _CAST, "constant_pad_nd", "view", "cat", "clone", "slice",
                 "_to_copy", "contiguous", "reshape", "split", "getitem"}
_LINE = re.compile(r"^(\s*)%(\w+) : \[num_users=\d+\] = (\w+)\[target=([^\]]+)\]\(args = \((.*)\), kwargs = .*\)$")
_NODE_LINE = re.compile(r"^\s*(?:%\w+ : |return\b)", re.MULTILINE)  # one per node, the output node included
_FSDP_OP = re.compile(r"fsdp2\.(unshard|reduce_grad)")

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


@dataclass
class _Line:
    name: str
    op: str
    target: str
    inputs: list[str]
    args: str


def _short_target(target: str) -> str:
    """'torch.ops._c10d_functional.wait_tensor.default' -> 'wait_tensor'."""
    parts = target.split(".")
    return parts[-2] if len(parts) >= 2 and parts[-1] in ("default", "Tensor", "dim", "int", "Scalar") else parts[-1]


def _parse(text: str) -> dict[str, _Line]:
    lines = {}
    for raw in text.splitlines():
        m = _LINE.match(raw)
        if m:
            _, name, op, target, args = m.groups()[:5]
            lines[name] = _Line(name, op, target, re.findall(r"%(\w+)", args), args)
    return lines


def _fsdp_sources(snapshots: list[tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """Name of every `fsdp2::unshard` / `fsdp2::reduce_grad` node and of its tensor input -> (fqn, bucket)."""
    sources: dict[str, tuple[str, str]] = {}
    for _, text in snapshots:
        for line in _parse(text).values():
            m = _FSDP_OP.search(line.target)
            if not m or not line.inputs:
                continue
            args = [a.strip() for a in line.args.split(",")]
            fqn, bucket = args[6], args[7]  # both ops: (tensor, 5 sizes/dtypes, fqn, bucket, ...)
            sources[line.inputs[0]] = sources[line.name] = (fqn, bucket)
    return sources


def _category(target: str, op: str) -> str:
    short = _short_target(target)
    if op == "placeholder":
        return "placeholder"
    if short in _COLLECTIVE_KIND:
        return _COLLECTIVE_KIND[short]
    if short == "wait_tensor":
        return "wait"
    if short == _CAST:
        return "cast"
    return "other"


def _provenance(name: str, lines: dict[str, _Line], sources: dict[str, tuple[str, str]]) -> tuple[list[str], set]:
    """Parameters and buckets a lowering node serves, found by walking its inputs back (through lowering ops only)
    to the input of an fsdp2 op."""
    params, buckets, seen, stack = [], set(), set(), [name]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current in sources and current != name:
            fqn, bucket = sources[current]
            if fqn not in params:
                params.append(fqn)
            buckets.add(bucket)
            continue
        line = lines.get(current)
        if line is not None and (current == name or _short_target(line.target) in _LOWERING_OPS):
            stack.extend(reversed(line.inputs))
    return params, buckets


def _note(params, bucket, extra: str = "") -> str:
    shown = ", ".join(params[:6]) + (f", ... ({len(params)} params)" if len(params) > 6 else "")
    return f"  # bucket={bucket!r} params=[{shown}]{extra}"


def annotate(text: str, snapshots: list[tuple[str, str]], final: fx.GraphModule | None = None) -> str:
    """`text` (a graph snapshot) with every collective, wait and cast line followed by `# bucket=... params=[...]`.

    With `final` (the graph the text is the final snapshot of), the provenance is the nodes' own `node.meta`;
    otherwise it is traced back through the snapshot's lowering nodes to the fsdp2 op each one came from."""
    lines = _parse(text)
    sources = _fsdp_sources(snapshots)
    meta = {n.name: n for n in final.graph.nodes} if final is not None else {}
    out = []
    for raw in text.splitlines():
        m = _LINE.match(raw)
        note = ""
        if m:
            name, op, target = m.group(2), m.group(3), m.group(4)
            category = _category(target, op)
            if _FSDP_OP.search(target) and name in sources:
                note = _note([sources[name][0]], sources[name][1], "  (not lowered yet)")
            elif category in ("all_gather", "reduce_scatter", "all_reduce", "wait", "cast"):
                node = meta.get(name)
                if node is not None and PARAMS in node.meta:
                    note = _note(list(node.meta[PARAMS]), node.meta.get(BUCKET, ""), f" role={node.meta.get(ROLE)}")
                else:
                    params, buckets = _provenance(name, lines, sources)
                    if params:
                        note = _note(params, "|".join(sorted(buckets)))
        out.append(raw + note)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- summary


@dataclass
class PassStats:
    name: str
    nodes: int
    counts: Counter = field(default_factory=Counter)
    """Collectives by kind ("all_gather", "reduce_scatter", "all_reduce") and "wait"."""
    bytes_by_dtype: Counter = field(default_factory=Counter)
    """Bytes of the full (padded) buffers collectives move, by (kind, dtype name); None values if unknown."""
    unknown_bytes: int = 0
    """Collectives whose bytes could not be re-derived (their input no longer exists in the final graph)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _snapshot_bytes(line: _Line, lines: dict[str, _Line], final_nodes: dict[str, fx.Node]) -> tuple[str, int] | None:
    """(dtype name, full buffer bytes) of a collective line of an earlier snapshot, from its input as it is in the
    final graph: an all-gather's input times its group size; a reduce-scatter's input; an all-reduce's input or,
    when that is gone (HSDP before bucketing: wait(reduce_scatter(x))), x divided by the reduce-scatter's group."""
    short = _short_target(line.target)
    source = final_nodes.get(line.inputs[0]) if line.inputs else None
    value = source.meta.get("val") if source is not None else None
    if isinstance(value, torch.Tensor):
        scale = int(line.args.split(",")[1]) if short == _AG else 1
        return _dtype_name(value.dtype), value.numel() * value.element_size() * scale
    wait = lines.get(line.inputs[0]) if short == _AR and line.inputs else None
    scatter = lines.get(wait.inputs[0]) if wait is not None and wait.inputs else None
    if scatter is None or _short_target(wait.target) != "wait_tensor" or _short_target(scatter.target) != _RS:
        return None
    full = _snapshot_bytes(scatter, lines, final_nodes)
    if full is None:
        return None
    return full[0], full[1] // int(scatter.args.split(",")[2])


def pass_stats(record: GraphRecord) -> list[PassStats]:
    """Per pass: node count, collectives by kind, bytes by dtype. Counts come from the snapshot text; bytes from
    each collective's input as it is in the final graph (the last pass: from `report.collectives`)."""
    final_nodes = {n.name: n for n in record.gm.graph.nodes}
    stats = []
    for index, (name, text) in enumerate(record.snapshots):
        lines = _parse(text)
        s = PassStats(name, len(_NODE_LINE.findall(text)))
        is_final = index == len(record.snapshots) - 1
        for line in lines.values():
            short = _short_target(line.target)
            if short == "wait_tensor":
                s.counts["wait"] += 1
            if short not in _COLLECTIVE_KIND:
                continue
            kind = _COLLECTIVE_KIND[short]
            s.counts[kind] += 1
            if is_final:
                continue
            found = _snapshot_bytes(line, lines, final_nodes)
            if found is None:
                s.unknown_bytes += 1
                continue
            s.bytes_by_dtype[(kind, found[0])] += found[1]
        if is_final:
            for c in collectives(record.gm):
                s.bytes_by_dtype[(c.kind, _dtype_name(c.dtype))] += c.nbytes
        stats.append(s)
    return stats


def saved_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the tensors a forward graph returns that are not its inputs (outputs + saved for backward)."""
    total, seen = 0, set()
    for arg in fx.node.map_arg(gm.graph.output_node().args, lambda n: n) or ():
        for node in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(node, fx.Node) and node.op != "placeholder" and node not in seen:
                seen.add(node)
                value = node.meta.get("val")
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
    return total


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _labels(records: list[GraphRecord]) -> list[str]:
    seen: Counter = Counter()
    labels = []
    for r in records:
        labels.append(r.kind if seen[r.kind] == 0 else f"{r.kind}_{seen[r.kind]}")
        seen[r.kind] += 1
    return labels


def _timelines(records: list[GraphRecord], profile: HardwareProfile) -> list[Timeline]:
    return [simulate(r.gm, profile) for r in records]


def summarize(records: list[GraphRecord], profile: HardwareProfile) -> str:
    """The summary table: per graph and pass, per bucket, peak memory and exposed communication."""
    out = [f"cost model profile: {profile.name} ({profile.source})", ""]
    timelines = _timelines(records, profile)
    for label, record, tl in zip(_labels(records), records, timelines):
        out.append(f"== {label} graph ({len(record.gm.graph.nodes)} nodes)")
        out.append(f"  {'pass':<22}{'nodes':>7}{'all_gather':>12}{'reduce_scat':>12}{'all_reduce':>12}{'wait':>6}"
                   "  bytes by dtype")
        for s in pass_stats(record):
            parts = [f"{k[0]} {k[1]} {_mib(v)}" for k, v in sorted(s.bytes_by_dtype.items())]
            if s.unknown_bytes:
                parts.append(f"{s.unknown_bytes} collective(s) of unknown size")
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
    if PARAMS in node.meta and _category(str(node.target), node.op) != "other":
        params = node.meta[PARAMS]
        label += f"  [{node.meta.get(BUCKET) or '<root>'}: {len(params)} param{'s' * (len(params) != 1)}]"
    return label


def _node_category(node: fx.Node) -> str:
    return _category(str(node.target), node.op)


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
    sx = lambda t: left + round((right - left) * t / t_max)  # noqa: E731
    sy = lambda v: bottom - round((bottom - top) * v / v_max)  # noqa: E731
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
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
    last = len(record.snapshots) - 1
    for i, (name, text) in enumerate(record.snapshots):
        body = annotate(text, record.snapshots, record.gm if i == last else None)
        with open(os.path.join(folder, f"{i:02d}_{name}.txt"), "w") as f:
            f.write(f"# {title} graph after pass {i}: {name}\n{body}")
    write_dot(record.gm, os.path.join(folder, "graph.dot"))
    write_svg(record.gm, os.path.join(folder, "graph.svg"), f"{title} graph")


def write_dump(records: list[GraphRecord], out_dir: str, profile: HardwareProfile | None = None,
               graphs: bool = True) -> str:
    """Write every artefact for `records` into `out_dir` and return the summary text."""
    profile = profile or PROFILES["cpu-gloo-loopback"]
    os.makedirs(out_dir, exist_ok=True)
    if graphs:
        for label, record in zip(_labels(records), records):
            write_graph(record, os.path.join(out_dir, label), label)
    timelines = _timelines(records, profile)
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
