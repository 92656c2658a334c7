"""Rank consistency: every rank must issue the same collectives in the same order, or the job hangs."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Iterator

import torch.distributed as dist
from torch import fx

from fsdp2_compile._torch_private import current_compile_id, traced_frame_of
from fsdp2_compile.compiler.graph_records import collectives, record_owner
from fsdp2_compile.core.ir import Role, schema_args
from fsdp2_compile.runtime.rank_agreement import _agree, _Exchange, _exchange_over, agree_or_raise, forget_frames

__all__ = [
    "PeerCompileFailed",
    "check_loaded_schedule",
    "check_same_schedule",
    "compile_frame",
    "forget_frames_of",
    "graph_groups",
    "publish_trace_failure",
    "rank_check",
    "schedule_record",
    "schedule_signature",
]


def schedule_signature(gm: fx.GraphModule) -> str:
    """The collectives of `gm` in order, one `kind:dtype:bytes:param,param,...` per line; bytes "*" for the model's
    own all-to-alls (no parameter: a mixture of experts' dispatch and combine), whose sizes depend on the routing
    of each rank's tokens by design."""
    return "\n".join(
        f"{c.kind}:{str(c.dtype).removeprefix('torch.')}:"
        f"{'*' if c.kind == Role.ALL_TO_ALL and not c.params else c.nbytes}:{','.join(c.params)}"
        for c in collectives(gm)
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


# When the backend compiles a graph, the ranks of each process group its collectives use agree on a record (their
# `CompileConfig` and schedule) through the store (`runtime/rank_agreement.py`, where the exchange is described),
# then every rank raises the same kind of error, naming the ranks, as soon as one of these holds:
#
# 1. A peer published a failure: its compilation raised (rank, exception type and first line of the message).
# 2. The ranks' `CompileConfig`s differ: named field by field ("rank 1 has CompileConfig.prefetch_depth=1, rank 0 2").
# 3. The ranks compiled different schedules (each collective's kind, dtype, bytes and parameters, in order): the
#    first differing collective is named, with the parameters one rank gathers or reduces but the other does not
#    (e.g. a parameter used under `if rank == 0:`).
# 4. A peer did not publish in time: it raised or crashed before compiling (in its own code, which the backend cannot
#    see), is late, or compiled a different graph.
#
# Peers are the ranks of the process groups the graph's collectives use (the union, e.g. shard and replicate groups
# for HSDP), one exchange per group. Graphs without collectives are not checked.
#
# `CompileConfig.check_rank_consistency=False` skips only the comparison of schedules; the configs are still
# exchanged, so a rank that turned it off is named on every rank instead of leaving the others waiting.
#
# Graphs are paired across ranks by their Dynamo frame and kind; the groups are
# read off the graph as captured, so a rank whose pass pipeline raises publishes its failure under the keys its peers
# wait on. A recompile of a frame whose record the ranks already agreed on is not exchanged again.
#
# A rank whose Dynamo trace of a `shard_compile`d module raises (e.g. its input has another feature size) publishes
# that failure, with its inputs' shapes, under the keys of the frame's graph (`publish_trace_failure`), as if its
# backend had raised. What this cannot see: a rank that raises in its own code before compiling (or in AOTAutograd
# before the backend's compiler runs) publishes nothing, so its peers end after the bounded wait, with a message
# naming it as not having published; if that rank's process hosted the store (rank 0 when launched without torchrun's agent), its
# exit is seen at once ("lost the process group's store"). A rank that dies after the ranks agreed, or that fails in
# a recompile nobody else is compiling, is outside the check: the peers' next collective fails (gloo reports the
# closed connection at once) or times out, and the step watch (step_watch.py) names the ranks from there.
def _exchange(gm: fx.GraphModule, kind: str, world_if_none: bool, timeout_s: float | None) -> _Exchange | None:
    """Where and how long this compilation's records are exchanged; None when there is nothing to check."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return None
    names = graph_groups(gm)
    return _exchange_over(names or ({"world"} if world_if_none else set()), kind, timeout_s, compile_frame())


_FRAMES_OF: dict[int, set[Hashable]] = {}
"""Owner (`graph_records.record_owner`: the module compiled) -> the frames compiled for it."""


def compile_frame() -> Hashable | None:
    """What this compilation is paired by across ranks (and counted in, `graph_records.compile_counts`): its
    Dynamo frame."""
    compile_id = current_compile_id()
    if compile_id is None:
        return None
    if (owner := record_owner()) is not None:
        _FRAMES_OF.setdefault(owner, set()).add(compile_id[0])
    return compile_id[0]


def forget_frames_of(owner: int) -> None:
    """The module `owner` died: forget what the ranks agreed on for its frames."""
    forget_frames(_FRAMES_OF.pop(owner, set()))


def schedule_record(gm: fx.GraphModule, config) -> dict:
    """What a rank publishes for the compiled graph `gm`: its config (less the rank-local fields) and, unless
    `check_rank_consistency` is off, its schedule."""
    config_fields = (
        {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config) if not f.metadata.get("rank_local")}
        if config
        else {}
    )
    compare = config is None or config.check_rank_consistency
    return {"config": config_fields, "schedule": schedule_signature(gm) if compare else None}


class PeerCompileFailed(RuntimeError):
    """The compilation of a graph this rank compiled failed on a peer: `failures`, (rank, message) pairs."""

    def __init__(self, message: str, failures: list[tuple[int, str]]):
        super().__init__(message)
        self.failures = failures


def _check(ex: _Exchange, gm: fx.GraphModule, config) -> None:
    """Publish this rank's config and schedule, read the verdict, raise on any difference."""
    error = _agree(ex, schedule_record(gm, config))
    if error is not None:
        failures = [(r, m) for verdict in ex.verdicts for r, m in verdict.get("failed", [])]
        raise PeerCompileFailed(error, failures) if failures else RuntimeError(error)


def _fail(ex: _Exchange, e: BaseException, called: str = "") -> None:
    """Publish `e` as this rank's failure to compile (`called`: what this rank's step was called with), so its
    peers stop at once naming it."""
    first = (str(e).strip().splitlines() or [""])[0][:300]
    with contextlib.suppress(dist.DistError):  # never hide the real error behind a store error
        ex.publish_failure(f"{type(e).__name__}: {first}{f' ({called})' if called else ''}")
    ex.finish(wait=True)


def publish_trace_failure(error: BaseException, group_names: set[str], kind: str, owner: int, called: str) -> bool:
    """`error` was raised while Dynamo traced a frame of the module `owner` on this rank, before the backend (which
    publishes its own failures) met the frame's graph: publish it, with what this rank was called with (`called`,
    e.g. "called with args[0] float32 (4, 17)"), where the peers that compiled the frame's `kind` graph over the
    process groups `group_names` wait for this rank's record, so that they stop at once naming it. Whether it was
    published."""
    frame = traced_frame_of(error)
    if frame is None or not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return False
    ex = _exchange_over(group_names, kind, None, frame)
    if ex is None:
        return False
    _FRAMES_OF.setdefault(owner, set()).add(frame)
    cause = error  # Dynamo's wrappers (first line: "RuntimeError when making fake tensor call") raised from torch's
    while (inner := cause.__cause__ or cause.__context__) is not None:
        cause = inner
    _fail(ex, cause, called)
    ex.spend()
    return True


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
            _fail(ex, e)
        ex.spend()
        raise


def check_same_schedule(gm: fx.GraphModule, kind: str, config=None, *, timeout_s: float | None = None) -> None:
    """Raise on every rank if the ranks compiled different configs or collective schedules for this graph (what the
    backend does after its pass pipeline; see the comment above `_exchange`). Called directly on a graph without
    collectives, it compares across the default process group. `timeout_s` overrides the wait derived from the
    process group's timeout."""
    ex = _exchange(gm, kind, world_if_none=True, timeout_s=timeout_s)
    if ex is not None:
        agree_or_raise(ex, schedule_record(gm, config))


def check_loaded_schedule(group_names: set[str], kind: str, record: dict) -> None:
    """A graph loaded from the compile cache (`CompileConfig.compile_cache`): its `record`, as the ranks of the
    launch that saved it agreed on it, is exchanged as a compiled graph's is, so that ranks that loaded and ranks
    that compiled check one another (a record this process agreed on already is not exchanged again)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake" or not group_names:
        return
    ex = _exchange_over(group_names, kind, None, compile_frame())
    if ex is not None:
        agree_or_raise(ex, record)
