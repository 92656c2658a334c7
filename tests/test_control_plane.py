"""The rank-consistency exchange (`rank_agreement.exchange`) with simulated ranks: threads, each with its own
client of one real TCPStore, as benchmarks/control_plane.py runs it. Each rank's store operations stay bounded
whatever the number of ranks, the errors name the right ranks, and an exchange leaves no key behind."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
spec = importlib.util.spec_from_file_location("control_plane", os.path.join(ROOT, "benchmarks", "control_plane.py"))
cp = sys.modules["control_plane"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cp)

N = 32


def _other_schedule() -> dict:
    record = cp.gpt_record()
    record["schedule"] = record["schedule"].replace("float32", "bfloat16", 1)
    return record


def test_each_ranks_store_operations_do_not_grow_with_the_ranks():
    small, large = cp.simulate(8), cp.simulate(N)
    for out in (small, large):
        assert all(e is None for e in out.errors.values()), out.errors
        assert out.keys_left == 0
    # every rank: its record, digest, count, wait, verdict, delete, done (7); the closing rank also claims, reads
    # the digests, writes the verdict and deletes them (4), the last one done deletes the 6 keys of the exchange
    for out in (small, large):
        assert max(out.ops) <= 7 + 4 + 6 and sorted(out.ops)[-3] == 7, out.ops
    # nor do a rank's bytes: its keys name each group by a digest of its ranks, not by the list
    median = [sorted(out.bytes)[len(out.bytes) // 2] for out in (small, large)]
    assert median[1] - median[0] <= 7 * 4, median  # the group's size in each key: a few digits more


def test_a_rank_with_another_schedule_is_named_on_every_rank():
    odd = 17
    out = cp.simulate(N, differing={odd: _other_schedule()})
    for rank, error in out.errors.items():
        peer = 0 if rank == odd else odd
        assert f"rank {rank} and rank {peer} compiled different forward schedules" in error, error
        assert "collective #0: all_gather:float32:" in error if rank != odd else "all_gather:bfloat16:" in error
        assert error.endswith(f"Ranks with the same record: [0-16, 18-{N - 1}]; [17]"), error
    assert out.keys_left == 0


def test_a_rank_with_another_config_is_named_on_every_rank():
    other = cp.gpt_record()
    other["config"] = other["config"] | {"prefetch_depth": "1"}
    out = cp.simulate(N, differing={5: other, 9: other})
    for error in out.errors.values():
        assert "rank 5 has CompileConfig.prefetch_depth=1, rank 0 2" in error, error
        assert "Give every rank the same CompileConfig" in error and "[0-4, 6-8, 10-31]; [5, 9]" in error
    assert out.keys_left == 0


def test_an_absent_rank_is_named_after_the_wait_and_only_the_verdict_stays():
    out = cp.simulate(N, absent=(20,), wait_s=1.0)
    for error in out.errors.values():
        assert "rank(s) [20] did not publish their forward schedule within 1 s" in error, error
    assert 1.0 <= out.seconds
    assert out.keys_left == 1  # the verdict, for rank 20 to read should it come


def test_a_failure_ends_every_wait_at_once():
    out = cp.simulate(N, failing={3: "ValueError: injected"}, wait_s=30.0)
    for rank, error in out.errors.items():
        if rank != 3:
            assert error.startswith("fsdp2_compile: rank 3 failed to compile its forward graph: ValueError: injected")
    assert out.seconds < 15  # not the wait
    assert out.keys_left == 0


class _Died(Exception):
    pass


def test_a_rank_that_dies_before_writing_the_verdict_is_named():
    """The rank whose arrival completed the count claims the verdict, then dies before writing it."""
    died = threading.Event()

    class DiesAtTheVerdict(cp.CountingStore):
        def compare_set(self, key, expected, desired):
            if key.endswith("/v") and not died.is_set():
                died.set()
                raise _Died("exited")
            return super().compare_set(key, expected, desired)

    out = cp.simulate(8, wait_s=1.0, wrap=DiesAtTheVerdict)
    [dead] = [r for r, e in out.errors.items() if e == "_Died: exited"]
    for rank, error in out.errors.items():
        if rank != dead:
            assert f"rank {dead} claimed the verdict of the forward schedule exchange with ranks" in error, error
            assert "did not publish it within 1 s" in error


@pytest.mark.parametrize("late", [False, True])
def test_a_rank_that_dies_before_claiming_the_verdict_is_replaced(late):
    """The rank completing the count dies before claiming the verdict: the first whose wait runs out writes it."""
    died = threading.Event()

    class DiesAtTheClaim(cp.CountingStore):
        def compare_set(self, key, expected, desired):
            if key.endswith("/c") and not died.is_set():
                died.set()
                raise _Died("exited")
            return super().compare_set(key, expected, desired)

    differing = {4: _other_schedule()} if late else {}
    out = cp.simulate(8, wait_s=1.0, wrap=DiesAtTheClaim, differing=differing)
    [dead] = [r for r, e in out.errors.items() if e == "_Died: exited"]
    for rank, error in out.errors.items():
        if rank != dead:
            assert (error is None) if not late else ("compiled different forward schedules" in error), error


def test_the_step_watch_names_every_place_and_the_absent_rank_at_a_constant_cost_per_rank():
    for n in (8, N):
        out = cp.simulate_stall(n, wait_s=1.0)
        absent = n // 2 + 1
        for message in out.errors.values():
            assert f"rank(s) [{_lower(n)}] in forward 3 (forwards 3, backwards 2)" in message, message
            assert f"[{absent}] not seen in a compiled step" in message, message
        # each rank reads the round, appends, counts, waits, tries the claim, waits, reads (7; fewer where the verdict
        # is written before it tries the claim); the one claiming reads the list, writes
        assert sorted(out.ops)[-2] <= 7 and max(out.ops) == 9, out.ops


def _lower(n: int) -> str:
    """The lower half of `n` ranks as an error lists them (ranges past 8 ranks)."""
    return ", ".join(map(str, range(n // 2))) if n <= 8 else f"0-{n // 2 - 1}"


def test_nothing_kept_per_model_or_per_save_outlives_it(tmp_path):
    from harness import run_ranks
    from workers import kept_after_models_and_saves

    for r in run_ranks(kept_after_models_and_saves, 2, 20, 100, str(tmp_path)):
        assert r["after_models"] == r["after_one"] == {"agreed": 0, "frames": 0, "owners": 0, "counted": 0}, r
        assert r["after_saves"] == r["after_models"], r
