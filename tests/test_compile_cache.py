"""Saved compiles (`CompileConfig.compile_cache`): Dynamo traces and guards every call, and what the backend
compiled is loaded from torch's AOTAutograd cache only under the same key. Every kind of thing Dynamo guards is
changed between calls and between launches (each launch its own process), and every call is compared with the
model unsharded; a relaunch trains bitwise as its first launch, also when one rank's cache is gone."""

from __future__ import annotations

import torch
from cache_workers import first_call, output_dtype_call, probe_calls, train_cached
from harness import run_ranks

HELPER = "def helper(y):\n    return y {}\n"


def _launch(tmp_path, changed=(), package_changed=False) -> dict:
    [result] = run_ranks(probe_calls, 1, str(tmp_path / "helper"), list(changed), package_changed)
    assert not result["wrong"], result["wrong"]  # every call as the unsharded model computes it
    return result


def test_no_call_replays_a_compile_of_other_arguments_state_or_code(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "helper").mkdir()
    helper = tmp_path / "helper" / "cache_helper.py"
    helper.write_text(HELPER.format("+ 1"))
    first = _launch(tmp_path)["events"]
    assert first.count("stored") >= 10, first  # each guard that failed: compiled (or an identical graph loaded)
    again = _launch(tmp_path)["events"]
    assert again.count("hit") == len(again), again  # a relaunch loads them all
    # a relaunch whose model state and globals changed: right, whatever it loads
    changed = ["config field", "dict value", "list length", "attribute function", "global flag", "module-level dict"]
    _launch(tmp_path, [*changed, "eval"])
    helper.write_text(HELPER.format("* 3"))  # a function in another file edited between launches
    assert "miss" in _launch(tmp_path)["events"]
    edited = _launch(tmp_path, package_changed=True)["events"]  # this package's code changed: its first graph compiles
    assert edited[:2] == ["miss", "stored"], edited


def test_the_output_dtype_of_the_mixed_precision_policy_is_in_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert run_ranks(output_dtype_call, 1, None)[0] == {"dtype": "torch.float32", "events": ["miss", "stored"]}
    assert run_ranks(output_dtype_call, 1, "float64")[0] == {"dtype": "torch.float64", "events": ["miss", "stored"]}
    assert run_ranks(output_dtype_call, 1, "float64")[0] == {"dtype": "torch.float64", "events": ["hit"]}


def _same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["shards"][k], b["shards"][k]) for k in a["shards"])


def test_a_relaunch_loads_and_trains_bitwise_and_a_rank_whose_cache_is_gone_compiles_beside_ranks_that_load(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cold = run_ranks(train_cached, 2, "gpt", 2, True)  # blocks sharded, gradient accumulation
    for r in cold:
        assert "hit" not in r["events"] and "stored" in r["events"], r["events"]
        assert "flip_error" not in r  # compiled here: the backward runs a variant, as without the cache
    warm = run_ranks(train_cached, 2, "gpt", 2, True)
    for r, c in zip(warm, cold):
        assert set(r["events"]) == {"hit"} and _same(r, c), r["events"]
        assert "changed between a forward and its backward" in r["flip_error"]  # a loaded backward refuses
    monkeypatch.setenv("EMPTIED_RANK", "1")  # rank 1 compiles alone; rank 0 loads; they check one another
    mixed = run_ranks(train_cached, 2, "gpt", 2, True)
    assert set(mixed[0]["events"]) == {"hit"} and "hit" not in mixed[1]["events"]
    for r, c in zip(mixed, cold):
        assert _same(r, c)


def test_a_rank_without_compile_cache_is_named_on_every_rank_and_with_it_the_link_is_not_measured(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    for r in run_ranks(first_call, 2, [True, False]):
        assert "rank 1 has CompileConfig.compile_cache=False, rank 0 True" in r["error"], r
    assert run_ranks(first_call, 2, [True, True]) == [{"error": None, "measured": False}] * 2
    assert run_ranks(first_call, 2, [False, False]) == [{"error": None, "measured": True}] * 2


def test_on_hsdp_a_rank_whose_cache_is_gone_compiles_while_its_shard_and_replica_peers_load(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cold = run_ranks(train_cached, 4, "gpt", 2, False, True)
    monkeypatch.setenv("EMPTIED_RANK", "3")
    mixed = run_ranks(train_cached, 4, "gpt", 2, False, True)
    for rank, (r, c) in enumerate(zip(mixed, cold)):
        assert ("hit" not in r["events"]) if rank == 3 else (set(r["events"]) == {"hit"}), (rank, r["events"])
        assert _same(r, c)


def test_on_fsdp_and_tp_a_rank_whose_cache_is_gone_compiles_while_the_others_load(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cold = run_ranks(train_cached, 4, "gpt", 2, False, False, True, timeout=300)  # 2 dp x 2 tp
    monkeypatch.setenv("EMPTIED_RANK", "3")
    mixed = run_ranks(train_cached, 4, "gpt", 2, False, False, True, timeout=300)
    for rank, (r, c) in enumerate(zip(mixed, cold)):
        assert ("hit" not in r["events"]) if rank == 3 else (set(r["events"]) == {"hit"}), (rank, r["events"])
        assert _same(r, c)
