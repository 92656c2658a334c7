"""Step watch: ranks a forward or backward apart, named with every rank's step counts instead of a transport error."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fsdp2_compile._torch_private import (
    all_gather_single,
    default_store,
    group_ranks,
    group_timeout,
    mark_boxed,
    resolve_group,
)
from fsdp2_compile.core.group_caches import dropped_with_groups
from fsdp2_compile.runtime.rank_agreement import _LISTED, _named, group_scope, wait_for_key

__all__ = ["STEP_COUNTS", "exchange_steps", "forget_counts_of", "watched"]

log = logging.getLogger("fsdp2_compile")

# Every compiled graph with collectives counts its runs per process group and model (forwards, backwards, no-grad
# forwards). On the CPU (gloo, where the host waits in each collective) the ranks gather these counts over each of
# the graph's groups before it runs (four numbers per rank) and, when they differ, every rank raises naming each
# rank's: a skipped backward or an extra forward is named at once, before a collective of another size meets it,
# which gloo answers by aborting the process.
#
# A rank not in a compiled step at all (done with its loop, exited, waiting in its own code) leaves its peers in a
# collective: gloo reports a closed connection at once, or its timeout T. Either way the rank publishes where it is
# ("forward 5, backwards 4") in the store and the ranks of the group that did read one verdict listing each one's
# counts and the ranks not seen, which the transport error is raised from:
#
# - told at once: the rank publishes when the error reaches the graph and waits at most `_ERROR_WAIT_S` for peers;
# - stuck: a watching thread (one per process, started at the first watched call on the CPU, ended with the default
#   process group) publishes once the rank has been inside one graph for T / 2 and logs the verdict, in by 0.9 T,
#   before gloo raises.
#
# A rank publishes once per group in a process-group attempt (a stall ends the job). The cost is that of rank
# consistency's exchange: a constant number of store operations per rank, and one read of the list of records by
# the rank that writes the verdict. With NCCL the host does not wait inside the graph (its collectives are
# asynchronous): there only errors are read, and NCCL's flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE) is the tool
# for a hang.

STEP_COUNTS = "fsdp2_compile::step_counts"
"""The profiler's name for the gathering of the ranks' counts before a graph runs (it wraps that collective)."""
_ERROR_WAIT_S = 5.0
"""How long a rank that a transport error reached waits for its peers' records."""
_TICK_S = 0.5
"""How often the watcher thread looks at the rank."""


@dataclasses.dataclass
class _Group:
    """A process group's step counts on this rank, for one compiled model."""

    name: str
    ranks: list[int]
    timeout_s: float
    counts: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(_KINDS, 0))

    @property
    def key(self) -> str:
        return f"fsdp2_compile/step/{group_scope(self.name, self.ranks)}"


_KINDS = ("forward", "backward", "inference")
_GROUPS: dict[tuple[str, int | None], _Group] = dropped_with_groups({})
"""(group name, compiled model) -> its counts."""
_VERDICTS: dict[str, str | None] = dropped_with_groups({})
"""Group name -> the verdict its ranks read (None: no skew named), once this rank published to it."""


@dataclasses.dataclass
class _Inside:
    """The graph this rank is running: its kind, groups, the counts when it started (its own included)."""

    kind: str
    groups: list[_Group]
    since: float
    record: str


class _Watch:
    """What the main thread is running, and the thread that watches it."""

    def __init__(self) -> None:
        self.inside: _Inside | None = None
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._watch, name="fsdp2_compile step watch", daemon=True)
            self.thread.start()

    def _watch(self) -> None:
        world = dist.group.WORLD
        while dist.is_initialized() and dist.group.WORLD is world:
            time.sleep(_TICK_S)
            inside = self.inside
            if inside is None or any(g.name in _VERDICTS for g in inside.groups):
                continue
            timeout = min(g.timeout_s for g in inside.groups)
            if time.monotonic() - inside.since >= timeout / 2:
                message = self.verdict(inside, inside.since + 0.9 * timeout)
                if message:
                    log.error("%s", message)

    def verdict(self, inside: _Inside, deadline: float) -> str | None:
        """Publish where this rank is to each group of `inside` (once) and read the groups' verdicts."""
        with self.lock:
            for group in inside.groups:
                if group.name not in _VERDICTS:
                    _VERDICTS[group.name] = None
                    try:
                        wait_s = deadline - time.monotonic()
                        _VERDICTS[group.name] = exchange_steps(
                            default_store(), dist.get_rank(), group.ranks, group.key, inside.record, wait_s
                        )
                    except dist.DistError:  # the store went with its host
                        _VERDICTS[group.name] = (
                            f"fsdp2_compile: rank {dist.get_rank()}, {_describe(inside.record)}, lost the process "
                            f"group's store while naming the steps of ranks {_named(group.ranks)}: the process "
                            "hosting it (rank 0, unless a launcher such as torchrun hosts it) has most likely exited: "
                            "look at its error"
                        )
            found = [v for g in inside.groups if (v := _VERDICTS.get(g.name))]
            return "; ".join(found) if found else None


_WATCH = _Watch()


def _record(kind: str, counts: dict[str, int]) -> str:
    return ":".join([kind, *(str(counts[k]) for k in _KINDS)])


def _describe(record: str) -> str:
    kind, forwards, backwards, inference = record.split(":")
    current = {"forward": forwards, "backward": backwards, "inference": inference}[kind]
    what = "no-grad forward" if kind == "inference" else kind
    return f"in {what} {current} (forwards {forwards}, backwards {backwards}" + (
        f", no-grad forwards {inference})" if inference != "0" else ")"
    )


def exchange_steps(store: dist.Store, rank: int, ranks: list[int], key: str, record: str, wait_s: float) -> str | None:
    """Publish this rank's place `record` ("forward:5:4:0": kind, forwards, backwards, no-grad forwards) among
    `ranks` under `key` and read the verdict, waiting at most `wait_s`: what a stalled rank runs per group, and what
    a simulation of many ranks against one store calls. None when every rank published the same place."""
    store.append(f"{key}/d", f"{rank}={record};")
    if store.add(f"{key}/n", 1) == len(ranks):
        _close(store, rank, ranks, key)
    if not wait_for_key(store, f"{key}/v", wait_s):
        _close(store, rank, ranks, key)
        if not wait_for_key(store, f"{key}/v", _ERROR_WAIT_S):
            return None
    return store.get(f"{key}/v").decode() or None


def _close(store: dist.Store, rank: int, ranks: list[int], key: str) -> None:
    """Claim the verdict under `key` and write it from the records published so far, unless a rank claimed it."""
    if store.compare_set(f"{key}/c", "", str(rank)) != str(rank).encode():
        return
    records: dict[int, str] = {}
    for entry in store.get(f"{key}/d").decode().split(";")[:-1]:
        r, record = entry.split("=")
        records[int(r)] = record
    store.compare_set(f"{key}/v", "", _message(ranks, records))


def _message(group_ranks: list[int], records: dict[int, str], what: str = "stopped pairing their collectives") -> str:
    """Every rank's place, ranks alike grouped; "" when every rank published the same place (no skew to name)."""
    by_record: dict[str, list[int]] = {}
    for r in sorted(records):
        by_record.setdefault(records[r], []).append(r)
    missing = [r for r in group_ranks if r not in records]
    if len(by_record) <= 1 and not missing:
        return ""
    places = [f"rank(s) {_named(ranks)} {_describe(record)}" for record, ranks in list(by_record.items())[:_LISTED]]
    if len(by_record) > _LISTED:
        places.append(f"{len(by_record) - _LISTED} more groups of ranks elsewhere")
    if missing:
        places.append(
            f"rank(s) {_named(missing)} not seen in a compiled step (done with their loop, exited, raised, or "
            "in other code)"
        )
    return (
        f"fsdp2_compile: the ranks of process group {_named(group_ranks)} {what}: "
        + "; ".join(places)
        + ". Every rank must run the same forwards and backwards of the compiled model in the same order: no "
        "rank-dependent `continue`, skipped backward, extra forward or early exit"
    )


def _is_transport_error(e: BaseException) -> bool:
    """A collective failed: NCCL's errors are `DistError`s, gloo's plain RuntimeErrors naming its sources."""
    return isinstance(e, dist.DistError) or any(w in str(e) for w in ("/gloo/", "by peer", "pair closure"))


def forget_counts_of(owner: int) -> None:
    """The model `owner` died: drop its counts (a new model may get its id)."""
    for key in [k for k in _GROUPS if k[1] == owner]:
        del _GROUPS[key]


def _check_aligned(groups: list[_Group], record: str) -> None:
    """Gather every rank's step counts over each group before the graph's first collective; raise on every rank,
    naming each rank's, when they differ."""
    mine = torch.tensor([int(x) if x.isdigit() else _KINDS.index(x) for x in record.split(":")])
    with torch.profiler.record_function(STEP_COUNTS):
        _gather_and_compare(groups, mine)


def _gather_and_compare(groups: list[_Group], mine: torch.Tensor) -> None:
    for group in groups:
        table = torch.empty(len(group.ranks) * mine.numel(), dtype=mine.dtype)
        all_gather_single(table, mine, group=resolve_group(group.name))
        rows = table.view(len(group.ranks), -1)
        if not (rows == mine).all():
            records = {r: ":".join([_KINDS[row[0]], *map(str, row[1:])]) for r, row in zip(group.ranks, rows.tolist())}
            raise RuntimeError(_message(group.ranks, records, "are at different steps of the compiled model"))


def watched(
    run: Callable[[list], Any], kind: str, group_names: set[str], owner: int | None, check: bool
) -> Callable[[list], Any]:
    """`run` (a boxed compiled graph of `kind` whose collectives use `group_names`, compiled for the model `owner`)
    counting its runs per group and model, and raising a transport error from it with the step counts of every rank
    of its groups (see above); with `check` (on the CPU), the ranks' counts are compared before each run (one small
    all-gather per group) and a watching thread names a stall."""
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return run
    groups = []
    for name in sorted(group_names):
        ranks = group_ranks(name)
        if len(ranks) > 1:
            groups.append(_GROUPS.setdefault((name, owner), _Group(name, ranks, group_timeout(name))))
    if not groups:
        return run

    def watched_run(args: list) -> Any:
        for group in groups:
            group.counts[kind] += 1
        before = _WATCH.inside
        inside = _Inside(kind, groups, time.monotonic(), _record(kind, groups[0].counts))
        _WATCH.inside = inside
        if check:
            _WATCH.start()
        try:
            if check:
                _check_aligned(groups, inside.record)
            return run(args)
        except Exception as e:
            if not _is_transport_error(e):
                raise
            first = (str(e).strip().splitlines() or [""])[0]
            deadline = min(inside.since + 0.9 * min(g.timeout_s for g in groups), time.monotonic() + _ERROR_WAIT_S)
            message = _WATCH.verdict(inside, deadline)
            if message is None:
                raise
            raise RuntimeError(f"{message}. The collective failed with: {first}") from e
        finally:
            _WATCH.inside = before

    return mark_boxed(watched_run)
