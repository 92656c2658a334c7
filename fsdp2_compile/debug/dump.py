"""Debugging artefacts of the graphs the fsdp2 backend compiled (`graph_records.compiled_graphs()`), written to a
folder."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field

import torch

from fsdp2_compile.compiler.cost_model import Timeline, simulate
from fsdp2_compile.compiler.graph_records import (
    DUMP_ENV,
    UNWRITABLE_DUMP_FOLDERS,
    GraphRecord,
    NodeFacts,
    Snapshot,
    collective,
    compiled_graphs,
    dump_requested,
    is_tp,
    saved_bytes,
)
from fsdp2_compile.core.hardware import PROFILES, HardwareProfile
from fsdp2_compile.core.ir import BUCKET, COLLECTIVE_KINDS, Role, SubgraphCall
from fsdp2_compile.debug.graph_view import write_dot, write_svg
from fsdp2_compile.debug.sizes import size_text, unit_of

logger = logging.getLogger(__name__)

__all__ = ["DUMP_ENV", "annotate", "dump_from_env", "saved_bytes", "summarize", "write_dump"]

_NODE_NAME = re.compile(r"^\s*%(\w+) : ")
_NODE_LINE = re.compile(r"^\s*(?:%\w+ : |return\b)", re.MULTILINE)  # one per node, the output node included
_KINDS = set(COLLECTIVE_KINDS.values())
_COUNTED = {*_KINDS, Role.WAIT}
_NOT_LOWERED = {"unshard", "reduce_grad"}
_ANNOTATED = {*_COUNTED, "cast", *_NOT_LOWERED, "stash_grad", "add_pending_grad"}


# ---------------------------------------------------------------------------------------------- graph text


def _note(facts: NodeFacts) -> str:
    params = facts.params
    shown = ", ".join(params[:6]) + (f", ... ({len(params)} params)" if len(params) > 6 else "")
    extra = "  (not lowered yet)" if facts.role in _NOT_LOWERED else f" role={facts.role}"
    return f"  # bucket={facts.bucket!r} params=[{shown}]{extra}"


#     forward/00_captured.txt ...   the graph after every pass; collective / wait / cast lines annotated with their
#                                   parameters and bucket (provenance)
#     forward/graph.dot, .svg       the final graph's compact view (graph_view.py): one row per collective, wait,
#                                   cast run and compute region, parameter names on inputs
#     forward/subgraphs/<name>.txt  the subgraph of each kind of identical block traced once (block_gathers.py)
#     trace.json                    the simulated schedule (cost_model.simulate) as a Perfetto / Chrome trace
#     memory.csv, memory.png        estimated live bytes over the step (the plot needs matplotlib, the `plots` extra;
#                                   the CLI's --memory-plot memory.svg writes SVG)
#     summary.txt                   the table `summarize` returns (also printed by `fsdp2-compile dump`)
#
# `dump_from_env(record)` (called by the backend for every compiled graph) writes them to `$FSDP2_COMPILE_DUMP/rank<r>`.
def annotate(snapshot: Snapshot) -> str:
    """The snapshot's text with every collective, wait, cast and fsdp2 op line followed by
    `# bucket=... params=[...] role=...`, from the snapshot's node facts; tensor parallelism's collectives and waits
    by `# tensor parallel <kind>`."""
    out = []
    for raw in snapshot.text.splitlines():
        m = _NODE_NAME.match(raw)
        facts = snapshot.nodes.get(m.group(1)) if m else None
        if facts is not None and facts.tp:
            out.append(f"{raw}  # tensor parallel {facts.kind}")
            continue
        shown = facts is not None and facts.params and facts.role in _ANNOTATED
        out.append(raw + _note(facts) if shown else raw)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- summary


@dataclass
class PassStats:
    name: str
    nodes: int
    counts: Counter = field(default_factory=Counter)
    """FSDP's collectives by kind ("all_gather", "reduce_scatter", "all_reduce") and "wait"; tensor parallelism's
    apart: "tp" (its collectives), "tp all_reduce" etc. by kind, "tp wait"."""
    bytes_by_dtype: Counter = field(default_factory=Counter)
    """Bytes of the full (padded) buffers collectives move, by (kind, dtype name); TP's kinds as "tp <kind>"."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pass_stats(record: GraphRecord) -> list[PassStats]:
    """Per pass: node count (from the text), collectives by kind and their bytes by dtype (from the facts)."""
    stats = []
    for snap in record.snapshots:
        s = PassStats(snap.name, len(_NODE_LINE.findall(snap.text)))
        for facts in snap.nodes.values():
            if facts.tp:  # tensor parallelism's: never in FSDP's columns
                s.counts[f"tp {facts.kind}"] += 1
                if facts.kind != "wait":
                    s.counts["tp"] += 1
                    s.bytes_by_dtype[(f"tp {facts.kind}", _dtype_name(facts.dtype))] += facts.nbytes
                continue
            if facts.role in _COUNTED:
                s.counts[facts.role] += 1
            if facts.role in _KINDS:
                s.bytes_by_dtype[(facts.role, _dtype_name(facts.dtype))] += facts.nbytes
        stats.append(s)
    return stats


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
        stats = pass_stats(record)
        tp = any(s.counts["tp"] for s in stats)
        out.append(
            f"  {'pass':<22}{'nodes':>7}{'all_gather':>12}{'reduce_scat':>12}{'all_reduce':>12}{'wait':>6}"
            + (f"{'tp':>5}" if tp else "")
            + "  bytes by dtype"
        )
        for s in stats:
            parts = [f"{k[0]} {k[1]} {size_text(v)}" for k, v in sorted(s.bytes_by_dtype.items())]
            out.append(
                f"  {s.name:<22}{s.nodes:>7}{s.counts['all_gather']:>12}{s.counts['reduce_scatter']:>12}"
                f"{s.counts['all_reduce']:>12}{s.counts['wait']:>6}"
                + (f"{s.counts['tp']:>5}" if tp else "")
                + f"  {'; '.join(parts) or '-'}"
            )
        if tp:
            out.append(
                "  (tp: tensor parallelism's collectives, from DTensor redistribution; the other columns are FSDP's)"
            )
        out.append(f"  {'bucket':<22}{'collective':<20}{'dtype':<10}{'bytes':>12}  params")
        for node in record.gm.graph.nodes:
            c = collective(node)
            if c is not None:
                if is_tp(node):
                    bucket, kind = "(tensor parallel)", f"tp {c.kind}"
                else:
                    bucket, kind = node.meta.get(BUCKET, "?") or "<root>", str(c.kind)
                out.append(
                    f"  {bucket:<22}{kind:<20}{_dtype_name(c.dtype):<10}{size_text(c.nbytes):>12}  {len(c.params)}"
                )
        final = stats[-1] if stats else None
        if final is None:
            final = PassStats("final", len(record.gm.graph.nodes))
            for node in record.gm.graph.nodes:
                c = collective(node)
                if c is not None and is_tp(node):
                    final.counts["tp"] += 1
                    final.counts[f"tp {c.kind}"] += 1
                    final.bytes_by_dtype[(f"tp {c.kind}", _dtype_name(c.dtype))] += c.nbytes
        if final.counts["tp"]:
            kinds = ", ".join(
                f"{k.removeprefix('tp ')} x{n}"
                for k, n in sorted(final.counts.items())
                if k.startswith("tp ") and k != "tp wait"
            )
            total = sum(v for k, v in final.bytes_by_dtype.items() if k[0].startswith("tp "))
            out.append(
                f"  tensor parallel: {final.counts['tp']} collectives ({kinds}), {size_text(total)} of "
                "buffers (not in FSDP's counts above)"
            )
        if record.kept_gathered is not None:
            out.append(f"  {record.kept_gathered.describe(size_text)}")
        for name, same in _subgraph_calls(record).items():
            out.append(
                f"  blocks traced once: subgraph {name} ({len(same[0].module().graph.nodes)} nodes) called "
                f"{len(same)} times"
            )
        out.append(
            f"  estimate: step {tl.total_s * 1e3:.3f} ms, compute {tl.compute_s * 1e3:.3f} ms, "
            f"communication {tl.comm_s * 1e3:.3f} ms, exposed communication {tl.exposed_comm_s * 1e3:.3f} ms, "
            f"peak intermediate memory {size_text(tl.peak_bytes)}"
        )
        out.append("")
    total = sum(t.total_s for t in timelines)
    exposed = sum(t.exposed_comm_s for t in timelines)
    out.append(
        f"step estimate (all graphs): {total * 1e3:.3f} ms, exposed communication {exposed * 1e3:.3f} ms, "
        f"peak memory {size_text(_memory_curve(records, timelines)[1])}"
    )
    return "\n".join(out) + "\n"


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
            events.append(
                {
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "cat": e.lane,
                    "name": e.name if e.lane != "wait" else f"wait ({e.name})",
                    "ts": (offset + e.start_s) * 1e6,
                    "dur": e.duration_s * 1e6,
                }
            )
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


def write_memory_csv(points: list[tuple[float, int]], path: str) -> None:
    """The memory curve as `time_ms,bytes` rows (always written: the plot needs matplotlib)."""
    with open(path, "w") as f:
        f.write("time_ms,bytes\n" + "".join(f"{t * 1e3:.6f},{b}\n" for t, b in points))


def write_memory_plot(points: list[tuple[float, int]], graphs: list[tuple[str, float, float]], path: str) -> bool:
    """A step chart of estimated live bytes over the step, one shaded band per graph (forward / backward), axes in ms
    and the byte unit that fits, the peak marked. Drawn with matplotlib (the `plots` extra); False when not installed.
    The format follows `path`'s extension (.png, .svg: text kept as text and no date, so the same curve writes the
    same file)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        logger.info(
            "memory plot skipped: matplotlib is not installed (pip install 'fsdp2_compile[plots]'); "
            "memory.csv has the curve"
        )
        return False
    unit, scale = unit_of(max(b for _, b in points))
    times = [t * 1e3 for t, _ in points]
    mib = [b / scale for _, b in points]
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=100)
    for (label, start, end), shade in zip(graphs, itertools.cycle(("#e3f2fd", "#fff3e0"))):
        ax.axvspan(start * 1e3, end * 1e3, color=shade, zorder=0)
        ax.text((start + end) / 2 * 1e3, 1.01, label, transform=ax.get_xaxis_transform(), ha="center", va="bottom")
    ax.step(times, mib, where="post", color="#1565c0", linewidth=1.2)
    peak = max(range(len(points)), key=lambda i: points[i][1])
    ax.plot([times[peak]], [mib[peak]], "o", color="#c62828")
    ax.annotate(
        f"peak {size_text(points[peak][1])}",
        (times[peak], mib[peak]),
        textcoords="offset points",
        xytext=(6, -12),
        color="#c62828",
    )
    ax.set_xlabel("simulated time in the step (ms)")
    ax.set_ylabel(f"live bytes beyond parameters ({unit})")
    ax.set_xlim(0, max(times[-1], 1e-9))
    ax.set_ylim(0, max(mib) * 1.15 or 1)
    ax.grid(True, color="#e0e0e0")
    fig.tight_layout()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "fsdp2_compile"}):  # read only when saving SVG
        fig.savefig(path, metadata={"Date": None} if path.endswith(".svg") else None)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------- the folder


def write_graph(record: GraphRecord, folder: str, title: str) -> None:
    """The per-pass text files, DOT and SVG of one compiled graph into `folder`."""
    os.makedirs(folder, exist_ok=True)
    for i, snap in enumerate(record.snapshots):
        with open(os.path.join(folder, f"{i:02d}_{snap.name}.txt"), "w") as f:
            f.write(f"# {title} graph after pass {i}: {snap.name}\n{annotate(snap)}")
    for name, same in _subgraph_calls(record).items():
        os.makedirs(os.path.join(folder, "subgraphs"), exist_ok=True)
        with open(os.path.join(folder, "subgraphs", f"{name}.txt"), "w") as f:
            f.write(f"# {title} graph: subgraph {name}, called {len(same)} time(s)\n{same[0].module().graph}")
    dot = os.path.join(folder, "graph.dot")
    write_dot(record.gm, dot, f"{title} graph")
    write_svg(record.gm, os.path.join(folder, "graph.svg"), f"{title} graph", dot)


def _subgraph_calls(record: GraphRecord) -> dict[str, list[SubgraphCall]]:
    """The calls of each block subgraph of a compiled graph (`block_gathers.py`), by identifier."""
    calls: dict[str, list[SubgraphCall]] = {}
    for call in filter(None, map(SubgraphCall.of, record.gm.graph.nodes)):
        calls.setdefault(call.identifier, []).append(call)
    return calls


def write_dump(
    records: list[GraphRecord],
    out_dir: str,
    profile: HardwareProfile | None = None,
    graphs: bool = True,
    memory_plot: str = "memory.png",
) -> str:
    """Write every artefact for `records` into `out_dir` and return the summary text; the memory chart is
    `memory_plot` in `out_dir` (.png or .svg)."""
    os.makedirs(out_dir, exist_ok=True)
    if graphs:
        for label, record in zip(_labels(records), records):
            write_graph(record, os.path.join(out_dir, label), label)
    timelines = _timelines(records, _profiles(records, profile))
    with open(os.path.join(out_dir, "trace.json"), "w") as f:
        json.dump(trace_events(records, timelines), f)
    points, _ = _memory_curve(records, timelines)
    write_memory_csv(points, os.path.join(out_dir, "memory.csv"))
    write_memory_plot(points, _graph_spans(records, timelines), os.path.join(out_dir, memory_plot))
    summary = summarize(records, profile)
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(summary)
    return summary


def dump_from_env(record: GraphRecord | None = None) -> None:
    """If $FSDP2_COMPILE_DUMP is set: write `record`'s graphs (default: the last compiled one), and the trace / memory /
    summary of every graph compiled so far, into `$FSDP2_COMPILE_DUMP/rank<r>` (the backend calls this for every
    compiled graph). A folder that cannot be written logs one warning and is not tried again: training goes on."""
    if not dump_requested():
        return
    root = os.environ[DUMP_ENV]
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    out_dir = os.path.join(root, f"rank{rank}")
    records = compiled_graphs()
    record = record or records[-1]
    labels = dict(zip(map(id, records), _labels(records)))
    label = labels.get(id(record), record.kind)
    try:
        write_graph(record, os.path.join(out_dir, label), label)
        write_dump(records, out_dir, graphs=False)
    except OSError as e:
        UNWRITABLE_DUMP_FOLDERS.add(root)
        logger.warning(
            "%s=%s: cannot write the debug dump to %s (%s); training continues without dumps. Point %s "
            "at a writable folder or unset it.",
            DUMP_ENV,
            root,
            out_dir,
            e.strerror or e,
            DUMP_ENV,
        )
