"""The rank-consistency exchange at scale: N simulated ranks against one real TCPStore, as rank 0's store serves a
job of N ranks for each compiled graph.

    .venv/bin/python benchmarks/control_plane.py [--ranks 16 64 256 1024 2048] [--old-up-to 256] [--faults 1024]
        [--repeat 3]

Each simulated rank is a thread with its own TCPStore client connected to one master store on a free localhost
port, running one exchange of a record (a default CompileConfig and the forward schedule of a 12-layer GPT's
per-block all-gathers). `new` is `rank_agreement.exchange`, what the backend runs per process group; `old` is the
read pattern it replaced: every rank sets its record, polls until every peer's key exists, then reads every peer's
record; `floor` makes 7 round trips per rank and nothing else, what the simulation itself costs (the clients and
the server share this machine's cores). The keys are built by the code the library builds them with. Store
operations and bytes (keys and values, both ways) are counted by wrapping each client. Per N and algorithm it
prints the wall time of one exchange (all threads released at once, until the last returns), the operations and
bytes in total, on a median rank and on the busiest rank, and the store's keys left afterwards: the run of median time of `--repeat` runs. `--faults N` also runs N ranks with one rank's record
different and with one rank absent, and checks that every rank's error names it, then the step watch's exchange
(`compiler/step_watch.py`) with the ranks stalled at two places and one absent.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp2_compile.compiler.step_watch import _Group, exchange_steps, step_round  # noqa: E402
from fsdp2_compile.config import CompileConfig  # noqa: E402
from fsdp2_compile.runtime.rank_agreement import check_key, exchange, group_scope  # noqa: E402


def gpt_record(layers: int = 12, width: int = 768) -> dict:
    """The record a rank exchanges for the forward graph of a GPT whose blocks are sharded one by one."""
    config = CompileConfig()
    fields = {
        f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config) if not f.metadata.get("rank_local")
    }
    names = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight"]
    names += ["attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias"]
    names += ["mlp.c_proj.weight", "mlp.c_proj.bias"]
    block_bytes = 4 * (12 * width * width + 13 * width)
    lines = [f"all_gather:float32:{block_bytes}:{','.join(f'blocks.{i}.{n}' for n in names)}" for i in range(layers)]
    return {"config": fields, "schedule": "\n".join(lines)}


class CountingStore:
    """A store client that counts the operations it sends and the bytes of keys and values both ways."""

    def __init__(self, store: dist.Store):
        self.store, self.ops, self.bytes = store, 0, 0

    def _count(self, *parts) -> None:
        self.ops += 1
        self.bytes += sum(len(p) for p in parts)

    def set(self, key, value):
        self._count(key, value)
        return self.store.set(key, value)

    def append(self, key, value):
        self._count(key, value)
        return self.store.append(key, value)

    def get(self, key):
        value = self.store.get(key)
        self._count(key, value)
        return value

    def multi_get(self, keys):
        values = self.store.multi_get(keys)
        self._count(*keys, *values)
        return values

    def add(self, key, amount):
        self._count(key, "01234567")
        return self.store.add(key, amount)

    def compare_set(self, key, expected, desired):
        value = self.store.compare_set(key, expected, desired)
        self._count(key, expected, desired, value)
        return value

    def check(self, keys):
        self._count(*keys)
        return self.store.check(keys)

    def wait(self, keys, timeout):
        self._count(*keys)
        return self.store.wait(keys, timeout)

    def delete_key(self, key):
        self._count(key)
        return self.store.delete_key(key)


def old_exchange(store, rank: int, ranks: list[int], key: str, record: dict, wait_s: float) -> str | None:
    """The replaced read pattern: set this rank's record, poll until every peer's exists, read them all."""
    store.set(f"{key}/{rank}", json.dumps(record))
    keys = {r: f"{key}/{r}" for r in ranks}
    deadline, pause = time.monotonic() + wait_s, 0.005
    while not store.check(list(keys.values())) and not store.check([f"{key}/failed"]):
        if time.monotonic() > deadline:
            return f"rank(s) {[r for r, k in keys.items() if not store.check([k])]} did not publish"
        time.sleep(pause)
        pause = min(2 * pause, 0.2)
    found = {r: json.loads(store.get(k)) for r, k in keys.items() if store.check([k])}
    store.add(f"{key}/done", 1)
    return next((f"rank {rank} and rank {r} differ" for r, rec in found.items() if rec != record), None)


@dataclasses.dataclass
class Outcome:
    seconds: float
    errors: dict[int, str | None]
    ops: list[int]
    bytes: list[int]
    keys_left: int


_MASTER: list[dist.TCPStore] = []
_CLIENTS: list[dist.TCPStore] = []
_CALLS = itertools.count()


def _connected(n: int) -> tuple[dist.TCPStore, list[dist.TCPStore]]:
    """One master store on a free localhost port, and at least `n` clients of it, kept for later calls (made at
    once, on threads: some connections are slow to be accepted)."""
    if not _MASTER:
        _MASTER.append(dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60), wait_for_workers=False))
        threading.stack_size(1 << 20)
    port, more = _MASTER[0].port, [None] * max(0, n - len(_CLIENTS))

    def connect(i: int) -> None:
        more[i] = dist.TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=60))

    threads = [threading.Thread(target=connect, args=(i,)) for i in range(len(more))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _CLIENTS.extend(more)
    return _MASTER[0], _CLIENTS


def _released_together(ranks: list[int], run) -> float:
    """Run `run(rank)` for every rank on a thread of its own, all released at once; the seconds until the last
    returns."""
    start = threading.Barrier(len(ranks) + 1)

    def released(r: int) -> None:
        start.wait()
        run(r)

    threads = [threading.Thread(target=released, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - began


def simulate(
    n: int,
    algorithm: str = "new",
    *,
    record: dict | None = None,
    differing: dict[int, dict] | None = None,
    absent: tuple[int, ...] = (),
    failing: dict[int, str] | None = None,
    wait_s: float = 30.0,
    wrap=CountingStore,
) -> Outcome:
    """One exchange among `n` simulated ranks: `differing` ranks exchange their own record, `absent` ones never
    join, `failing` ones publish a failure to compile. `wrap` makes each rank's client (a `CountingStore`)."""
    record = record or gpt_record()
    differing, failing = differing or {}, failing or {}
    master, raw = _connected(n)
    present = [r for r in range(n) if r not in absent]
    clients = {r: wrap(raw[r]) for r in present}
    keys_before = master.num_keys()
    errors: dict[int, str | None] = {}
    ranks = list(range(n))  # the key as the backend builds it, for a group named as torch names them
    key = check_key(group_scope(str(next(_CALLS)), ranks), "f0", "forward") + "/0"

    def run(r: int) -> None:
        mine = differing.get(r, record)
        try:
            if algorithm == "floor":  # 7 round trips and nothing else: what the simulation itself costs
                for _ in range(7):
                    clients[r].add(f"{key}/floor", 0)
                errors[r] = None
            elif algorithm == "old":
                errors[r] = old_exchange(clients[r], r, ranks, key, mine, wait_s)
            else:
                errors[r] = exchange(clients[r], r, ranks, key, mine, failure=failing.get(r), wait_s=wait_s)
        except Exception as e:  # noqa: BLE001 - reported per rank
            errors[r] = f"{type(e).__name__}: {e}"

    seconds = _released_together(present, run)
    ops = [c.ops for c in clients.values()]
    nbytes = [c.bytes for c in clients.values()]
    keys_left = master.num_keys() - keys_before - (algorithm == "floor")
    return Outcome(seconds, errors, ops, nbytes, keys_left)


def _row(n: int, algorithm: str, out: Outcome) -> str:
    failed = sum(e is not None for e in out.errors.values())
    return (
        f"| {n} | {algorithm} | {out.seconds:.3f} | {sum(out.ops):,} | {max(out.ops):,} | "
        f"{sum(out.bytes) / 1e6:,.2f} | {sorted(out.bytes)[len(out.bytes) // 2]:,} | {max(out.bytes) / 1e3:,.1f} | "
        f"{out.keys_left} |" + (f" {failed} ranks raised |" if failed else "")
    )


def faults(n: int) -> None:
    """One rank's record different, then one rank absent: every rank's error must name it."""
    odd = n // 2 + 1
    other = gpt_record()
    other["schedule"] = other["schedule"].replace("float32", "bfloat16", 1)
    out = simulate(n, differing={odd: other})
    expected = {r: f"rank {r} and rank {odd if r != odd else 0} compiled different" for r in range(n)}
    wrong = [r for r, e in out.errors.items() if not e or expected[r] not in e]
    print(f"{n} ranks, rank {odd}'s schedule differs: {out.seconds:.3f} s, keys left {out.keys_left}, wrong: {wrong}")
    print(f"  rank 0 says: {out.errors[0][:200]} ... {out.errors[0][-80:]}")
    wait_s = 3.0
    out = simulate(n, absent=(odd,), wait_s=wait_s)
    wrong = [r for r, e in out.errors.items() if not e or f"rank(s) [{odd}] did not publish" not in e]
    print(
        f"{n} ranks, rank {odd} absent (wait {wait_s:.0f} s): {out.seconds:.3f} s, keys left {out.keys_left}, wrong: {wrong}"
    )
    print(f"  rank 0 says: {out.errors[0][:120]}")


def simulate_stall(n: int, wait_s: float = 3.0) -> Outcome:
    """The step watch's exchange when ranks stop pairing their collectives: of `n` simulated ranks, the lower half
    waits in forward 3, the upper half in backward 2, and rank n // 2 + 1 never comes. Its errors are each rank's
    message."""
    absent = n // 2 + 1
    master, raw = _connected(n)
    present = [r for r in range(n) if r != absent]
    clients = {r: CountingStore(raw[r]) for r in present}
    keys_before = master.num_keys()
    messages: dict[int, str | None] = {}
    ranks = list(range(n))
    key = _Group(str(next(_CALLS)), ranks, wait_s).key  # the step watch's key

    def run(r: int) -> None:
        record = "forward:3:2:0" if r < n // 2 else "backward:2:2:0"
        at = f"{key}/{step_round(clients[r], key)}"  # the group's current round, as each rank reads it
        messages[r] = exchange_steps(clients[r], r, ranks, at, record, wait_s)

    seconds = _released_together(present, run)
    ops, nbytes = [c.ops for c in clients.values()], [c.bytes for c in clients.values()]
    return Outcome(seconds, messages, ops, nbytes, master.num_keys() - keys_before)


def stalled_steps(n: int, wait_s: float = 3.0) -> None:
    out = simulate_stall(n, wait_s)
    absent = n // 2 + 1
    words = (
        "in forward 3 (forwards 3, backwards 2)",
        "in backward 2 (forwards 2, backwards 2)",
        f"[{absent}] not seen",
    )
    wrong = [r for r, m in out.errors.items() if not m or not all(w in m for w in words)]
    ops = sorted(out.ops)
    print(
        f"{n} ranks stalled at two places, rank {absent} absent (wait {wait_s:.0f} s): {out.seconds:.3f} s, store "
        f"ops {sum(ops):,} (busiest rank {ops[-1]}, median {ops[len(ops) // 2]}), keys left {out.keys_left}, wrong: "
        f"{wrong}"
    )
    print(f"  rank 0 says: {out.errors[0][:200]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256, 1024, 2048])
    parser.add_argument("--old-up-to", type=int, default=256, help="run the replaced algorithm up to this N")
    parser.add_argument("--faults", type=int, default=1024, help="N for the mismatch and absent-rank runs (0: none)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per N and algorithm: the median's row is shown")
    args = parser.parse_args()
    print(f"record: {len(json.dumps(gpt_record()))} bytes of JSON")
    print(
        "| ranks | algorithm | seconds | store ops | ops, busiest rank | MB | bytes, median rank | kB, busiest rank "
        "| keys left |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.ranks:
        for algorithm in ("floor", "old", "new") if n <= args.old_up_to else ("floor", "new"):
            runs = sorted((simulate(n, algorithm) for _ in range(args.repeat)), key=lambda out: out.seconds)
            print(_row(n, algorithm, runs[len(runs) // 2]), flush=True)
    if args.faults:
        faults(args.faults)
        stalled_steps(args.faults)


if __name__ == "__main__":
    main()
