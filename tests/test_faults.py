"""Faults around the cross-rank schedule check (fsdp2_compile.compiler.rank_consistency) and the other agreements
of ranks through the store (fsdp2_compile.runtime.rank_agreement: `shard`, the checkpoint functions), on spawned gloo
ranks whose process group times out after 20 s (so the check waits at most 15 s): every rank ends within a bound,
and every surviving rank's error names the cause.

One 2-rank job runs the cases that leave the process group usable one after the other (cached, several tests read
it); a killed rank, a rank hosting the store that exits, and the 4-rank layouts (pipeline stages, HSDP) get a job each.
"""

from __future__ import annotations

import functools
import math
import re

import fault_workers
from fault_workers import PG_TIMEOUT_S, run_faults

WAIT_S = PG_TIMEOUT_S - 5  # what the check waits for a rank that never publishes (max(min(0.9 T, T - 5), T / 2))
BOUND_S = PG_TIMEOUT_S  # a case must end by itself: one that only the process group's timeout ended fails


@functools.cache
def _job(name: str, world_size: int = 2) -> list[dict]:
    return run_faults(getattr(fault_workers, name), world_size)


def _case(case: str, job: str = "same_process_group_faults", world_size: int = 2) -> list[dict]:
    """Every rank's outcome of `case`: {"error": "<type>: <message>" or None, "seconds": time to end}."""
    results = _job(job, world_size)
    assert all("job" not in r for r in results), [r.get("job") for r in results]  # a job's own error
    return [r.get(case) for r in results]


def test_a_rank_raising_in_its_pass_pipeline_is_named_by_the_others_at_once():
    r0, r1 = _case("raise_in_compile")
    assert "ValueError: injected failure in a pass on rank 1" in r1["error"], r1
    words = "rank 1 failed to compile its forward graph: ValueError: injected failure in a pass on rank 1."
    assert words in r0["error"], r0
    assert "second line" not in r0["error"]  # only the first line of the message is published
    assert (
        abs(r0["seconds"] - r1["seconds"]) < 3 and r0["seconds"] < WAIT_S
    )  # named at once, not after the bounded wait


def test_a_compile_after_a_failed_one_and_a_dynamo_reset_trains_on_every_rank():
    """Dynamo numbers frames from 0 again after `torch._dynamo.reset()`: the new compile's exchange must not read
    the failed one's records (it did: rank 0 raised naming rank 1's old failure, rank 1 waited out gloo's timeout)."""
    r0, r1 = _case("compile_after_reset")
    assert r0["error"] is None and r1["error"] is None, (r0, r1)
    assert max(r0["seconds"], r1["seconds"]) < WAIT_S


def test_a_rank_raising_before_its_first_compile_is_named_after_the_bounded_wait():
    r0, r1 = _case("raise_before_compile")
    assert r1["error"] == "ValueError: data loader failed on rank 1", r1
    words = f"rank(s) [1] did not make their first call of the compiled module within {WAIT_S:.0f} s"
    assert f"{words} (the process group times out after {PG_TIMEOUT_S:.0f} s)" in r0["error"], r0
    assert "raised or crashed before it" in r0["error"] and "are late" in r0["error"]
    # its own message, before the process group's timeout would fire
    assert WAIT_S <= r0["seconds"] < BOUND_S, r0


def test_a_late_rank_is_waited_for():
    r0, r1 = _case("late_rank")
    assert r0["error"] is None and r1["error"] is None, (r0, r1)
    assert r0["seconds"] >= 8  # rank 0 waited for rank 1's 8 s late start


def test_divergent_models_name_the_first_differing_collective():
    r0, r1 = _case("different_widths")
    assert "rank 0 and rank 1 compiled different forward schedules" in r0["error"], r0
    assert "collective #1: all_gather:float32:1088 here vs all_gather:float32:1632 on rank 1" in r0["error"], r0
    assert "collective #1: all_gather:float32:1632 here vs all_gather:float32:1088 on rank 0" in r1["error"], r1
    assert 'pipeline stages: shard each stage over the dp slice of the mesh (mesh["dp"])' in r0["error"], r0
    assert max(r0["seconds"], r1["seconds"]) < BOUND_S


def test_a_data_dependent_branch_names_the_parameters_each_rank_gathers_alone():
    r0, r1 = _case("data_dependent_branch")
    for rank, outcome in enumerate((r0, r1)):
        error = outcome["error"]
        assert f"rank {rank} and rank {1 - rank} compiled different forward schedules" in error, error
        only = dict(re.findall(r"all_gather of (\w)\.bias, \w\.weight on rank (\d) only", error))
        assert sorted(only) == ["b", "c"] and sorted(only.values()) == ["0", "1"], error
        assert outcome["seconds"] < BOUND_S


def test_different_configs_are_named_field_by_field():
    for case, words in [
        ("prefetch_depth", "rank 1 has CompileConfig.prefetch_depth=1, rank 0 2"),
        ("check_off_on_rank_1", "rank 1 has CompileConfig.check_rank_consistency=False, rank 0 True"),
    ]:
        for outcome in _case(case):
            assert words in outcome["error"] and "Give every rank the same CompileConfig" in outcome["error"], outcome
            assert outcome["seconds"] < BOUND_S  # not a wait for a rank that does not check


def test_exchanges_that_every_rank_joined_leave_no_key_in_the_store():
    # agreed, failed to compile, mismatched: each deletes its keys once every rank has read the verdict
    for outcome in _job("same_process_group_faults"):
        assert outcome["keys_left"] == [], outcome["keys_left"]


def test_a_killed_rank_ends_the_survivor_before_the_timeout():
    r0, r1 = _case("killed_mid_run", "killed_mid_run")
    assert r1 is None and _job("killed_mid_run", 2)[1]["exitcode"] == 3
    # rank 0 is in a collective of its second step when rank 1's process exits: gloo sees the connection close
    assert re.search(r"Connection (reset|closed) by peer", r0["error"]), r0
    assert r0["seconds"] < PG_TIMEOUT_S


def test_the_store_hosts_exit_is_named_by_the_others():
    r0, r1 = _case("store_host_raises_before_compile", "store_host_raises_before_compile")
    assert r0["error"] == "ValueError: data loader failed on rank 0", r0
    assert "lost the process group's store while exchanging first-call records with ranks [0, 1]" in r1["error"], r1
    assert "rank 0, unless a launcher such as torchrun hosts it" in r1["error"]
    assert r1["seconds"] < WAIT_S  # not the wait for a rank that never publishes


def test_pipeline_stages_on_disjoint_sub_meshes_train_without_comparing_with_each_other():
    # ranks 0, 1 shard model A over [0, 1]; ranks 2, 3 a model of other widths over [2, 3]; the check compares only
    # the ranks of the groups a graph uses (before, rank 0 and rank 2 "compiled different forward schedules")
    for rank, outcome in enumerate(_case("pipeline_stages", "sub_meshes", 4)):
        assert outcome["error"] is None, outcome
        assert outcome["mesh"] == ([0, 1] if rank < 2 else [2, 3])
        assert all(math.isfinite(x) for x in outcome["losses"]) and outcome["losses"][-1] < outcome["losses"][0]


def test_hsdp_exchanges_over_both_groups_of_each_rank():
    # each rank's union of groups differs (rank 0: [0, 1] and [0, 2]; rank 1: [0, 1] and [1, 3]): one exchange per
    # group keeps every group's ranks on the same keys (one over the union waited for keys nobody wrote)
    outcomes = _case("hsdp", "sub_meshes", 4)
    for outcome in outcomes:
        assert outcome["error"] is None, outcome
        assert all(math.isfinite(x) for x in outcome["losses"]) and outcome["losses"][-1] < outcome["losses"][0]


def test_a_rank_skipping_a_shard_call_is_named_at_once_or_after_the_bounded_wait():
    r0, r1 = _case("shard_skipped_first", "shard_faults")
    for r in (r0, r1):  # at once, on both ranks: rank 1's first call meets rank 0's first
        words = "the ranks of the mesh called shard on different modules: rank 0 called shard(Linear); rank 1 called"
        assert f"{words} shard(Net)" in r["error"] and "on the same modules, in the same order" in r["error"], r
        assert r["seconds"] < PG_TIMEOUT_S / 2, r  # at once: no wait for a timeout
    r0, r1 = _case("shard_on_rank_0_only", "shard_faults")
    assert r1["error"] is None
    words = f"rank(s) [1] did not call shard(Net) within {WAIT_S:.0f} s (the process group times out after"
    assert words in r0["error"] and "`shard` must be called on every rank of the mesh" in r0["error"], r0
    assert WAIT_S <= r0["seconds"] < BOUND_S, r0  # its own message, before gloo's timeout in the values check


def test_a_rank_calling_another_checkpoint_function_or_none_is_named():
    r0, r1 = _case("save_against_load", "checkpoint_faults")
    for r in (r0, r1):  # at once, on both ranks
        words = "the ranks called different collective functions: rank 0 called save_checkpoint; rank 1 called"
        assert f"{words} load_checkpoint" in r["error"] and r["seconds"] < 5, r
    r0, r1 = _case("save_on_rank_0_only", "checkpoint_faults")
    assert r1["error"] is None
    words = f"rank(s) [1] did not call save_checkpoint within {WAIT_S:.0f} s (the process group times out after"
    assert words in r0["error"] and "not under `if rank == 0:`" in r0["error"], r0
    assert WAIT_S <= r0["seconds"] < BOUND_S, r0  # before gloo's own timeout, naming the rank


def test_a_rank_a_backward_behind_is_named_at_once_with_every_ranks_counts():
    # rank 0 skipped the backward of its second step: its third forward meets rank 1's second backward
    for r in _case("skipped_backward", "skipped_steps"):
        words = "ranks of process group [0, 1] are at different steps of the compiled model: rank(s) [0] in forward 3"
        assert f"{words} (forwards 3, backwards 1); rank(s) [1] in backward 2 (forwards 2, backwards 2)" in r["error"]
        assert "skipped backward" in r["error"] and r["seconds"] < PG_TIMEOUT_S / 2, r


def test_a_saved_compile_is_watched_where_compiled_and_where_a_relaunch_loads_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # where the job saves, for both launches
    words = "ranks of process group [0, 1] are at different steps of the compiled model: rank(s) [0] in forward 3"
    for events in (["miss", "stored"], ["hit"]):  # a launch compiles and saves, the relaunch loads
        for r in (r["skipped_backward"] for r in run_faults(fault_workers.skipped_backward_saved, 2)):
            assert r["cache"] == events, r
            assert (
                f"{words} (forwards 3, backwards 1); rank(s) [1] in backward 2 (forwards 2, backwards 2)" in r["error"]
            )
            assert r["seconds"] < WAIT_S, r  # its compile and save included; no wait for an absent rank


def test_an_extra_no_grad_forward_on_one_rank_is_named_at_once():
    for r in _case("extra_forward", "skipped_steps"):
        assert "rank(s) [0] in forward 3 (forwards 3, backwards 2, no-grad forwards 1)" in r["error"], r
        assert "rank(s) [1] in no-grad forward 2 (forwards 2, backwards 2, no-grad forwards 2)" in r["error"], r
        assert r["seconds"] < PG_TIMEOUT_S / 2, r  # at once: no wait for a timeout


def test_a_rank_that_left_the_loop_early_is_named_by_the_one_still_stepping():
    r0, r1 = _case("skipped_step", "skipped_step_then_exit")
    assert r1["error"] is None  # it skipped a step and finished its loop; its process exited
    words = "stopped pairing their collectives: rank(s) [0] in forward 3 (forwards 3, backwards 2); rank(s) [1] not"
    assert f"{words} seen in a compiled step" in r0["error"], r0
    assert re.search(r"The collective failed with: .*Connection (reset|closed) by peer", r0["error"]), r0
    assert r0["seconds"] < PG_TIMEOUT_S, r0  # gloo saw the closed connection: no timeout waited out


def test_a_rank_waiting_in_its_own_code_is_named_before_the_timeout():
    r0, r1 = _case("elsewhere", "elsewhere")
    assert r1["error"] is None
    words = "rank(s) [0] in forward 3 (forwards 3, backwards 2); rank(s) [1] not seen in a compiled step"
    assert words in r0["error"] and "Timed out" in r0["error"], r0
    [(seconds, message)] = r0["logged"]  # a warning of the watching thread while the collective still waited
    assert words in message and seconds < r0["ended"] - 1, (r0["logged"], r0["ended"])
    assert "dropped if the ranks arrive" in message, message


def test_gradient_sync_turned_off_on_one_rank_is_named_as_the_cause():
    r0, r1 = _case("sync_off_on_one_rank", "sync_off_on_one_rank")
    # rank 0 compiles a backward that keeps its gradients; rank 1 runs the one compiled before and waits in it
    assert "rank(s) [1] did not publish their backward schedule" in r0["error"], r0
    words = "gradient sync was off on this rank for 'layers.0.bias', 'layers.0.weight', 'layers.1.bias' and 3 more"
    assert any(words in note and "set it alike on every rank" in note for note in r0["notes"]), r0
    # rank 0, which hosts the store, raised and exited: rank 1's collective and the store went with it
    assert "rank 1, in backward 2 (forwards 2, backwards 2), lost the process group's store" in r1["error"], r1
    assert "Connection closed by peer" in r1["error"], r1
    assert r0["seconds"] < PG_TIMEOUT_S and r1["seconds"] < PG_TIMEOUT_S + 2, (r0, r1)


@functools.cache
def _late_peer_job() -> list[dict]:
    return run_faults(fault_workers.late_peer_then_stall, 2, fault_workers.LATE_PG_TIMEOUT_S)


def test_a_peer_late_for_more_than_half_the_timeout_is_no_error():
    for r in (r["late_peer"] for r in _late_peer_job()):
        assert r["error"] is None, r
        assert r["losses"] == r["plain_losses"], r  # as if no rank had been late
        assert not [message for level, message in r["logged"] if level in ("ERROR", "CRITICAL")], r["logged"]


def test_a_stall_after_a_late_peer_is_named_afresh():
    r0, r1 = (r["stall"] for r in _late_peer_job())
    assert r1["error"] is None  # it left the loop; its process exited
    words = "stopped pairing their collectives: rank(s) [0] in forward 4 (forwards 4, backwards 3); rank(s) [1] not"
    assert f"{words} seen in a compiled step" in r0["error"], r0
    assert "rank(s) [1] in" not in r0["error"], r0  # not where rank 1 waited for the late rank 0
    assert r0["seconds"] < fault_workers.LATE_PG_TIMEOUT_S, r0  # gloo saw the closed connection: no timeout
