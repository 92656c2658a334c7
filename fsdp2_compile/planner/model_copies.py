"""The model copies a plan measures: each compiled through the pass pipeline for its collectives (`_GraphFigures`)
and one step of each played on the meta device for its ops (`StepTrace`); `_Copies` takes the full model's
figures from the 1- and 2-block copies'.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from fsdp2_compile.compiler.graph_records import clear_compiled_graphs, collective, compiled_graphs, is_tp
from fsdp2_compile.config import CompileConfig
from fsdp2_compile.core.ir import BUCKET, CollectiveArgs, Role
from fsdp2_compile.planner.activation_checkpointing import unwrap_checkpointing
from fsdp2_compile.planner.block_sharding import shard_for_plan
from fsdp2_compile.planner.full_model import _FullModel
from fsdp2_compile.planner.layout import Layout
from fsdp2_compile.planner.reduced_depth import reduced_copy, scale
from fsdp2_compile.planner.tensor_parallel import apply_tp, tp_local_copy
from fsdp2_compile.planner.trace import StepTrace, trace_step

__all__ = ["wire_bytes"]


@dataclass
class _GraphFigures:
    comm_wire: float
    buffers: dict[str, int]
    tp_wire: float = 0.0
    tp_buffers: dict[str, int] = field(default_factory=dict)
    tp_collectives: list[tuple[str, str, int, int]] = field(default_factory=list)
    """TP's collectives: (graph kind, collective kind, full buffer bytes, group size)."""
    backward_gathers: dict[str, int] = field(default_factory=dict)
    """Full buffer bytes backward all-gathers again, by bucket."""
    fsdp_collectives: list[tuple[str, Role, str, tuple[str, ...], int, int]] = field(default_factory=list)
    """FSDP's collectives in graph order: (graph kind, collective kind, bucket, parameter names, full buffer bytes,
    element size); with `param_rows`, what the search derives them from at another dp split."""
    param_rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Each managed parameter's (rows FSDP shards, elements per row of its shard)."""
    tp_graphs: list[int] = field(default_factory=list)
    """How many of `tp_collectives` each compiled graph holds, in order (`tp_wire` is summed graph by graph)."""

    def tp_counts(self, graph: str, kind: str) -> int:
        return sum(1 for g, k, _, _ in self.tp_collectives if g == graph and k == kind)


def _compile_and_measure(model, args, loss_fn, mesh, compile_kwargs, tp_mesh=None, tp_plan=None) -> _GraphFigures:
    """Bytes on the wire and collective buffers of the pipeline's final forward and backward graphs (FSDP's; TP's
    apart when `tp_mesh` is given and `tp_plan` is applied to the blocks first)."""
    from fsdp2_compile._torch_private import group_size
    from fsdp2_compile.api import make_backend
    from fsdp2_compile.runtime.sharding import managed_params

    unwrap_checkpointing(model)  # checkpointing changes no collective
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, tp_plan)
    shard_for_plan(
        model,
        mesh=mesh,
        reshard_after_forward=compile_kwargs["reshard_after_forward"],
        mp_policy=compile_kwargs["mp_policy"],
    )
    figures = _GraphFigures(0.0, {})
    for name, p, info in managed_params(model):
        figures.param_rows[name] = (info.dim0, math.prod((p.to_local() if isinstance(p, DTensor) else p).shape[1:]))
    clear_compiled_graphs()
    torch.compiler.reset()  # the copies are throwaway; without it a process that plans often hits recompile_limit
    # torch.compile on the sharded meta model directly: shard_compile's call wrapper refuses meta parameters
    # (a user's forward must not run on them), and the planner only needs the graphs
    compiled = torch.compile(model, backend=make_backend(compile_kwargs["compile_config"]))
    loss_fn(compiled(*args)).backward()
    records = [r for r in compiled_graphs() if r.kind in ("forward", "backward")]
    for r in records:
        figures.tp_graphs.append(len(figures.tp_collectives))
        for tp, buffers in ((False, figures.buffers), (True, figures.tp_buffers)):
            graph_wire, graph_buffers = wire_bytes(r.gm, tp=tp)
            if tp:
                figures.tp_wire += graph_wire
            else:
                figures.comm_wire += graph_wire
            for kind, size in graph_buffers.items():
                buffers[kind] = buffers.get(kind, 0) + size
        for node in r.gm.graph.nodes:
            c = collective(node)
            if c is not None and not is_tp(node):
                figures.fsdp_collectives.append(
                    (r.kind, c.kind, node.meta.get(BUCKET, ""), c.params, c.nbytes, c.dtype.itemsize)
                )
            if c is not None and is_tp(node):
                figures.tp_collectives.append(
                    (r.kind, str(c.kind), c.nbytes, group_size(CollectiveArgs.of(node).group_name))
                )
            elif c is not None and r.kind == "backward" and c.kind == Role.ALL_GATHER:
                bucket = node.meta.get(BUCKET, "")
                figures.backward_gathers[bucket] = figures.backward_gathers.get(bucket, 0) + c.nbytes
        figures.tp_graphs[-1] = len(figures.tp_collectives) - figures.tp_graphs[-1]
    clear_compiled_graphs()
    return figures


def wire_bytes(gm, tp: bool | None = None) -> tuple[float, dict[str, int]]:
    """(bytes one rank sends, full buffer bytes by collective kind) of a graph's collectives: a ring over the
    collective's own group of G ranks sends (G-1)/G of the buffer, twice that for an all-reduce. `tp`: None every
    collective, False FSDP's only, True tensor parallelism's only."""
    from fsdp2_compile._torch_private import group_size

    buffers: dict[str, int] = {}
    wire = 0.0
    for node in gm.graph.nodes:
        c = collective(node)
        if c is None or (tp is not None and is_tp(node) != tp):
            continue
        group = group_size(CollectiveArgs.of(node).group_name)
        buffers[c.kind] = buffers.get(c.kind, 0) + c.nbytes
        wire += (group - 1) / group * c.nbytes * (2 if c.kind == Role.ALL_REDUCE else 1)
    return wire, buffers


@dataclass
class _Copies:
    """The compiled graphs' figures and the traced steps of the 1- and 2-block copies (or of the whole model when
    it has no more than 2 blocks), and how to take the full model's figures from them."""

    layers: int
    reduce: bool
    """Figures come from the 1- and 2-block copies."""
    figures: list[_GraphFigures]
    traces: list[StepTrace]
    full_traces: list[StepTrace]
    """Under TP: the unsplit copies' traces (for the model's FLOPs); else empty."""
    hows: list[str]
    tp_left: list[str]
    """Under TP: the modules the TP-local copy left whole."""

    def extrapolate(self, values: list[float]) -> float:
        """The full model's figure from the copies' (linear in the block count)."""
        return scale(values[0], values[1], self.layers) if self.reduce else values[0]

    def split(self, values: list[float]) -> tuple[float, float]:
        """(one block's share, the rest outside the blocks) of the copies' figures; (0, the figure) unreduced."""
        if not self.reduce:
            return 0.0, values[0]
        block = values[1] - values[0]
        return block, values[0] - block

    @property
    def reduction(self) -> str:
        return (
            f"1- and 2-block copies ({self.hows[0]}; {self.hows[1]}), scaled linearly to {self.layers} blocks"
            if self.reduce
            else "the full model"
        )


def _compile_and_trace_copies(
    factory: Callable,
    layout: Layout,
    call: Callable,
    meshes: tuple,
    full: _FullModel,
    ac_used: str,
    hardware: str,
    step: Callable,
) -> _Copies:
    """Compile each copy through the pipeline (its collectives) and play one step of it on meta (its ops)."""
    copies = _compile_copies(factory, layout, call, meshes, full, hardware, step)
    _trace_copies(copies, factory, layout, call, full, ac_used, step)
    return copies


def _compile_copies(
    factory: Callable, layout: Layout, call: Callable, meshes: tuple, full: _FullModel, hardware: str, step: Callable
) -> _Copies:
    """The copies' compiled graphs' figures (`_Copies` without traces)."""
    mesh, tp_mesh = meshes
    compile_kwargs = {
        "reshard_after_forward": layout.reshard_after_forward,
        "mp_policy": layout.mp_policy,
        "compile_config": CompileConfig(hardware=hardware, check_rank_consistency=False),
    }
    reduce = full.has_blocks and full.layers > 2
    copies = _Copies(full.layers, reduce, [], [], [], [], [])
    for n in (1, 2) if reduce else (None,):
        what = f"a {n}-block copy" if n else "the model"
        step(f"compiling {what} through the pipeline")
        model, args, loss_fn, how = reduced_copy(factory, n, call) if n else (*call(factory), "")
        args = _microbatch(args, layout, full)
        copies.figures.append(_compile_and_measure(model, args, loss_fn, mesh, compile_kwargs, tp_mesh, full.tp_plan))
        copies.hows.append(how)
    return copies


def _trace_copies(
    copies: _Copies,
    factory: Callable,
    layout: Layout,
    call: Callable,
    full: _FullModel,
    ac_used: str,
    step: Callable,
    unsplit: list[StepTrace] | None = None,
) -> None:
    """Play one step of each copy on the meta device (its ops), into `copies.traces` (and, under TP, the unsplit
    copies into `copies.full_traces`, or `unsplit` when given: the same copies traced without TP)."""
    param_dtype = layout.mp_policy.param_dtype
    for n in (1, 2) if copies.reduce else (None,):
        what = f"a {n}-block copy" if n else "the model"
        local = " (one TP rank's share)" if layout.tp > 1 else ""
        local += " for one micro-batch" if layout.pp > 1 else ""
        step(f"playing one step of {what}{local} on the meta device ({layout.attention} attention, AC {ac_used})")
        model, args, loss_fn, _ = reduced_copy(factory, n, call) if n else (*call(factory), "")
        args = _microbatch(args, layout, full)
        if layout.tp > 1:
            copies.tp_left = tp_local_copy(model, full.tp_plan, layout.tp)
        copies.traces.append(
            trace_step(model, args, loss_fn, attention=layout.attention, ac=ac_used, param_dtype=param_dtype)
        )
        if layout.tp > 1 and unsplit is not None:
            copies.full_traces = list(unsplit)
        elif layout.tp > 1:  # the unsplit model's FLOPs, for MFU
            model, args, loss_fn, _ = reduced_copy(factory, n, call) if n else (*call(factory), "")
            args = _microbatch(args, layout, full)
            copies.full_traces.append(
                trace_step(model, args, loss_fn, attention=layout.attention, ac=ac_used, param_dtype=param_dtype)
            )


def _microbatch(args: tuple, layout: Layout, full: _FullModel) -> tuple:
    """Under pp, the factory's inputs cut to one micro-batch (the first local_batch / M rows of each tensor with
    that batch dim, as torch's pipelining splits them); else as they are."""
    if layout.pp == 1:
        return args
    rows = full.local_batch // (layout.microbatches or full.local_batch)
    return tuple(a[:rows] if isinstance(a, torch.Tensor) and a.dim() > 0 else a for a in args)


def _memo(trace: StepTrace, fn: Callable, *args, **kwargs):
    """`fn(trace, *args, **kwargs)`, kept on the trace by its arguments (a trace does not change once played; the
    search evaluates many layouts on one). Devices are module constants, keyed by identity."""
    memo = trace.__dict__.setdefault("_figures_memo", {})
    key = (fn, *(id(a) if hasattr(a, "efficiency") else a for a in args), *sorted(kwargs.items()))
    if key not in memo:
        memo[key] = fn(trace, *args, **kwargs)
    return memo[key]
