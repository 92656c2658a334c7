"""The planner's search: every layout and knob of a training step at N ranks and a global batch, planned as
`make_plan` plans one, those that fit the device's memory ranked by tokens/s per GPU.

Enumerated: tp (dividing N, the attention heads, at most a node's 8 GPUs on the H100 profiles), pp (dividing N / tp,
at most the block count; schedules 1F1B and Interleaved1F1B with micro-batches of one sample, or with pp pinned
every micro-batch count of at least pp that divides the local batch), HSDP replicas
(dividing the data-parallel size), activation checkpointing (none, selective, full), reshard_after_forward (FSDP2's
default or False; under pp the pipeline keeps stages gathered), prefetch depth (1, 2), keep_gathered (none, half,
all of the resharded bytes) and float8 where the device has it. The local batch is the global batch / dp.

The stages of `make_plan` are shared between candidates by what each depends on (`plan.py`): the full model is
sharded once per tp and its figures at another dp split derived from its parameters' shapes; each copy is compiled
once per (tp, shard size 1 or more) with FSDP's collectives derived for the candidate's shard size, replicas and
resharding, and TP's for its rows per micro-batch (those that carry the activations scale with the rows, the rest
keep their bytes: learned from the first tp compiled at two row counts); each copy is traced once per (tp,
activation checkpointing, rows). A derivation is checked against the stage it comes from, and a stage whose check
fails is built for each candidate.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fsdp2_compile.core.ir import Role
from fsdp2_compile.core.ops import padded_rows
from fsdp2_compile.debug.sizes import size_text
from fsdp2_compile.planner.devices import device_for
from fsdp2_compile.planner.plan import (
    ADAMW_STATES,
    Layout,
    Plan,
    _assemble,
    _check_pipeline_fits,
    _compile_copies,
    _Copies,
    _FullModel,
    _GraphFigures,
    _itemsize,
    _outside_parts,
    _ParamRow,
    _shard_full_model,
    _trace_copies,
    tokens_of,
)
from fsdp2_compile.planner.reduced_depth import block_list, reduced_copy
from fsdp2_compile.planner.tensor_parallel import plan_meshes

__all__ = [
    "DEVICE_MEMORY",
    "Candidate",
    "Scored",
    "SearchResult",
    "enumerate_candidates",
    "format_search",
    "plan_candidates",
    "search",
]

DEVICE_MEMORY = {"h100-nvlink": 80 * 2**30, "h100-infiniband": 80 * 2**30}
"""Device memory by profile: the common H100 SXM's 80 GB (torchtitan's published H100 runs had 96 GB: pass
`device_memory` for such devices); a CPU profile needs the budget given."""

NODE_GPUS = {"h100-nvlink": 8, "h100-infiniband": 8}
"""GPUs per node by profile: tensor parallelism stays inside one."""

MEMORY_BINDS = 0.9
"""A candidate whose reserved peak is at least this fraction of the device's memory is bound by memory."""


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    local_batch: int
    """Samples per data-parallel rank per step (the factory's `batch=`)."""


@dataclass
class Scored:
    """A candidate's plan on the searched profile and what binds it."""

    candidate: Candidate
    plan: Plan
    profile: str
    device_memory: int

    @property
    def tokens_per_s(self) -> float:
        return self.plan.tokens_per_s_per_rank[self.profile]

    @property
    def reserved(self) -> int:
        return self.plan.peak_reserved_bytes[self.profile]

    @property
    def step_s(self) -> float:
        return self.plan.step_time_s[self.profile]

    @property
    def compute_s(self) -> float:
        return sum(self.plan.compute_s[self.profile].values())

    @property
    def exposed_s(self) -> float:
        return self.plan.exposed_comm_s[self.profile]

    @property
    def bubble_s(self) -> float:
        return self.plan.bubble_s.get(self.profile, 0.0)

    @property
    def fits(self) -> bool:
        return self.reserved <= self.device_memory

    @property
    def binds(self) -> str:
        """memory (reserved >= MEMORY_BINDS of the device), else the largest share of the step: compute, link
        (exposed communication) or bubble."""
        if self.reserved >= MEMORY_BINDS * self.device_memory:
            return "memory"
        shares = {"compute": self.compute_s, "link": self.exposed_s, "bubble": self.bubble_s}
        return max(shares, key=shares.get)

    def to_json(self) -> dict:
        lay = self.candidate.layout
        return {
            "layout": layout_json(lay),
            "local_batch": self.candidate.local_batch,
            "tokens_per_s_per_gpu": self.tokens_per_s,
            "step_time_s": self.step_s,
            "compute_s": self.compute_s,
            "exposed_comm_s": self.exposed_s,
            "bubble_s": self.bubble_s,
            "peak_reserved_bytes": self.reserved,
            "device_memory_bytes": self.device_memory,
            "mfu": self.plan.mfu[self.profile],
            "binds": self.binds,
        }


def layout_json(lay: Layout) -> dict:
    """The layout's fields as JSON (the mixed precision policy's dtypes by name)."""
    out = {f.name: getattr(lay, f.name) for f in dataclasses.fields(lay) if f.name != "mp_policy"}
    mp = lay.mp_policy
    out["mp_policy"] = {
        "param_dtype": str(mp.param_dtype).removeprefix("torch.") if mp.param_dtype else None,
        "reduce_dtype": str(mp.reduce_dtype).removeprefix("torch.") if mp.reduce_dtype else None,
    }
    return out


@dataclass
class SearchResult:
    world_size: int
    global_batch: int
    profile: str
    device_memory: int
    enumerated: int
    pruned: dict[str, int]
    evaluated: int
    fitting: int
    top: list[Scored]
    wall_s: float = 0.0
    stages: dict[str, int] = field(default_factory=dict)
    """How many times each stage was built (real shards, compiles, traces)."""

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "hardware": self.profile,
            "device_memory_bytes": self.device_memory,
            "enumerated": self.enumerated,
            "pruned": self.pruned,
            "evaluated": self.evaluated,
            "fitting": self.fitting,
            "wall_s": self.wall_s,
            "stages_built": self.stages,
            "top": [s.to_json() for s in self.top],
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _replicas(dp: int, tp: int, node: int, world_size: int) -> list[int]:
    """HSDP replica counts: every divisor of dp within one node; beyond one node, 1 and the count that shards
    each parameter over one node's GPUs (shard x tp = node, shard > 1: not DDP), HSDP's usual layout."""
    if world_size <= node:
        return _divisors(dp)
    return [r for r in _divisors(dp) if r == 1 or (dp // r * tp == node and dp // r > 1)]


HEAD_ATTRS = ("n_heads", "n_kv_heads", "num_heads", "num_attention_heads", "num_key_value_heads", "n_head")
"""Attributes naming a head count, on a module or its `cfg` / `config`: tensor parallelism splits heads whole."""


def _heads(model: torch.nn.Module) -> int | None:
    """The largest count that divides every head count the model names (query and key-value heads), or None."""
    counts = set()
    for module in model.modules():
        for owner in (module, getattr(module, "cfg", None), getattr(module, "config", None)):
            for attr in HEAD_ATTRS:
                value = getattr(owner, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    counts.add(value)
    return math.gcd(*counts) if counts else None


def enumerate_candidates(
    world_size: int,
    global_batch: int,
    layers: int,
    heads: int | None,
    profile: str,
    *,
    base: Layout,
    degrees: dict[str, int | None],
) -> tuple[list[Candidate], dict[str, int], int]:
    """(candidates, pruned count by rule, enumerated count). `base` gives the fixed knobs (mp, attention,
    compiler); `degrees` pins tp / pp / replicate where not None."""
    pruned: dict[str, int] = {}
    enumerated = 0

    def prune(rule: str, n: int = 1) -> None:
        pruned[rule] = pruned.get(rule, 0) + n

    node = NODE_GPUS.get(profile, world_size)
    float8 = (
        [False, True] if device_for(profile).float8_flops and base.mp_policy.param_dtype == torch.bfloat16 else [False]
    )
    pipeline_knobs = [
        (s, f8, ac) for s in ("1F1B", "Interleaved1F1B") for f8 in float8 for ac in ("none", "selective", "full")
    ]
    flat_knobs = [
        (r, pre, keep, f8, ac)
        for r, keep in ((None, None), (None, 0.5), (None, 1.0), (False, None))  # nothing to keep without resharding
        for pre in (1, 2)
        for f8 in float8
        for ac in ("none", "selective", "full")
    ]
    out = []
    for tp in [degrees["tp"]] if degrees["tp"] else _divisors(world_size):
        for pp in [degrees["pp"]] if degrees["pp"] else _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            reps = [degrees["replicate"]] if degrees["replicate"] else _replicas(dp, tp, node, world_size)
            local = global_batch // dp
            # micro-batches of one sample; with pp pinned (few candidates), each count of at least pp dividing the
            # local batch
            counts = (degrees["pp"] and [m for m in _divisors(local) if m >= pp]) or [local]
            n_knobs = len(pipeline_knobs) * len(counts) if pp > 1 else len(flat_knobs)
            enumerated += len(reps) * n_knobs
            rule = None
            if tp > node:
                rule = f"tp > {node} (one node)"
            elif heads is not None and heads % tp:
                rule = "tp does not divide the attention (key-value) heads"
            elif pp > 1 and pp > layers:
                rule = f"pp > the {layers} blocks"
            elif global_batch % dp:
                rule = "global batch not a multiple of dp"
            if rule:
                prune(rule, len(reps) * n_knobs)
                continue
            for rep in reps:
                if pp == 1:
                    for reshard, pre, keep, f8, ac in flat_knobs:
                        lay = dataclasses.replace(
                            base,
                            world_size=world_size,
                            replicate=rep,
                            tp=tp,
                            reshard_after_forward=reshard,
                            prefetch=pre,
                            keep_gathered=keep,
                            float8=f8,
                            ac=ac,
                        )
                        out.append(Candidate(lay, local))
                    continue
                for (schedule, f8, ac), m in itertools.product(pipeline_knobs, counts):
                    v = 2 if schedule == "Interleaved1F1B" else 1
                    if pp * v > layers:
                        prune("pp x stages per rank > blocks")
                        continue
                    if m < pp or (v > 1 and m % pp):
                        prune("micro-batches fewer than pp, or not a multiple of pp (interleaved)")
                        continue
                    lay = dataclasses.replace(
                        base,
                        world_size=world_size,
                        replicate=rep,
                        tp=tp,
                        pp=pp,
                        pp_schedule=schedule,
                        microbatches=m,
                        reshard_after_forward=None,
                        float8=f8,
                        ac=ac,
                        keep_gathered=None,
                        memory_budget_bytes=None,
                    )
                    out.append(Candidate(lay, local))
    return out, pruned, enumerated


class _Stages:
    """make_plan's stages, each built once per what it depends on and derived for the rest."""

    def __init__(self, factory: Callable, call: Callable, profile: str, step: Callable):
        self.factory, self.call, self.profile, self.step = factory, call, profile, step
        self.refs: dict = {}
        self.fulls: dict = {}
        self.compiled: dict = {}
        self.traces: dict = {}
        self.args: dict = {}
        self.outside: dict | None = None
        self.exact_full: set = set()
        self.exact_compile: set = set()
        self.row_refs: dict = {}
        self.row_rule: list | None | bool = None
        self.built = {"full model shards": 0, "copy compiles": 0, "copy traces": 0}

    def call_for(self, batch: int) -> Callable:
        return lambda f, **kw: self.call(f, batch=batch, **kw)

    def args_for(self, batch: int) -> tuple:
        if batch not in self.args:
            self.args[batch] = reduced_copy(self.factory, 1, self.call_for(batch))[1]
        return self.args[batch]

    def full(self, cand: Candidate) -> _FullModel:
        lay = cand.layout
        key = (
            lay.tp,
            lay.world_size // (lay.pp * lay.tp),
            lay.replicate,
            lay.pp,
            lay.v,
            lay.microbatches,
            lay.float8,
            lay.reshard_after_forward,
            cand.local_batch,
        )
        if key in self.fulls:
            return self.fulls[key]
        if lay.tp not in self.refs:
            ref_layout = Layout(lay.world_size, tp=lay.tp, mp_policy=lay.mp_policy)
            self.built["full model shards"] += 1
            ref = _shard_full_model(
                self.factory,
                ref_layout,
                self.call_for(cand.local_batch),
                plan_meshes(lay.world_size, 1, lay.tp, 1),
                self.step,
            )
            self.refs[lay.tp] = ref
            if _comparable(self.derive_full(ref, ref_layout, cand.local_batch)) != _comparable(ref):
                self.exact_full.add(lay.tp)
        if lay.tp in self.exact_full:
            self.built["full model shards"] += 1
            full = _shard_full_model(
                self.factory,
                lay,
                self.call_for(cand.local_batch),
                plan_meshes(lay.world_size, lay.replicate, lay.tp, lay.pp),
                self.step,
            )
        else:
            full = self.derive_full(self.refs[lay.tp], lay, cand.local_batch)
        self.fulls[key] = full
        return full

    def derive_full(self, ref: _FullModel, lay: Layout, batch: int) -> _FullModel:
        """The full model's figures at `lay` from the parameters' shapes (`_ShardFacts`), as `_shard_full_model`
        takes them from the real shard."""
        f = ref.facts
        s, tp = lay.shard_size, lay.tp

        def ranks(tp_sharded: bool) -> int:
            return s * tp if tp_sharded else s

        analytical = {
            "params": sum(nb / ranks(t) for nb, t, _, _ in f.unique),
            "grads": sum(nb / ranks(t) for nb, t, g, _ in f.unique if g),
            "optimizer": sum(ADAMW_STATES * 4 * n / ranks(t) for _, t, g, n in f.unique if g),
        }
        by_name = {
            name: {
                "params": nb / ranks(t),
                "grads": nb / ranks(t) if g else 0.0,
                "optimizer": ADAMW_STATES * 4 * n / ranks(t) if g else 0.0,
            }
            for name, nb, t, g, n in f.named
        }
        if lay.pp > 1 and self.outside is None:
            self.outside = _outside_parts(self.factory, self.call_for(batch))
        outside = self.outside if lay.pp > 1 else {}
        param_dtype = lay.mp_policy.param_dtype or f.float_dtype
        itemsize = _itemsize(param_dtype)
        measured = {"params": 0, "grads": 0, "optimizer": 0}
        numel: dict[str, int] = {}
        sizes: dict[str, int] = {}
        rows = []
        for m in f.managed:
            local = padded_rows(m.dim0, s) * m.trailing if m.dim0 else 0
            full_numel = padded_rows(m.dim0, s) * s * m.trailing
            state = {
                "params": local * m.itemsize,
                "grads": local * m.itemsize if m.requires_grad else 0,
                "optimizer": ADAMW_STATES * 4 * local if m.requires_grad else 0,
            }
            for k in measured:
                measured[k] += state[k]
            numel[m.bucket] = numel.get(m.bucket, 0) + full_numel
            part = m.block if m.block is not None else outside.get(m.name, "first")
            size = 1 if lay.float8 and m.block is not None and m.linear else itemsize
            rows.append(_ParamRow(part, m.bucket, full_numel, full_numel * size, state, by_name[m.name]))
            resharded = m.bucket != "" if lay.reshard_after_forward is None else bool(lay.reshard_after_forward)
            if resharded:
                sizes[m.bucket] = sizes.get(m.bucket, 0) + m.global_numel * itemsize
        buckets: dict[str, int] = {}
        for row in rows:
            buckets[row.bucket] = buckets.get(row.bucket, 0) + row.gathered_bytes
        args = self.args_for(batch)
        blocks = [None] * ref.layers if ref.has_blocks else None
        return _FullModel(
            params=ref.params,
            tokens=tokens_of(args),
            block_path=ref.block_path,
            has_blocks=ref.has_blocks,
            layers=ref.layers,
            given_ac=ref.given_ac,
            tp_plan=ref.tp_plan,
            tp_text=ref.tp_text,
            analytical=analytical,
            measured=measured,
            numel=numel,
            buckets={b: buckets[b] for b in numel},
            resharded={b: sizes[b] for b in sorted(sizes, key=lambda b: b == "")},
            param_dtype=param_dtype,
            reduce_dtype=lay.mp_policy.reduce_dtype or param_dtype,
            rows=rows,
            local_batch=_check_pipeline_fits(lay, args, ref.block_path, blocks),
            facts=f,
        )

    def copies(self, cand: Candidate, full: _FullModel, ac_used: str) -> _Copies:
        lay = cand.layout
        rows = cand.local_batch // (lay.microbatches or cand.local_batch) if lay.pp > 1 else cand.local_batch
        s = lay.shard_size
        key = (lay.tp, rows if lay.tp > 1 else None, s == 1)
        if key in self.exact_compile:
            exact = (key, lay.world_size, lay.replicate, lay.pp, s, lay.reshard_after_forward)
            if exact not in self.compiled:
                self.compiled[exact] = self._compile(lay, full, cand.local_batch)
            figures_copies = self.compiled[exact]
            figures = figures_copies.figures
        else:
            if key not in self.compiled and lay.tp > 1:
                self.compiled[key] = self._rows_derived(lay.tp, s == 1, rows)
            if self.compiled.get(key) is None:
                ref_layout = dataclasses.replace(lay, reshard_after_forward=None, keep_gathered=None)
                ref = self._compile(ref_layout, full, cand.local_batch)
                self.compiled[key] = (ref, ref_layout.shard_size, ref_layout.replicate)
                again = [_figures_at(g, ref_layout.shard_size, ref_layout.replicate, False) for g in ref.figures]
                if any(_fig_key(a) != _fig_key(g) for a, g in zip(again, ref.figures, strict=True)):
                    self.exact_compile.add(key)
                    return self.copies(cand, full, ac_used)
                if lay.tp > 1:
                    self._learn_rows(lay.tp, s == 1, rows, self.compiled[key])
            figures_copies = self.compiled[key][0]
            no_reshard = lay.reshard_after_forward is False
            figures = [_figures_at(g, s, lay.replicate, no_reshard) for g in figures_copies.figures]
        tkey = (lay.tp, ac_used, rows)
        if tkey not in self.traces:
            traced = _Copies(full.layers, figures_copies.reduce, [], [], [], [], [])
            self.built["copy traces"] += 1
            unsplit = self.traces.get((1, ac_used, rows))  # the same copies without TP
            _trace_copies(
                traced,
                self.factory,
                lay,
                self.call_for(cand.local_batch),
                full,
                ac_used,
                self.step,
                unsplit=unsplit.traces if unsplit is not None else None,
            )
            self.traces[tkey] = traced
        traced = self.traces[tkey]
        return _Copies(
            full.layers,
            figures_copies.reduce,
            figures,
            traced.traces,
            traced.full_traces,
            figures_copies.hows,
            traced.tp_left,
        )

    def _rows_derived(self, tp: int, single: bool, rows: int) -> tuple | None:
        """The copies' compile at `rows` per micro-batch from this tp's compile at other rows (`_rows_at` with the
        learned rule), or None where it has to be compiled."""
        ref = self.row_refs.get((tp, single))
        if ref is None or not self.row_rule or ref[0] == rows or len(ref[1][0].figures) != len(self.row_rule):
            return None
        (r0, (copies, shard, replicate)) = ref
        figures = [_rows_at(g, rule, r0, rows) for g, rule in zip(copies.figures, self.row_rule, strict=True)]
        if any(f is None for f in figures):
            return None
        return _Copies(copies.layers, copies.reduce, figures, [], [], copies.hows, []), shard, replicate

    def _learn_rows(self, tp: int, single: bool, rows: int, compiled: tuple) -> None:
        """Keep the first compile of each tp as the one other rows are derived from; at the first tp compiled at two
        rows, learn which of TP's collectives scale with the rows (the activations') and which do not (a replicated
        parameter's gradient), and keep the rule only if it gives the second compile's figures exactly."""
        ref = self.row_refs.setdefault((tp, single), (rows, compiled))
        if self.row_rule is not None or ref[0] == rows:
            return
        (r0, (copies0, _, _)), (copies1, shard1, replicate1) = ref, compiled
        self.row_rule = False
        if copies0.hows != copies1.hows or copies0.reduce != copies1.reduce:
            return
        rule = [_rows_rule(g0, g1, r0, rows) for g0, g1 in zip(copies0.figures, copies1.figures, strict=True)]
        if any(r is None for r in rule):
            return
        derived = [_rows_at(g, r, r0, rows) for g, r in zip(copies0.figures, rule, strict=True)]
        if all(
            d is not None and _figures_at(d, shard1, replicate1, False) == _figures_at(g, shard1, replicate1, False)
            for d, g in zip(derived, copies1.figures, strict=True)
        ):
            self.row_rule = rule

    def _compile(self, lay: Layout, full: _FullModel, batch: int) -> _Copies:
        self.built["copy compiles"] += 1
        meshes = plan_meshes(lay.world_size, lay.replicate, lay.tp, lay.pp)
        return _compile_copies(self.factory, lay, self.call_for(batch), meshes, full, self.profile, self.step)


def _comparable(full: _FullModel) -> tuple:
    return (
        full.analytical,
        full.measured,
        full.numel,
        full.buckets,
        full.resharded,
        full.rows,
        full.tokens,
        full.local_batch,
        full.param_dtype,
        full.reduce_dtype,
    )


def _fig_key(g: _GraphFigures) -> tuple:
    return g.comm_wire, g.buffers, g.backward_gathers


def _rows_rule(g0: _GraphFigures, g1: _GraphFigures, r0: int, r1: int) -> list[tuple[str, str, bool]] | None:
    """(graph, kind, scales) of each of TP's collectives: whether its bytes scale with the rows per micro-batch (x r1
    / r0 from r0 to r1) or stay as they are, from one copy compiled at r0 and at r1 rows; None where one does
    neither or the graphs differ otherwise."""
    if g0.tp_graphs != g1.tp_graphs or len(g0.tp_collectives) != len(g1.tp_collectives):
        return None
    rule = []
    for (gk0, k0, b0, n0), (gk1, k1, b1, n1) in zip(g0.tp_collectives, g1.tp_collectives, strict=True):
        if (gk0, k0, n0) != (gk1, k1, n1) or (b0 * r1 != b1 * r0 and b0 != b1):
            return None
        rule.append((gk0, k0, b0 != b1))
    return rule


def _rows_at(g: _GraphFigures, rule: list[tuple[str, str, bool]], r0: int, rows: int) -> _GraphFigures | None:
    """`g` (a copy compiled at r0 rows per micro-batch) at `rows`: TP's collectives that `rule` says scale with the
    rows times rows / r0, the others and FSDP's as compiled; TP's wire and buffers summed again as
    `_compile_and_measure` sums them. None where the rule's collectives are not `g`'s or a size is no whole byte."""
    if [(graph, kind) for graph, kind, _ in rule] != [(graph, kind) for graph, kind, _, _ in g.tp_collectives]:
        return None
    collectives = []
    for (graph, kind, nbytes, group), (_, _, scales) in zip(g.tp_collectives, rule, strict=True):
        if scales and nbytes * rows % r0:
            return None
        collectives.append((graph, kind, nbytes * rows // r0 if scales else nbytes, group))
    wire, buffers, i = 0.0, {}, 0
    for count in g.tp_graphs:
        graph_wire = 0.0
        for _, kind, nbytes, group in collectives[i : i + count]:
            buffers[Role(kind)] = buffers.get(Role(kind), 0) + nbytes
            graph_wire += (group - 1) / group * nbytes * (2 if kind == Role.ALL_REDUCE else 1)
        wire += graph_wire
        i += count
    return dataclasses.replace(g, tp_wire=wire, tp_buffers=buffers, tp_collectives=collectives)


def _figures_at(g: _GraphFigures, shard_size: int, replicate: int, no_reshard: bool) -> _GraphFigures:
    """The graph figures of a copy compiled at another dp split: FSDP's collectives' buffers at `shard_size` (each
    parameter padded to a multiple of it), an all-reduce over the replicas after each gradient reduction when
    `replicate` > 1, no backward all-gather with `no_reshard`; TP's as compiled."""
    out = _GraphFigures(0.0, {}, g.tp_wire, g.tp_buffers, g.tp_collectives, {}, [], g.param_rows, g.tp_graphs)
    graph_wire: dict[str, float] = {}
    for graph, kind, bucket, params, _, itemsize in g.fsdp_collectives:
        if kind == Role.ALL_REDUCE or (no_reshard and graph == "backward" and kind == Role.ALL_GATHER):
            continue
        numel = sum(padded_rows(d, shard_size) * t for d, t in (g.param_rows[p] for p in params))
        entries = [(kind, numel * shard_size * itemsize, shard_size)]
        if replicate > 1 and kind in (Role.REDUCE_SCATTER, Role.ALL_TO_ALL):
            entries.append((Role.ALL_REDUCE, numel * itemsize, replicate))
        for k, nbytes, group in entries:
            out.fsdp_collectives.append((graph, k, bucket, params, nbytes, itemsize))
            out.buffers[k] = out.buffers.get(k, 0) + nbytes
            if group > 1:
                wire = (group - 1) / group * nbytes * (2 if k == Role.ALL_REDUCE else 1)
            else:
                wire = 0.0
            graph_wire[graph] = graph_wire.get(graph, 0.0) + wire
            if graph == "backward" and k == Role.ALL_GATHER:
                out.backward_gathers[bucket] = out.backward_gathers.get(bucket, 0) + nbytes
    for wire in graph_wire.values():
        out.comm_wire += wire
    return out


def search(
    factory: Callable,
    world_size: int,
    global_batch: int,
    profile: str,
    *,
    base: Layout,
    call: Callable = lambda f, **kw: f(**kw),
    device_memory: int | None = None,
    degrees: dict[str, int | None] | None = None,
    top: int = 5,
    progress: Callable[[str], object] | None = None,
) -> SearchResult:
    """Plan every candidate layout of `factory`'s model at `world_size` ranks and `global_batch` samples per step
    on `profile`, and rank those whose reserved peak fits `device_memory` by tokens/s per GPU. Needs the default
    process group of `world_size` ranks (the fake one). ValueError when nothing is left to plan or nothing fits."""
    start = time.perf_counter()
    step = progress or (lambda msg: None)
    degrees = degrees or {"tp": None, "pp": None, "replicate": None}
    if device_memory is None:
        if profile not in DEVICE_MEMORY:
            raise ValueError(
                f"profile {profile!r} has no device memory on record; pass device_memory (--device-memory BYTES)"
            )
        device_memory = DEVICE_MEMORY[profile]
    name = getattr(factory, "__name__", repr(factory))
    if "batch" not in inspect.signature(factory).parameters:
        raise ValueError(
            f"factory {name}() takes no batch=: the search builds each layout's local batch (global "
            "batch / dp) through it; give the factory a batch= argument (dim 0 of its inputs)"
        )
    step("building a 1-block copy for the model's blocks and heads")
    model = reduced_copy(factory, 1, lambda f, **kw: call(f, batch=1, **kw))[0]
    heads = _heads(model)
    layers = _block_count(factory, call)
    cands, pruned, enumerated = enumerate_candidates(
        world_size, global_batch, layers, heads, profile, base=base, degrees=degrees
    )
    if not cands:
        raise ValueError(_nothing_left(world_size, global_batch, pruned, degrees))
    step(f"planning {len(cands):,} candidates ({enumerated:,} enumerated)")
    scored, built = plan_candidates(factory, cands, profile, device_memory, call=call, progress=step)
    fitting = [s for s in scored if s.fits]
    if not fitting:
        best = min(scored, key=lambda s: s.reserved)
        raise ValueError(
            f"no layout fits: the smallest reserved peak, at {describe(best.candidate)}, is "
            f"{size_text(best.reserved)}, {size_text(best.reserved - device_memory)} over the device's "
            f"{size_text(device_memory)} ({profile}, {len(scored):,} layouts planned); use more ranks, a smaller "
            "global batch, or a larger --device-memory"
        )
    fitting.sort(key=lambda s: (-s.tokens_per_s, s.reserved))
    return SearchResult(
        world_size,
        global_batch,
        profile,
        device_memory,
        enumerated,
        pruned,
        len(scored),
        len(fitting),
        fitting[:top],
        time.perf_counter() - start,
        built,
    )


def plan_candidates(
    factory: Callable,
    cands: list[Candidate],
    profile: str,
    device_memory: int,
    *,
    call: Callable = lambda f, **kw: f(**kw),
    progress: Callable[[str], object] | None = None,
) -> tuple[list[Scored], dict[str, int]]:
    """Each candidate's plan on `profile` (as `make_plan(factory, layout, call=<call with batch=local_batch>)`'s),
    the stages shared between them; and how many times each stage was built."""
    stages = _Stages(factory, call, profile, progress or (lambda msg: None))
    scored = []
    for cand in cands:
        full = stages.full(cand)
        ac_used = "as given" if full.given_ac else cand.layout.ac
        copies = stages.copies(cand, full, ac_used)
        plan = _assemble(cand.layout, full, copies, [profile])
        scored.append(Scored(cand, plan, profile, device_memory))
    return scored, stages.built


def _block_count(factory: Callable, call: Callable) -> int:
    """Blocks of the full model: the factory's default `layers`, else its model's block list (built once)."""
    default = inspect.signature(factory).parameters.get("layers")
    if default is not None and isinstance(default.default, int):
        return default.default
    model = call(factory, batch=1)[0]
    _, blocks = block_list(model)
    return len(blocks) if blocks is not None else 0


def _nothing_left(world_size: int, global_batch: int, pruned: dict[str, int], degrees: dict) -> str:
    pinned = ", ".join(f"{k} {v}" for k, v in degrees.items() if v)
    rules = "; ".join(f"{rule}: {n:,}" for rule, n in pruned.items())
    if "global batch not a multiple of dp" in pruned and len(pruned) == 1:
        return (
            f"global batch {global_batch} is not a multiple of the data-parallel size of any layout "
            f"(dp = {world_size} / (tp x pp){', ' + pinned if pinned else ''}); pass a global batch that is a "
            "multiple of one, e.g. of " + str(world_size // ((degrees.get("tp") or 1) * (degrees.get("pp") or 1)))
        )
    return f"no layout left to plan at {world_size} ranks, global batch {global_batch} ({rules})"


def describe(cand: Candidate) -> str:
    """A layout in a few words: the mesh and the knobs that differ from the defaults."""
    lay = cand.layout
    dims = [("pp", lay.pp), ("replicate", lay.replicate), ("dp", lay.shard_size), ("tp", lay.tp)]
    mesh = " x ".join(f"{name} {n}" for name, n in dims if n > 1 or name == "dp")
    words = [mesh, f"AC {lay.ac}", f"local batch {cand.local_batch}"]
    if lay.pp > 1:
        words.append(f"{lay.pp_schedule}, {lay.microbatches} micro-batches")
    else:
        words.append("reshard" if lay.reshard_after_forward is not False else "no reshard")
        words.append(f"prefetch {lay.prefetch}")
        if lay.keep_gathered is not None:
            words.append(f"keep {lay.keep_gathered:g}")
    if lay.float8:
        words.append("float8")
    return ", ".join(words)


def _secs(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def format_search(result: SearchResult) -> str:
    pruned = ", ".join(f"{rule} {n:,}" for rule, n in result.pruned.items()) or "none"
    out = [
        f"search: {result.world_size:,} ranks, global batch {result.global_batch:,}, {result.profile}, device memory "
        f"{size_text(result.device_memory)}",
        f"  {result.enumerated:,} enumerated, {sum(result.pruned.values()):,} pruned ({pruned}), "
        f"{result.evaluated:,} planned, {result.fitting:,} fit; "
        + ", ".join(f"{n} {what}" for what, n in result.stages.items())
        + f"; {result.wall_s:.1f} s",
        "",
        f"  {'#':<3}{'tokens/s/GPU':>13}{'step':>10}{'compute':>10}{'exp. comm':>10}{'bubble':>10}"
        f"{'reserved / device':>24}{'MFU':>7}  {'binds':<8} layout",
    ]
    for i, s in enumerate(result.top, 1):
        out.append(
            f"  {i:<3}{s.tokens_per_s:>13,.0f}{_secs(s.step_s):>10}{_secs(s.compute_s):>10}{_secs(s.exposed_s):>10}"
            f"{_secs(s.bubble_s):>10}{size_text(s.reserved) + ' / ' + size_text(s.device_memory):>24}"
            f"{s.plan.mfu[s.profile] * 100:>6.1f}%  {s.binds:<8} {describe(s.candidate)}"
        )
    return "\n".join(out) + "\n"
