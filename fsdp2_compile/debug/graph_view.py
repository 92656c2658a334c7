"""The compact view of a compiled graph that `dump` draws (graph.dot, graph.svg): one row per collective, wait,
run of casts, run of inputs and *compute region* (consecutive compute nodes merged, e.g. "mm x2, relu, add");
views and FSDP's copy-in / padding / copy-out nodes are folded into their neighbours. Inputs that are parameter
shards are named by the parameters they carry. The per-node text stays in the per-pass .txt files.

graph.svg is rendered by Graphviz's `dot` through the `graphviz` package when both are installed, else by the
writer here (one row per line in execution order, data edges of collectives and waits drawn as arcs).
"""

from __future__ import annotations

import operator
import shutil
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

import torch
from torch import fx

from fsdp2_compile.compiler.graph_records import is_tp
from fsdp2_compile.core.ir import BUCKET, PARAMS, ROLE, WAIT, Role, collective, collective_kind
from fsdp2_compile.debug.sizes import size_text

__all__ = ["COLOURS", "LEGEND", "Row", "compact_rows", "input_params", "write_dot", "write_svg"]

COLOURS = {  # category -> (fill, stroke); "tp" / "tp_wait": tensor parallelism's collectives and their waits
    "all_gather": ("#8fd18f", "#2e7d32"),
    "reduce_scatter": ("#f6a38e", "#c62828"),
    "all_reduce": ("#ce93d8", "#6a1b9a"),
    "wait": ("#ffe082", "#f57f17"),
    "tp": ("#4dd0e1", "#006064"),
    "tp_wait": ("#b2ebf2", "#00838f"),
    "cast": ("#90caf9", "#1565c0"),
    "input": ("#eeeeee", "#9e9e9e"),
    "compute": ("#ffffff", "#bdbdbd"),
    "output": ("#eeeeee", "#616161"),
}
LEGEND = {"tp": "tensor parallel collective", "tp_wait": "tensor parallel wait"}
"""Legend text of a category, where not its name."""
_CAST = torch.ops.prims.convert_element_type.default
_FOLDED_ROLES = {Role.PAD, Role.CONTIGUOUS, Role.COPY_IN, Role.COPY_OUT, Role.UNPAD, Role.KEEP_ALIVE}
_VIEWS = {
    "view",
    "_unsafe_view",
    "reshape",
    "expand",
    "permute",
    "transpose",
    "t",
    "squeeze",
    "unsqueeze",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "alias",
    "as_strided",
    "detach",
    "unbind",
    "view_as",
    "getitem",
}
_SHOWN_OPS = 6
"""A compute row names its most frequent ops, this many at most (then "+k more")."""
_SHOWN_PARAMS = 8
"""A collective row names this many of its parameters at most (the input rows name every shard)."""


@dataclass
class Row:
    """One row of the compact view: its category (a COLOURS key), its text and the graph nodes it stands for."""

    category: str
    text: str
    nodes: list[fx.Node] = field(default_factory=list)


def _op_name(node: fx.Node) -> str:
    """'aten.mm.default' -> 'mm'; operator.getitem -> 'getitem'."""
    if node.target is operator.getitem:
        return "getitem"
    name = getattr(node.target, "__name__", str(node.target))
    overload = getattr(node.target, "overloadpacket", None)
    return overload.__name__ if overload is not None else name.split(".")[0]


def _shape(node: fx.Node) -> str:
    value = node.meta.get("val")
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else ""


def _category(node: fx.Node) -> str | None:
    """The row kind a node starts or joins; None for a folded node (a view, FSDP's copy-in / padding)."""
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    kind = collective_kind(node)
    if kind is not None:
        return "tp" if is_tp(node) else str(kind)
    if node.target is WAIT:
        return "tp_wait" if is_tp(node) else "wait"
    if node.target is _CAST:
        return "cast"
    if node.meta.get(ROLE) in _FOLDED_ROLES or _op_name(node) in _VIEWS:
        return None
    return "compute"


def input_params(gm: fx.GraphModule) -> dict[fx.Node, tuple[str, str]]:
    """(parameter, bucket) of each input that is a parameter shard, found from the all-gathers: walking back from each
    all-gather's input through single-input nodes (views, casts, padding) to a placeholder, and through a bucket's
    copy-in (one input per parameter, in `fsdp.params` order)."""
    found: dict[fx.Node, tuple[str, str]] = {}

    def walk(node: fx.Node, params: tuple[str, ...], bucket: str) -> None:
        inputs = node.all_input_nodes
        if node.op == "placeholder" and len(params) == 1:
            found.setdefault(node, (params[0], bucket))
        elif node.meta.get(ROLE) == Role.COPY_IN and len(inputs) == len(params) > 1:
            for x, param in zip(inputs, params):
                walk(x, (param,), bucket)
        elif len(inputs) == 1:
            walk(inputs[0], params, bucket)

    for node in gm.graph.nodes:
        if collective_kind(node) == Role.ALL_GATHER:
            walk(node.all_input_nodes[0], tuple(node.meta.get(PARAMS, ())), node.meta.get(BUCKET, ""))
    return found


def _listed(items: list[str], limit: int) -> str:
    return ", ".join(items[:limit]) + (f", +{len(items) - limit} more" if len(items) > limit else "")


def _where(bucket: str | None) -> str:
    return "" if bucket is None else f"bucket '{bucket}'" if bucket else "root bucket"


def _relative(names, bucket: str | None) -> list[str]:
    """Parameter names without their bucket's prefix ('blocks.0.mlp.weight' in 'blocks.0': 'mlp.weight')."""
    prefix = f"{bucket}." if bucket else "\0"
    return [n.removeprefix(prefix) for n in names]


def _dtype(value) -> str:
    return str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else type(value).__name__


def _row_text(category: str, nodes: list[fx.Node], params: dict[fx.Node, tuple[str, str]]) -> str:
    first = nodes[0]
    bucket = first.meta.get(BUCKET)
    where = _where(bucket)
    if category in ("all_gather", "reduce_scatter", "all_reduce"):
        c = collective(first)
        names, dtype = _listed(_relative(c.params, bucket), _SHOWN_PARAMS), str(c.dtype).removeprefix("torch.")
        return f"{category} {where}: {size_text(c.nbytes)} {dtype}, {len(c.params)} params: {names}"
    if category == "tp":
        c = collective(first)
        return (
            f"tensor parallel {c.kind}: {size_text(c.nbytes)} {str(c.dtype).removeprefix('torch.')}, "
            f"{_shape(first)} (DTensor redistribution)"
        )
    if category == "tp_wait":
        return f"wait for tensor parallel {collective_kind(first.all_input_nodes[0]) or 'collective'}"
    if category == "wait":
        started = first.all_input_nodes[0]
        return f"wait for {collective_kind(started) or _op_name(started)} {where}".rstrip()
    if category == "cast":
        dtypes = sorted({_dtype(n.meta.get("val")) for n in nodes})
        return f"cast x{len(nodes)} to {', '.join(dtypes)} {where}".rstrip()
    if category == "input":
        shards = [n for n in nodes if n in params]
        if shards:
            bucket = params[shards[0]][1]
            names = _relative([params[n][0] for n in shards], bucket)
            dtypes = sorted({_dtype(n.meta.get("val")) for n in shards})
            listed = ", ".join(f"{name} {_shape(n)}" for name, n in zip(names, shards))
            return f"parameter shards, {_where(bucket)} ({len(shards)}, {', '.join(dtypes)}): {listed}"
        used = [n for n in nodes if n.users]
        unused = f" (+{len(nodes) - len(used)} unused)" if len(used) < len(nodes) else ""
        shown = [f"{n.name} {_dtype(n.meta.get('val'))}{_shape(n)}" for n in used]
        return f"other inputs x{len(used)}: {_listed(shown, 4)}{unused}"
    if category == "output":
        return f"output: {len(first.all_input_nodes)} tensors"
    ops = Counter(_op_name(n) for n in nodes)
    named = [f"{op} x{k}" if k > 1 else op for op, k in ops.most_common(_SHOWN_OPS)]
    more = f", +{len(ops) - _SHOWN_OPS} more kinds" if len(ops) > _SHOWN_OPS else ""
    return f"compute ({len(nodes)} ops): {', '.join(named)}{more}"


def _key(category: str, node: fx.Node) -> tuple:
    """Consecutive nodes with the same key share a row: compute with compute, casts of one bucket and dtype."""
    if category == "compute":
        return ("compute",)
    if category == "cast":
        return ("cast", node.meta.get(BUCKET), _dtype(node.meta.get("val")))
    return (category, node)


def compact_rows(gm: fx.GraphModule) -> list[Row]:
    """The graph's rows in execution order: the inputs first (one row per bucket of parameter shards, one for the
    others), then the rest; a folded node joins the row of its first input."""
    params = input_params(gm)
    by_bucket: dict[str | None, list[fx.Node]] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        by_bucket.setdefault(params[node][1] if node in params else None, []).append(node)
    others = by_bucket.pop(None, [])
    groups = [("input", nodes) for nodes in [*by_bucket.values(), others] if nodes]
    row_of = {n: i for i, (_, nodes) in enumerate(groups) for n in nodes}
    last_key = None
    for node in gm.graph.nodes:
        category = _category(node)
        if category == "input":
            continue
        if category is None:  # folded into the row of what it reads (a view of a wait's result: the wait's row)
            home = row_of.get(node.all_input_nodes[0]) if node.all_input_nodes else None
            if home is None and groups:
                home = len(groups) - 1
            if home is not None:
                groups[home][1].append(node)
                row_of[node] = home
            continue
        key = _key(category, node)
        if key != last_key:
            groups.append((category, []))
        groups[-1][1].append(node)
        row_of[node] = len(groups) - 1
        last_key = key
    rows = []
    for category, nodes in groups:
        shown = [n for n in nodes if _category(n) == category] or nodes
        rows.append(Row(category, _row_text(category, shown, params), nodes))
    return rows


def row_edges(rows: list[Row]) -> list[tuple[int, int]]:
    """(producer row, consumer row) for every data edge between two different rows."""
    row_of = {n: i for i, row in enumerate(rows) for n in row.nodes}
    edges = {
        (row_of[p], i)
        for i, row in enumerate(rows)
        for n in row.nodes
        for p in n.all_input_nodes
        if p in row_of and row_of[p] != i
    }
    return sorted(edges)


# ---------------------------------------------------------------------------------------------- DOT


def _dot_text(rows: list[Row], title: str, wrap: int) -> str:
    out = [
        "digraph G {",
        f'  label="{title}"; labelloc=t; rankdir=TB; nodesep=0.2; ranksep=0.25;',
        "  node [shape=box, style=filled, fontname=monospace, fontsize=10];",
    ]
    out.append("  subgraph cluster_legend { label=legend; rank=same;")
    for category in [c for c in COLOURS if any(r.category == c for r in rows)]:
        fill, stroke = COLOURS[category]
        out.append(
            f'    legend_{category} [label="{LEGEND.get(category, category)}", fillcolor="{fill}", color="{stroke}"];'
        )
    out.append("  }")
    for i, row in enumerate(rows):
        fill, stroke = COLOURS[row.category]
        label = "\\l".join(textwrap.wrap(row.text, wrap)).replace('"', '\\"') + "\\l"
        out.append(f'  r{i} [label="{label}", fillcolor="{fill}", color="{stroke}"];')
    out.extend(f"  r{a} -> r{b};" for a, b in row_edges(rows))
    out.append("}")
    return "\n".join(out) + "\n"


def write_dot(gm: fx.GraphModule, path: str, title: str = "") -> None:
    """The compact view as Graphviz DOT text (rows as boxes, data edges between rows, a legend)."""
    with open(path, "w") as f:
        f.write(_dot_text(compact_rows(gm), title, _WRAP))


# ---------------------------------------------------------------------------------------------- SVG

_FONT = 11
_LINE_H = 14
_WRAP = 88
"""Characters per line in a box: the box is this wide, longer texts wrap onto more lines."""


def _render_with_dot(dot_path: str, svg_path: str) -> bool:
    """graph.svg from graph.dot with Graphviz's `dot`, when the `graphviz` package and the binary are installed."""
    if shutil.which("dot") is None:
        return False
    try:
        import graphviz
    except ImportError:
        return False
    svg = graphviz.Source.from_file(dot_path).pipe(format="svg")
    with open(svg_path, "wb") as f:
        f.write(svg)
    return True


def text_width(text: str, size: float = _FONT) -> float:
    """Width of `text` in the monospace font at `size` px: every glyph advances 0.602 em, which renderers that
    hint to whole pixels (cairo) round up to 7 px at 11 px; 0.64 em covers both."""
    return len(text) * 0.64 * size


def _text(x: float, y: float, text: str, size: float = _FONT, attrs: str = "") -> str:
    """An SVG text whose width is pinned to `text_width` (textLength): it fits its box whatever font renders it."""
    return (
        f'<text x="{x}" y="{y}" font-size="{size}" textLength="{text_width(text, size):.1f}" '
        f'lengthAdjust="spacingAndGlyphs"{attrs}>{escape(text)}</text>'
    )


_COMM = ("all_gather", "reduce_scatter", "all_reduce", "wait", "tp", "tp_wait")


def _builtin_svg(rows: list[Row], title: str) -> str:
    left, pad, arc_w, top = 10, 6, 160, 64
    box_w = round(text_width("x" * _WRAP) + 2 * pad)
    lines = [textwrap.wrap(r.text, _WRAP) for r in rows]
    ys = [top]
    for ls in lines:
        ys.append(ys[-1] + len(ls) * _LINE_H + 8)
    legend = [c for c in COLOURS if any(r.category == c for r in rows)]
    note = "rows in execution order; arcs: data edges into and out of collectives and waits"
    out = [_text(left, 18, title, 13), _text(left, 56, note, attrs=' fill="#555"')]
    x = left
    for category in legend:
        fill, stroke = COLOURS[category]
        out.append(f'<rect x="{x}" y="30" width="12" height="12" fill="{fill}" stroke="{stroke}"/>')
        name = LEGEND.get(category, category)
        out.append(_text(x + 16, 40, name))
        x += 16 + text_width(name) + 12
    for row, ls, y, y_next in zip(rows, lines, ys, ys[1:]):
        fill, stroke = COLOURS[row.category]
        weight = ' font-weight="bold"' if row.category in _COMM else ""
        out.append(
            f'<rect x="{left}" y="{y}" width="{box_w}" height="{y_next - y - 4}" fill="{fill}" stroke="{stroke}"/>'
        )
        out.extend(_text(left + pad, y + 12 + k * _LINE_H, line, attrs=weight) for k, line in enumerate(ls))
    for a, b in row_edges(rows):
        comm = [rows[i].category for i in (a, b) if rows[i].category in _COMM]
        if comm:
            y1, y2 = ys[a] + 8, ys[b] + 8
            bend = left + box_w + 8 + min(arc_w - 16, abs(y2 - y1) // 4)
            out.append(
                f'<path d="M{left + box_w} {y1} C{bend} {y1} {bend} {y2} {left + box_w} {y2}" fill="none" '
                f'stroke="{COLOURS[comm[0]][1]}" stroke-width="1.2" opacity="0.8"/>'
            )
    width = round(max(left + box_w + arc_w, left + text_width(title, 13) + 10, left + text_width(note) + 10, x))
    head = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{ys[-1] + 10}" '
        'font-family="DejaVu Sans Mono, Menlo, Consolas, monospace">',
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    return "\n".join([*head, *out, "</svg>"]) + "\n"


def write_svg(gm: fx.GraphModule, path: str, title: str = "", dot_path: str | None = None) -> str:
    """graph.svg of the compact view: Graphviz's layout of `dot_path` when available, else the built-in writer.
    Returns which one drew it ("dot" or "builtin")."""
    if dot_path is not None and _render_with_dot(dot_path, path):
        return "dot"
    rows = compact_rows(gm)
    with open(path, "w") as f:
        f.write(_builtin_svg(rows, f"{title}: {len(gm.graph.nodes)} nodes in {len(rows)} rows"))
    return "builtin"
