"""Rank agreement: the ranks of one or more process groups agree on a record through the default process group's
store, with a bounded wait, naming the ranks whose record differs or that did not come, before a collective would
hang on them."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import time
from collections.abc import Hashable
from datetime import timedelta

import torch.distributed as dist

from fsdp2_compile._torch_private import current_compile_id, default_store, group_ranks, group_timeout
from fsdp2_compile.core.group_caches import dropped_with_groups
from fsdp2_compile.runtime.process_groups import attempt_token

__all__ = [
    "agree_at_first_call",
    "agree_or_raise",
    "agree_to_call",
    "agree_to_shard",
    "check_key",
    "exchange",
    "forget_frames",
    "group_scope",
    "wait_for_key",
]

_UNNAMED: dict[str, itertools.count] = dropped_with_groups({})
"""Process group -> the counter of its checks made outside a Dynamo compilation."""
_FRAMES: dict[str, dict[Hashable, int]] = dropped_with_groups({})
"""Process group -> frame (a Dynamo frame id) -> its number: the order in which the backend first compiled it with
that group's collectives (the same on every rank of the group)."""
_FRAME_COUNT: dict[str, itertools.count] = dropped_with_groups({})
"""Process group -> the counter numbering its frames (numbers are not reused when a frame is forgotten)."""
_AGREED: dict[str, list[str]] = dropped_with_groups({})
"""Store key of a (group, frame, kind) -> the records all the group's ranks agreed on, in order."""
_SPENT = "<failed exchange>"
"""What a failed exchange leaves in its `_AGREED` list: its keys are not used again."""
_FINISH_WAIT_S = 5.0
"""How long rank 0, about to raise, waits for its peers to have read the verdict (the store may live in its
process), and how long a rank waits for the verdict of a rank that claimed it."""
_EXPLAINED = 16
"""At most this many distinct records are read to explain a mismatch (one rank's each)."""
_LISTED = 8
"""At most this many groups of ranks holding the same record are listed in an error."""
_SHARD_RULE = "`shard` must be called on every rank of the mesh, on the same modules, in the same order"
"""What a rank is told when the ranks of a mesh did not make the same `shard` call (`agree_to_shard`)."""


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


def _call_error(records: dict[int, dict], kind: str) -> str:
    """The ranks that called another collective function than the lowest rank (`agree_to_call`), or `shard` on
    other modules (`agree_to_shard`)."""
    (low, base), *rest = sorted(records.items())
    calls = "; ".join(f"rank {r} called {record['config']['call']}" for r, record in rest)
    if kind == "shard":
        return (
            f"fsdp2_compile: the ranks of the mesh called shard on different modules: rank {low} called "
            f"{base['config']['call']}; {calls}. {_SHARD_RULE}: a rank that skipped a call (e.g. under "
            "`if rank == 0:`) or shards in another order meets the others' next call"
        )
    return (
        f"fsdp2_compile: the ranks called different collective functions: rank {low} called "
        f"{base['config']['call']}; {calls}. Every rank must call them, in the same order"
    )


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _ranges(ranks: list[int]) -> str:
    """Sorted ranks as "0-3, 5, 7-9"."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _named(ranks: list[int]) -> str:
    """Ranks as a list, "[0, 1]", or as ranges when there are many, "[0-511, 513-1023]"."""
    return str(ranks) if len(ranks) <= _LISTED else f"[{_ranges(ranks)}]"


def _holders(classes: list[list[int]]) -> str:
    """ "Ranks with the same record: [0-2, 4]; [3]" for the groups of ranks that hold the same record."""
    listed = "; ".join(f"[{_ranges(ranks)}]" for ranks in classes[:_LISTED])
    more = f"; and {len(classes) - _LISTED} more groups" if len(classes) > _LISTED else ""
    return f"Ranks with the same record: {listed}{more}"


def _with(message: str, holders: str) -> str:
    return f"{message}. {holders}" if holders else message


def wait_for_key(store: dist.Store, key: str, seconds: float) -> bool:
    """Whether `key` is set in `store` within `seconds` (False on the store's timeout; a lost store raises its
    DistNetworkError)."""
    try:
        store.wait([key], timedelta(seconds=max(seconds, 0.001)))
    except dist.DistStoreError:
        return False
    return True


# The ranks of each process group an agreement spans (a compiled graph's, `compiler/rank_consistency.py`; a
# compiled module's first call, `agree_at_first_call`; a call of the library's collective functions,
# `agree_to_call`; a `shard` call, `agree_to_shard`) agree on a record (a `CompileConfig`'s fields, a schedule, the
# call) through the default process group's store, then every rank raises the same kind of error, naming the ranks,
# as soon as one of these holds:
#
# 1. A peer published a failure: its compilation raised (rank, exception type and first line of the message).
# 2. The ranks' records differ: their `CompileConfig`s field by field ("rank 1 has CompileConfig.prefetch_depth=1,
#    rank 0 2"), the calls each rank made, or the schedules (from which each rank names the first differing
#    collective, `compiler/rank_consistency.py`).
# 3. A peer did not publish in time: it raised or crashed before (in its own code, which the library cannot see), is
#    late, or is somewhere else. "In time" is derived from the process group's timeout, waiting for at most
#    max(min(0.9 T, T - 5 s), T / 2) of it, so a late rank is waited for nearly as long as its first collective would
#    be, and this message comes before the collective's own timeout.
#
# The exchange costs each rank a constant number of store operations whatever the group's size, so rank 0's store
# can serve 10,000 ranks. Under the exchange's key K, each rank sets its record at K/r/<rank>, appends
# "<rank>:<sha256 of the record>;" to the digest list K/d and adds 1 to the count K/n. The rank whose add
# completes the count claims K/c, reads the digest list (one read) and writes the verdict K/v: "agreed" when the
# digests are equal; else it reads the records of the lowest rank of each distinct digest and the verdict carries the differing
# config fields, or the two schedules from which each rank names the first differing collective, and which ranks
# hold which record. Every other rank blocks on K/v in the store (no polling). A rank whose compilation raised
# appends its failure to K/f and writes the verdict itself, which ends every wait at once. The first rank whose wait
# runs out claims K/c and writes the verdict naming the ranks missing from the digest list (none missing: the rank
# that completed the count died before writing it, and this one writes what it would have); a rank that finds K/c
# claimed and no verdict a few seconds later names the claiming rank. The verdict is written once (compare-and-set),
# so every rank reads the same one. Having read it, each rank deletes its record and adds 1 to K/done, and the last
# of the ranks that joined deletes the exchange's keys; when a rank never joined, the verdict naming it stays, for it
# to read should it come.
#
# A rank exchanges once per group, under keys naming the group and a digest of its ranks (O(1) bytes whatever the
# group's size), with that group's ranks: stages of a pipeline-parallel job on disjoint sub-meshes never wait for or
# compare with each other, and with HSDP rank 0 compares with its shard peer and its replica, each of which compares
# with theirs. Within a group, exchanges are paired across ranks by their Dynamo frame (numbered per group in the
# order the backend first meets it) and kind; outside a compilation, by their number in the group (the ranks of a
# group make them in the same order). A record the ranks already agreed on under a key (a recompile of a frame, e.g.
# for a new input shape, which ranks with different data meet at different steps) is not exchanged again, so it
# never waits for the other ranks.
#
# Keys carry the token the group's ranks drew when `shard` made the group, else torchrun's restart count
# (`process_groups.attempt_token`), so a job restarted in place by torchrun's agent, whose store keeps the keys of
# the attempt that died (a verdict naming missing ranks among them), never reads them.
@dataclasses.dataclass
class _Channel:
    """One process group's part of an exchange: its ranks, the store key of this compilation there, and the records
    its ranks already agreed on for this frame and kind (shared with `_AGREED`)."""

    ranks: list[int]
    key: str
    agreed: list[str]

    def k(self, name: str) -> str:
        return f"{self.key}/{name}"


@dataclasses.dataclass
class _Exchange:
    """One compilation's exchange in the store, over the process groups of the graph, as `rank`."""

    kind: str
    channels: list[_Channel]
    wait_s: float
    pg_timeout_s: float
    store: dist.Store
    rank: int
    published: bool = False
    spent: bool = False
    failed: bool = False
    verdicts: list[dict] = dataclasses.field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted({r for ch in self.channels for r in ch.ranks})

    def publish(self, text: str) -> None:
        """Publish this rank's record (JSON) and digest; the rank completing a group's count writes its verdict."""
        entry = f"{self.rank}:{_digest(text)};"
        for ch in self.channels:
            self.store.set(ch.k(f"r/{self.rank}"), text)
            self.store.append(ch.k("d"), entry)
            if self.store.add(ch.k("n"), 1) == len(ch.ranks):
                self._close(ch)
        self.published = True

    def publish_failure(self, message: str) -> None:
        """Publish this rank's failure to compile: the verdict, unless one was written already."""
        for ch in self.channels:
            self.store.append(ch.k("f"), json.dumps([self.rank, message]) + "\n")
            failures = [json.loads(line) for line in self.store.get(ch.k("f")).decode().splitlines()]
            self.store.compare_set(ch.k("v"), "", json.dumps({"failed": failures}))
        self.published = self.failed = True

    def _close(self, ch: _Channel) -> None:
        """Claim the verdict of `ch` and write it from the digest list, unless another rank claimed it."""
        if self.store.compare_set(ch.k("c"), "", str(self.rank)) != str(self.rank).encode():
            return
        digests = {}
        for entry in self.store.get(ch.k("d")).decode().split(";")[:-1]:
            rank, digest = entry.split(":")
            digests[int(rank)] = digest
        verdict = self._verdict(ch, digests)
        self.store.compare_set(ch.k("v"), "", json.dumps(verdict))
        self.store.delete_key(ch.k("d"))

    def _verdict(self, ch: _Channel, digests: dict[int, str]) -> dict:
        """What every rank of `ch` reads: agreed, the ranks missing, or what differs."""
        missing = [r for r in ch.ranks if r not in digests]
        if missing:
            return {"missing": missing}
        by_digest: dict[str, list[int]] = {}
        for r in sorted(digests):
            by_digest.setdefault(digests[r], []).append(r)
        if len(by_digest) == 1:
            return {"agreed": next(iter(by_digest))}
        classes = list(by_digest.values())
        holders = _holders(classes) if len(ch.ranks) > 2 else ""
        firsts = [ranks[0] for ranks in classes[:_EXPLAINED]]
        records = {r: json.loads(v) for r, v in zip(firsts, self.store.multi_get([ch.k(f"r/{r}") for r in firsts]))}
        error = _call_error(records, self.kind) if self.kind in ("call", "shard") else _config_error(records)
        if error is not None:
            return {"error": _with(error, holders)}
        base = firsts[0]
        other = next((r for r in firsts[1:] if records[r]["schedule"] != records[base]["schedule"]), None)
        if other is None:
            return {"error": _with(f"fsdp2_compile: the ranks compiled different {self.kind} records", holders)}
        return {"schedules": [[r, records[r]["schedule"]] for r in (base, other)], "holders": holders}

    def await_verdicts(self) -> None:
        """Wait for each group's verdict, within the bounded wait; on running out, write it or name who should."""
        deadline = time.monotonic() + self.wait_s
        self.verdicts = [self._await(ch, deadline) for ch in self.channels]

    def _await(self, ch: _Channel, deadline: float) -> dict:
        if not wait_for_key(self.store, ch.k("v"), deadline - time.monotonic()):
            self._close(ch)
            if not wait_for_key(self.store, ch.k("v"), min(_FINISH_WAIT_S, self.wait_s)):
                claimer = self.store.get(ch.k("c")).decode()
                return {
                    "error": f"fsdp2_compile: rank {claimer} claimed the verdict of the {self.kind} schedule exchange "
                    f"with ranks {_named(ch.ranks)} but did not publish it within {self.wait_s:.0f} s: it most likely "
                    "exited or hangs (look at its error)"
                }
        return json.loads(self.store.get(ch.k("v")))

    def error(self, record: dict) -> str | None:
        """The error this rank raises for the verdicts it read, or None when they all agreed."""
        return next((e for v, ch in zip(self.verdicts, self.channels) if (e := self._error(v, ch, record))), None)

    def _error(self, verdict: dict, ch: _Channel, record: dict) -> str | None:
        if "agreed" in verdict:
            return None
        if "error" in verdict:
            return verdict["error"]
        if "failed" in verdict:
            return (
                "fsdp2_compile: "
                + "; ".join(f"rank {r} failed to compile its {self.kind} graph: {m}" for r, m in verdict["failed"])
                + ". Fix that error (the failing rank's own traceback shows where); the other ranks stopped "
                "here instead of waiting for it in a collective"
            )
        if "missing" in verdict and self.kind in ("call", "shard"):
            rule = "every rank must call it" if self.kind == "call" else f"{_SHARD_RULE}, with the same check_same_init"
            return (
                f"fsdp2_compile: rank(s) {_named(verdict['missing'])} did not call {record['config']['call']} within "
                f"{self.wait_s:.0f} s (the process group times out after {self.pg_timeout_s:.0f} s): {rule} "
                "(not under `if rank == 0:`); else they raised or crashed before it (look at their errors) "
                "or are late"
            )
        if "missing" in verdict and self.kind == "first-call":
            return (
                f"fsdp2_compile: rank(s) {_named(verdict['missing'])} did not make their first call of the compiled "
                f"module within {self.wait_s:.0f} s (the process group times out after {self.pg_timeout_s:.0f} s): "
                "they raised or crashed before it (look at their errors), or are late (e.g. slow data loading: raise "
                "the timeout of init_process_group)"
            )
        if "missing" in verdict:
            compile_id = current_compile_id()
            recompiling = (
                " This rank is recompiling a graph it compiled before, so a guard failed here and not there: "
                "something this graph depends on changed on this rank only (a parameter's requires_grad, a "
                "module setting such as set_requires_gradient_sync, an input's shape or dtype); "
                "TORCH_LOGS=recompiles names the guard."
                if compile_id is not None and compile_id[1] > 0
                else ""
            )
            return (
                f"fsdp2_compile: rank(s) {_named(verdict['missing'])} did not publish their {self.kind} schedule within "
                f"{self.wait_s:.0f} s (the process group times out after {self.pg_timeout_s:.0f} s): they "
                "raised or crashed before compiling this graph (look at their errors), are late (e.g. slow "
                "data loading: raise the timeout of init_process_group), or compiled different graphs (e.g. a "
                "data-dependent branch went another way there, so they did not need this graph: keep control "
                "flow the same on every rank)" + recompiling
            )
        (base, base_schedule), (other, other_schedule) = verdict["schedules"]
        mine = record["schedule"]
        r, theirs = (other, other_schedule) if mine == base_schedule else (base, base_schedule)
        if mine is None or theirs is None or mine == theirs:
            return _with(f"fsdp2_compile: the ranks compiled different {self.kind} records", verdict["holders"])
        return _with(_schedule_error(self.rank, mine, r, theirs, self.kind), verdict["holders"])

    def spend(self) -> None:
        """After a failed exchange: this rank's next exchange of these groups, frame and kind uses the next keys,
        not these (after `torch._dynamo.reset()` Dynamo numbers frames from 0 again, and the next compile of
        "frame 0" would read them). Every rank of the groups raised, so each spends its keys alike."""
        if not self.spent:
            for ch in self.channels:
                ch.agreed.append(_SPENT)
            self.spent = True

    def finish(self, wait: bool) -> None:
        """Count this rank as done with the exchange, deleting its record; the last rank of a group to be done
        deletes the group's keys (but a verdict naming missing ranks). With `wait` on rank 0, whose process hosts
        the store unless a launcher's agent does, give the others a few seconds to read the verdict too (this rank
        is about to raise, and may exit)."""
        deadline, pause = time.monotonic() + min(_FINISH_WAIT_S, self.wait_s), 0.005
        with contextlib.suppress(dist.DistError):  # best effort: the store may be gone already
            verdicts = self.verdicts or [{}] * len(self.channels)
            for ch, verdict in zip(self.channels, verdicts):
                if not self.failed:
                    self.store.delete_key(ch.k(f"r/{self.rank}"))
                if self.store.add(ch.k("done"), 1) >= len(ch.ranks) - len(verdict.get("missing", [])):
                    kept = ("v",) if "missing" in verdict else ()
                    for name in {"d", "n", "c", "f", "v", "done"} - set(kept):
                        self.store.delete_key(ch.k(name))
            while (
                wait
                and self.rank == 0
                and time.monotonic() < deadline
                and any(self.store.check([ch.k("done")]) for ch in self.channels)
            ):
                time.sleep(pause)
                pause = min(2 * pause, 0.2)


def forget_frames(frames: set[Hashable]) -> None:
    """Forget the numbers and agreed records of `frames` (their module died)."""
    for scope, numbers in _FRAMES.items():
        prefixes = [check_key(scope, f"f{numbers.pop(f)}", "") for f in frames if f in numbers]
        for key in [k for k in _AGREED if any(k.startswith(p) for p in prefixes)]:
            del _AGREED[key]


def group_scope(name: str, ranks: list[int]) -> str:
    """A process group as store keys name it: its name, this attempt's token (`process_groups.attempt_token`: no
    key of an earlier attempt is read), its size and a digest of its ranks. O(1) bytes in the group's size."""
    token = attempt_token(name)
    digest = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    return f"{token + '/' if token else ''}{name}@{len(ranks)}:{digest}"


def check_key(scope: str, numbered: str, kind: str) -> str:
    """The store key of an exchange in the group `scope` (`group_scope`): the compilation (`numbered`) and kind."""
    return f"fsdp2_compile/check/{scope}/{numbered}/{kind}"


def _channel(name: str, ranks: list[int], kind: str, frame: Hashable | None) -> _Channel:
    """The store key of this compilation in the group called `name`: the group (`group_scope`), the compilation's
    `frame` (numbered in the order the backend met the group's frames), the kind and how many records were
    agreed."""
    scope = group_scope(name, ranks)
    if frame is None:  # outside Dynamo (`agree_to_call`, ...): numbered per group, as the group's ranks call it
        key = check_key(scope, f"n{next(_UNNAMED.setdefault(scope, itertools.count()))}", kind)
        return _Channel(ranks, f"{key}/0", [])  # a key of its own: nothing to remember
    frames = _FRAMES.setdefault(scope, {})
    if frame not in frames:
        frames[frame] = next(_FRAME_COUNT.setdefault(scope, itertools.count()))
    key = check_key(scope, f"f{frames[frame]}", kind)
    agreed = _AGREED.setdefault(key, [])
    return _Channel(ranks, f"{key}/{len(agreed)}", agreed)


def _group_ranks(names: set[str]) -> dict[str, list[int]]:
    """The ranks of each process group called in `names` ("world": the default group) that has more than one."""
    world = list(range(dist.get_world_size()))
    groups = {g: world if g == "world" else sorted(group_ranks(g)) for g in sorted(names)}
    return {g: ranks for g, ranks in groups.items() if len(ranks) > 1}


def _exchange_over(
    names: set[str], kind: str, timeout_s: float | None, frame: Hashable | None = None
) -> _Exchange | None:
    """An exchange over the process groups called `names` ("world": the default group) of more than one rank, for
    a compilation of `frame` (None: outside a compilation)."""
    groups = _group_ranks(names)
    if not groups:
        return None
    pg_timeout = min(group_timeout(None if g == "world" else g) for g in groups)
    wait_s = timeout_s if timeout_s is not None else max(min(0.9 * pg_timeout, pg_timeout - 5), pg_timeout / 2)
    channels = [_channel(g, ranks, kind, frame) for g, ranks in groups.items()]
    return _Exchange(kind, channels, wait_s, pg_timeout, default_store(), dist.get_rank())


def _agree(ex: _Exchange, record: dict) -> str | None:
    """Exchange this rank's record; the error it raises, or None once the ranks agreed on it."""
    text = json.dumps(record)
    if all(text in ch.agreed for ch in ex.channels):
        return None
    try:
        ex.publish(text)
        ex.await_verdicts()
    except dist.DistNetworkError as e:
        what = {"first-call": "first-call records", "call": "calls", "shard": "shard calls"}.get(
            ex.kind, f"{ex.kind} schedules"
        )
        raise RuntimeError(
            f"fsdp2_compile: lost the process group's store while exchanging {what} with ranks {_named(ex.ranks)}: "
            "the process hosting it (rank 0, unless a launcher such as torchrun hosts it) has most likely exited: "
            f"look at its error ({str(e).strip().splitlines()[0]})"
        ) from e
    error = ex.error(record)
    ex.finish(wait=error is not None)
    if error is None:
        for ch in ex.channels:
            ch.agreed.append(text)
    return error


def agree_or_raise(ex: _Exchange, record: dict) -> None:
    """Exchange `record` over `ex`; on any difference or failure raise on every rank, this exchange's keys spent."""
    try:
        error = _agree(ex, record)
    except Exception:
        ex.spend()
        raise
    if error is not None:
        ex.spend()
        raise RuntimeError(error)


def _agree_outside_compile(names: set[str], kind: str, fields: dict[str, str]) -> None:
    """Exchange `fields` over the process groups `names`, outside any compilation; raise on every rank naming the
    ranks that differ or are missing."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    ex = _exchange_over(names, kind, None)
    if ex is not None:
        agree_or_raise(ex, {"config": fields, "schedule": None})


def agree_at_first_call(group_names: set[str], config_fields: dict[str, str]) -> None:
    """At a compiled module's first call, before anything is compiled: agree over the process groups of its
    parameters on `config_fields` (the `CompileConfig` fields that decide how the call starts), raising on every
    rank, naming the ranks, when they differ or a rank is missing, as the schedule exchange does."""
    _agree_outside_compile(group_names, "first-call", config_fields)


def agree_to_call(what: str) -> None:
    """Before the first collective of the library's collective function `what` (`save_checkpoint`, ...): every rank
    of the default process group says so through the store (a constant number of operations per rank), so that a
    rank calling another one is named at once on every rank, and one that does not come is named within the
    bounded wait, instead of the collective hanging until the process group's timeout."""
    _agree_outside_compile({"world"}, "call", {"call": what})


def agree_to_shard(call: str, group_names: set[str]) -> None:
    """Before the first collective of a `shard` call (`call`, e.g. "shard(Block)"): every rank of the mesh's process
    groups `group_names` says so through the store (a constant number of operations per rank and group), so that
    ranks sharding different modules are named at once on every rank, and a rank that does not call `shard` is
    named within the bounded wait, instead of the others waiting in a collective until the process group's
    timeout."""
    _agree_outside_compile(group_names, "shard", {"call": call})


def exchange(
    store: dist.Store,
    rank: int,
    ranks: list[int],
    key: str,
    record: dict | None = None,
    *,
    failure: str | None = None,
    kind: str = "forward",
    wait_s: float = 15.0,
    pg_timeout_s: float = 20.0,
) -> str | None:
    """One exchange among `ranks` under `key` in `store`, as `rank`, without a process group: what the backend
    runs for each group of a graph, for simulating many ranks against one store. `record` is {"config": {field:
    repr}, "schedule": signature or None}; `failure` (instead) publishes a failure to compile. Returns the error
    this rank raises (None when the ranks agreed); a lost store raises."""
    ex = _Exchange(kind, [_Channel(sorted(ranks), key, [])], wait_s, pg_timeout_s, store, rank)
    if failure is not None:
        ex.publish_failure(failure)
        ex.finish(wait=True)
        return failure
    return _agree(ex, record)
