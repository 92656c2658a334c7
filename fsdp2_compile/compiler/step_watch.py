"""Step watch: ranks a forward or backward apart, named with every rank's step counts instead of a transport error."""

from __future__ import annotations

import contextlib
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

__all__ = ["STEP_COUNTS", "exchange_steps", "forget_counts_of", "step_round", "watched"]

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
#   process group) publishes once the rank has been inside one graph for T / 2 and holds the verdict, in by 0.9 T;
#   it logs it as a warning, and raises it if gloo then times out.
#
# A peer may only be late: busy outside the compiled step (an evaluation, a checkpoint on rank 0) for longer than
# T / 2. When it arrives the collective completes and the graph returns: the watching thread stops waiting for the
# verdict (it polls the store, so the main thread's store operations never wait behind it), the held verdict is
# dropped, and this rank advances the group's round. Each group's exchanges are numbered by that round, a counter in
# the store under the group's key: a rank reads it when it publishes and, when the graph it published from returns,
# advances it from the round it read to the next (compare-and-set, so ranks that published to the same round
# advance it once). The next stall of the group is thus exchanged afresh, never read from the late peer's records.
# A rank that raised keeps its group's round: a stall ends the job.
#
# The cost is that of rank consistency's exchange: a constant number of store operations per rank (and the watching
# thread's polls, at most one a second), and one read of the list of records by the rank that writes the verdict.
# Each round leaves its few keys in the store. With NCCL the host does not wait inside the graph (its collectives
# are asynchronous): there only errors are read, and NCCL's flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE) is the
# tool for a hang.

STEP_COUNTS = "fsdp2_compile::step_counts"
"""The profiler's name for the gathering of the ranks' counts before a graph runs (it wraps that collective)."""
_ERROR_WAIT_S = 5.0
"""How long a rank that a transport error reached waits for its peers' records."""
_TICK_S = 0.5
"""How often the watcher thread looks at the rank."""
_POLL_S = 1.0
"""The longest pause of the watcher thread between two looks for a verdict in the store."""


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


@dataclasses.dataclass
class _Inside:
    """The graph this rank is running: its kind, groups, the counts when it started (its own included), and, once
    this rank published to a group, the round it read and the verdict it holds (None: no skew named)."""

    kind: str
    groups: list[_Group]
    since: float
    record: str
    rank: int
    watched: bool = False
    returned: bool = False
    raised: bool = False
    rounds: dict[str, int] = dataclasses.field(default_factory=dict)
    verdicts: dict[str, str | None] = dataclasses.field(default_factory=dict)


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
            if inside is None or inside.watched:
                continue
            timeout = min(g.timeout_s for g in inside.groups)
            if time.monotonic() - inside.since >= timeout / 2:
                inside.watched = True
                message = self.verdict(inside, inside.since + 0.9 * timeout, watching=True)
                if message and not (inside.returned or inside.raised):
                    log.warning(
                        "%s. Rank %d holds this verdict after %.0f s of the process group's %.0f s timeout: it is "
                        "raised if the collective fails, dropped if the ranks arrive",
                        message,
                        inside.rank,
                        time.monotonic() - inside.since,
                        timeout,
                    )

    def verdict(self, inside: _Inside, deadline: float, watching: bool = False) -> str | None:
        """Publish where this rank is to each group of `inside` (once) and read the groups' verdicts; `watching`
        (the watcher thread) stops waiting once the graph returned."""
        stale = (lambda: inside.returned) if watching else None
        with self.lock:
            for group in inside.groups:
                if group.name in inside.verdicts:
                    continue
                inside.verdicts[group.name] = None
                try:
                    store = default_store()
                    inside.rounds[group.name] = step_round(store, group.key)
                    if inside.returned:
                        continue
                    inside.verdicts[group.name] = exchange_steps(
                        store,
                        inside.rank,
                        group.ranks,
                        f"{group.key}/{inside.rounds[group.name]}",
                        inside.record,
                        deadline - time.monotonic(),
                        stale,
                    )
                except dist.DistError:  # the store went with its host
                    inside.verdicts[group.name] = (
                        f"fsdp2_compile: rank {inside.rank}, {_describe(inside.record)}, lost the process "
                        f"group's store while naming the steps of ranks {_named(group.ranks)}: the process "
                        "hosting it (rank 0, unless a launcher such as torchrun hosts it) has most likely exited: "
                        "look at its error"
                    )
            if inside.returned:
                _advance(inside)
            found = [v for g in inside.groups if (v := inside.verdicts.get(g.name))]
            return "; ".join(found) if found else None


def _advance(inside: _Inside) -> None:
    """The graph of `inside` returned: what its groups' ranks published is stale, so move each group this rank
    read a round of to the next round (once per round, whichever of its ranks comes first)."""
    keys = {g.name: g.key for g in inside.groups}
    with contextlib.suppress(dist.DistError):  # best effort: a lost store ends the job anyway
        for name, number in list(inside.rounds.items()):
            default_store().compare_set(f"{keys[name]}/round", str(number), str(number + 1))


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


def step_round(store: dist.Store, key: str) -> int:
    """The current round of the step exchanges under the group key `key` (0 until a stale one advanced it)."""
    return store.add(f"{key}/round", 0)


def exchange_steps(
    store: dist.Store,
    rank: int,
    ranks: list[int],
    key: str,
    record: str,
    wait_s: float,
    stale: Callable[[], bool] | None = None,
) -> str | None:
    """Publish this rank's place `record` ("forward:5:4:0": kind, forwards, backwards, no-grad forwards) among
    `ranks` under `key` (a group's key and round, "<key>/<step_round>") and read the verdict, waiting at most
    `wait_s`: what a stalled rank runs per group, and what a simulation of many ranks against one store calls. None
    when every rank published the same place, or (polling the store) once `stale()` holds."""
    store.append(f"{key}/d", f"{rank}={record};")
    if store.add(f"{key}/n", 1) == len(ranks):
        _close(store, rank, ranks, key)
    if not _await_verdict(store, f"{key}/v", wait_s, stale):
        if stale is not None and stale():
            return None
        _close(store, rank, ranks, key)
        if not wait_for_key(store, f"{key}/v", _ERROR_WAIT_S):
            return None
    return store.get(f"{key}/v").decode() or None


def _await_verdict(store: dist.Store, key: str, wait_s: float, stale: Callable[[], bool] | None) -> bool:
    """Whether `key` is set within `wait_s`: a blocking wait, or with `stale`, polls (which leave the store client
    free for this process's other threads between them) that stop once `stale()` holds."""
    if stale is None:
        return wait_for_key(store, key, wait_s)
    deadline, pause = time.monotonic() + wait_s, 0.05
    while not store.check([key]):
        left = deadline - time.monotonic()
        if stale() or left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, _POLL_S)
    return True


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
    rank = dist.get_rank()

    def watched_run(args: list) -> Any:
        for group in groups:
            group.counts[kind] += 1
        before = _WATCH.inside
        inside = _Inside(kind, groups, time.monotonic(), _record(kind, groups[0].counts), rank)
        _WATCH.inside = inside
        if check:
            _WATCH.start()
        try:
            if check:
                _check_aligned(groups, inside.record)
            result = run(args)
        except Exception as e:
            inside.raised = True
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
        inside.returned = True
        if inside.rounds:  # this rank published while it waited, and the peers came: a stale round
            _advance(inside)
        return result

    return mark_boxed(watched_run)
