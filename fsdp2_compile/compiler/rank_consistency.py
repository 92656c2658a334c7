"""Rank consistency: every rank must issue the same collectives in the same order, or the job hangs.

When the backend compiles a graph, each rank publishes a record in the default process group's store and reads
those of its peers, then every rank raises the same kind of error, naming the ranks, as soon as one of these holds:

1. A peer published a failure: its compilation raised (rank, exception type and first line of the message).
2. The ranks' `CompileConfig`s differ: named field by field ("rank 1 has CompileConfig.prefetch_depth=1, rank 0 2").
3. The ranks compiled different schedules (each collective's kind, dtype, bytes and parameters, in order): the
   first differing collective is named, with the parameters one rank gathers or reduces but the other does not
   (e.g. a parameter used under `if rank == 0:`).
4. A peer did not publish in time: it raised or crashed before compiling (in its own code, which the backend cannot
   see), is late, or compiled a different graph. "In time" is derived from the process group's timeout, waiting
   for at most max(min(0.9 T, T - 5 s), T / 2) of it, so a late rank is waited for nearly as long as its first
   collective would be, and this message comes before the collective's own timeout. The store is polled in short
   slices, so a published failure ends the wait at once.

Peers are the ranks of the process groups the graph's collectives use (the union, e.g. shard and replicate groups
for HSDP). A rank publishes once per group, under keys naming the group and its ranks, and reads the records of
that group's ranks: stages of a pipeline-parallel job that shard different models on disjoint sub-meshes never wait
for or compare with each other, and with HSDP rank 0 compares with its shard peer and its replica, each of which
compares with theirs. Graphs without collectives are not checked.

`CompileConfig.check_rank_consistency=False` skips only the comparison of schedules; the configs are still
exchanged, so a rank that turned it off is named on every rank instead of leaving the others waiting.

Keys carry the token the group's ranks drew when `shard` made the group (`process_groups.attempt_token`), so a
job restarted in place by torchrun's agent, whose store keeps the records of the attempt that died, never reads
them.

Graphs are paired across ranks by their Dynamo frame (numbered per group in the order the backend first meets it)
and kind; the groups are read off the graph as captured, so a rank whose pass pipeline raises publishes its failure
under the keys its peers wait on. A recompile of a frame whose record the ranks already agreed on (e.g. for a new
input shape, which ranks with different data meet at different steps) is not exchanged again, so it never waits for
the other ranks.

What this cannot see: a rank that raises in its own code before compiling (or in Dynamo/AOTAutograd before the
backend's compiler runs) publishes nothing, so its peers end after the bounded wait, with a message naming it as not
having published; if that rank's process hosted the store (rank 0 when launched without torchrun's agent), its
exit is seen at once ("lost the process group's store"). A rank that dies after the ranks agreed, or that fails in
a recompile nobody else is compiling, is outside the check: the peers' next collective fails (gloo reports the
closed connection at once) or times out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import time
from collections.abc import Callable, Iterator

import torch.distributed as dist
from torch import fx

from fsdp2_compile._torch_private import current_compile_id, default_store, group_ranks, group_timeout
from fsdp2_compile.compiler.report import collectives
from fsdp2_compile.core.group_caches import dropped_with_groups
from fsdp2_compile.core.ir import schema_args
from fsdp2_compile.runtime.process_groups import attempt_token

__all__ = ["check_same_schedule", "graph_groups", "rank_check", "schedule_signature"]

_UNNAMED: dict[str, itertools.count] = dropped_with_groups({})
"""Process group -> the counter of its checks made outside a Dynamo compilation."""
_FRAMES: dict[str, dict[int, int]] = dropped_with_groups({})
"""Process group -> Dynamo frame id -> the order in which the backend first compiled it with that group's
collectives (the same on every rank of the group)."""
_AGREED: dict[str, list[str]] = dropped_with_groups({})
"""Store key of a (group, frame, kind) -> the records all the group's ranks agreed on, in order."""
_SPENT = "<failed exchange>"
"""What a failed exchange leaves in its `_AGREED` list: its keys are not used again."""
_FINISH_WAIT_S = 5.0
"""How long a rank about to raise waits for its peers to have read the records (the store may live in its process)."""


def schedule_signature(gm: fx.GraphModule) -> str:
    """The collectives of `gm` in order, one `kind:dtype:bytes:param,param,...` per line."""
    return "\n".join(
        f"{c.kind}:{str(c.dtype).removeprefix('torch.')}:{c.nbytes}:{','.join(c.params)}" for c in collectives(gm)
    )


def graph_groups(gm: fx.GraphModule) -> set[str]:
    """Names of the process groups the graph's collectives use: every non-empty `*group_name` string argument of
    its ops, or field of a dataclass argument (the functional collectives' `group_name`, `fsdp2::unshard`'s
    `ParamSpec.group_name` / `replicate_group_name` / `post_forward_group_name`)."""
    names = set()
    for node in gm.graph.nodes:
        for name, value in schema_args(node).items():
            named = (
                [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
                if dataclasses.is_dataclass(value) and not isinstance(value, type)
                else [(name, value)]
            )
            names.update(v for n, v in named if n.endswith("group_name") and isinstance(v, str) and v)
    return names


def _served(lines: list[str]) -> set[tuple[str, str]]:
    """(collective kind, parameter) for every parameter the collectives of a signature serve."""
    return {(line.split(":", 1)[0], p) for line in lines for p in line.split(":", 3)[3].split(",") if p}


def _only_on(rank: int, served: set[tuple[str, str]]) -> str:
    """ "; all_gather of a, b on rank 0 only" per collective kind ("" when `served` is empty)."""
    kinds = sorted({kind for kind, _ in served})
    return "".join(
        f"; {kind} of {', '.join(sorted(p for k, p in served if k == kind))} on rank {rank} only" for kind in kinds
    )


def _short(lines: list[str], i: int) -> str:
    """Collective #i of a signature without its parameter list ("none" past the end)."""
    return lines[i].rsplit(":", 1)[0] if i < len(lines) else "none"


def _schedule_error(rank: int, mine: str, r: int, theirs: str, kind: str) -> str:
    """The message for this rank's signature `mine` against rank `r`'s `theirs`."""
    ours, other = mine.splitlines(), theirs.splitlines()
    i = next((i for i, (a, b) in enumerate(zip(ours, other)) if a != b), min(len(ours), len(other)))
    params = _only_on(rank, _served(ours) - _served(other)) + _only_on(r, _served(other) - _served(ours))
    sha = lambda s: hashlib.sha256(s.encode()).hexdigest()[:12]  # noqa: E731
    return (
        f"fsdp2_compile: rank {rank} and rank {r} compiled different {kind} schedules (sha256 {sha(mine)} vs "
        f"{sha(theirs)}); collective #{i}: {_short(ours, i)} here vs {_short(other, i)} on rank {r}{params}. "
        "Give every rank the same model, CompileConfig and inputs, and use every parameter on every rank "
        "(not under a rank-dependent branch); pipeline stages: shard each stage over the dp slice of the mesh "
        '(mesh["dp"]), whose ranks all hold that stage, not over a mesh that spans stages'
    )


def _config_error(records: dict[int, dict]) -> str | None:
    """Every field in which a rank's CompileConfig differs from the lowest rank's, or None."""
    (low, base), *rest = sorted(records.items())
    diffs = [
        f"rank {r} has CompileConfig.{field}={value}, rank {low} {base['config'].get(field)}"
        for r, record in rest
        for field, value in record["config"].items()
        if base["config"].get(field) != value
    ]
    if not diffs:
        return None
    return (
        f"fsdp2_compile: the ranks compile with different CompileConfigs: {'; '.join(diffs)}. "
        "Give every rank the same CompileConfig"
    )


@dataclasses.dataclass
class _Channel:
    """One process group's part of an exchange: its ranks, the store key of this compilation there, and the records
    its ranks already agreed on for this frame and kind (shared with `_AGREED`)."""

    ranks: list[int]
    key: str
    agreed: list[str]


@dataclasses.dataclass
class _Exchange:
    """One compilation's records in the store, over the process groups of the graph."""

    kind: str
    channels: list[_Channel]
    wait_s: float
    pg_timeout_s: float
    published: bool = False
    spent: bool = False

    @property
    def ranks(self) -> list[int]:
        return sorted({r for ch in self.channels for r in ch.ranks})

    def publish(self, record: dict) -> None:
        store, rank = default_store(), dist.get_rank()
        for ch in self.channels:
            store.set(f"{ch.key}/{rank}", json.dumps(record))
            if "failed" in record:
                store.set(f"{ch.key}/failed", str(rank))
        self.published = True

    def spend(self) -> None:
        """After a failed exchange: this rank's next exchange of these groups, frame and kind uses the next keys,
        not these, whose records stay in the store (after `torch._dynamo.reset()` Dynamo numbers frames from 0
        again, and the next compile of "frame 0" would read them). Every rank of the groups raised, so each spends
        its keys alike."""
        if not self.spent:
            for ch in self.channels:
                ch.agreed.append(_SPENT)
            self.spent = True

    def finish(self, wait: bool) -> None:
        """Count this rank as done with the records; with `wait`, give the others a few seconds to read them too
        (this rank is about to raise, and its process may host the store)."""
        store, deadline = default_store(), time.monotonic() + min(_FINISH_WAIT_S, self.wait_s)
        with contextlib.suppress(dist.DistError):  # best effort: the store may be gone already
            for ch in self.channels:
                store.add(f"{ch.key}/done", 1)
            while (
                wait
                and time.monotonic() < deadline
                and any(store.add(f"{ch.key}/done", 0) < len(ch.ranks) for ch in self.channels)
            ):
                time.sleep(0.02)

    def records(self) -> dict[int, dict]:
        """Every peer's record once all published, polling in short slices; raises as soon as one published a
        failure, or when the wait runs out."""
        store = default_store()
        keys = {(ch.key, r): f"{ch.key}/{r}" for ch in self.channels for r in ch.ranks}
        failed_keys = [f"{ch.key}/failed" for ch in self.channels]
        deadline, pause = time.monotonic() + self.wait_s, 0.005
        while not store.check(list(keys.values())) and not any(store.check([k]) for k in failed_keys):
            if time.monotonic() > deadline:
                missing = sorted({r for (_, r), k in keys.items() if not store.check([k])})
                compile_id = current_compile_id()
                recompiling = (
                    " This rank is recompiling a graph it compiled before, so a guard failed here and not there: "
                    "something this graph depends on changed on this rank only (a parameter's requires_grad, a "
                    "module setting such as set_requires_gradient_sync, an input's shape or dtype); "
                    "TORCH_LOGS=recompiles names the guard."
                    if compile_id is not None and compile_id[1] > 0
                    else ""
                )
                raise RuntimeError(
                    f"fsdp2_compile: rank(s) {missing} did not publish their {self.kind} schedule within "
                    f"{self.wait_s:.0f} s (the process group times out after {self.pg_timeout_s:.0f} s): they "
                    "raised or crashed before compiling this graph (look at their errors), are late (e.g. slow "
                    "data loading: raise the timeout of init_process_group), or compiled different graphs (e.g. a "
                    "data-dependent branch went another way there, so they did not need this graph: keep control "
                    "flow the same on every rank)" + recompiling
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.2)
        found = {r: json.loads(store.get(k)) for (_, r), k in keys.items() if store.check([k])}
        failed = {r: rec["failed"] for r, rec in found.items() if "failed" in rec}
        if failed:
            self.finish(wait=True)
            raise RuntimeError(
                "fsdp2_compile: "
                + "; ".join(f"rank {r} failed to compile its {self.kind} graph: {m}" for r, m in sorted(failed.items()))
                + ". Fix that error (the failing rank's own traceback shows where); the other ranks stopped "
                "here instead of waiting for it in a collective"
            )
        return found


def _channel(name: str, ranks: list[int], kind: str) -> _Channel:
    """The store key of this compilation in the group called `name`: the group and its ranks, the Dynamo frame
    (numbered in the order the backend met the group's frames), the kind and how many records were agreed."""
    scope = f"{name}@{','.join(map(str, ranks))}"
    compile_id = current_compile_id()
    frames = _FRAMES.setdefault(scope, {})
    if compile_id:
        frame = f"f{frames.setdefault(compile_id[0], len(frames))}"
    else:  # outside Dynamo (a direct `check_same_schedule`): numbered per group, as the group's ranks call it
        frame = f"n{next(_UNNAMED.setdefault(scope, itertools.count()))}"
    token = attempt_token(name)  # the group's ranks drew it in this attempt: no record of an earlier one is read
    key = f"fsdp2_compile/check/{token + '/' if token else ''}{scope}/{frame}/{kind}"
    agreed = _AGREED.setdefault(key, [])
    return _Channel(ranks, f"{key}/{len(agreed)}", agreed)


def _exchange(gm: fx.GraphModule, kind: str, world_if_none: bool, timeout_s: float | None) -> _Exchange | None:
    """Where and how long this compilation's records are exchanged; None when there is nothing to check."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return None
    groups = {g: group_ranks(g) for g in sorted(graph_groups(gm))}
    if not groups and world_if_none:
        groups = {"world": list(range(dist.get_world_size()))}
    groups = {g: ranks for g, ranks in groups.items() if len(ranks) > 1}
    if not groups:
        return None
    pg_timeout = min(group_timeout(None if g == "world" else g) for g in groups)
    wait_s = timeout_s if timeout_s is not None else max(min(0.9 * pg_timeout, pg_timeout - 5), pg_timeout / 2)
    return _Exchange(kind, [_channel(g, sorted(ranks), kind) for g, ranks in groups.items()], wait_s, pg_timeout)


def _check(ex: _Exchange, gm: fx.GraphModule, config) -> None:
    """Publish this rank's config and schedule, read the peers', raise on any difference."""
    config_fields = (
        {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config) if not f.metadata.get("rank_local")}
        if config
        else {}
    )
    compare = config is None or config.check_rank_consistency
    mine = {"config": config_fields, "schedule": schedule_signature(gm) if compare else None}
    if all(json.dumps(mine) in ch.agreed for ch in ex.channels):
        return
    try:
        ex.publish(mine)
        records = ex.records()
    except dist.DistNetworkError as e:
        raise RuntimeError(
            f"fsdp2_compile: lost the process group's store while exchanging {ex.kind} schedules with ranks "
            f"{ex.ranks}: the process hosting it (rank 0, unless a launcher such as torchrun hosts it) has most "
            f"likely exited: look at its error ({str(e).strip().splitlines()[0]})"
        ) from e
    rank = dist.get_rank()
    error = _config_error(records)
    if error is None and compare:  # equal configs: every rank compares schedules, or none does
        error = next(
            (
                _schedule_error(rank, mine["schedule"], r, rec["schedule"], ex.kind)
                for r, rec in records.items()
                if rec["schedule"] != mine["schedule"]
            ),
            None,
        )
    ex.finish(wait=error is not None)
    if error is not None:
        raise RuntimeError(error)
    for ch in ex.channels:
        ch.agreed.append(json.dumps(mine))


@contextlib.contextmanager
def rank_check(gm: fx.GraphModule, kind: str, config) -> Iterator[Callable[[fx.GraphModule], None]]:
    """Around the compilation of `gm` (as captured): yields `check(final_gm)`, to call on the compiled graph. An
    exception in the block before `check` published anything is published as this rank's failure, so the peers
    stop at once naming it, then re-raised."""
    ex = _exchange(gm, kind, world_if_none=False, timeout_s=None)
    if ex is None:
        yield lambda final: None
        return
    try:
        yield lambda final: _check(ex, final, config)
    except Exception as e:
        if not ex.published:
            first = (str(e).strip().splitlines() or [""])[0][:300]
            with contextlib.suppress(dist.DistError):  # never hide the real error behind a store error
                ex.publish({"failed": f"{type(e).__name__}: {first}"})
            ex.finish(wait=True)
        ex.spend()
        raise


def check_same_schedule(gm: fx.GraphModule, kind: str, config=None, *, timeout_s: float | None = None) -> None:
    """Raise on every rank if the ranks compiled different configs or collective schedules for this graph (what the
    backend does after its pass pipeline; see the module docstring). Called directly on a graph without
    collectives, it compares across the default process group. `timeout_s` overrides the wait derived from the
    process group's timeout."""
    ex = _exchange(gm, kind, world_if_none=True, timeout_s=timeout_s)
    if ex is None:
        return
    try:
        _check(ex, gm, config)
    except Exception:
        ex.spend()
        raise
