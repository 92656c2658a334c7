"""`make_plan`'s stages shared between the search's candidates, each built once per what it depends on: the full
model's figures at another dp split derived from its parameters' shapes, the copies' collectives at another shard
size, replica count or rows per micro-batch derived from one compile; a derivation that does not give the stage
it comes from is built for each candidate instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fsdp2_compile.core.ir import Role
from fsdp2_compile.core.ops import padded_rows
from fsdp2_compile.planner.candidates import Candidate
from fsdp2_compile.planner.full_model import (
    _check_pipeline_fits,
    _FullModel,
    _outside_parts,
    _ParamRow,
    _shard_full_model,
    tokens_of,
)
from fsdp2_compile.planner.layout import Layout
from fsdp2_compile.planner.model_copies import _compile_copies, _Copies, _GraphFigures, _trace_copies
from fsdp2_compile.planner.param_bytes import ADAMW_STATES, _itemsize
from fsdp2_compile.planner.reduced_depth import reduced_copy
from fsdp2_compile.planner.tensor_parallel import plan_meshes


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
