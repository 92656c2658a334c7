"""Checkpoints and initialisation: DCP across world sizes, interop with FSDP2 eager, full state dicts, materialising
a model built on the meta device shard by shard, and save_checkpoint / load_checkpoint surviving killed saves and
refusing damaged files."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
from checkpoint_workers import (
    async_saves,
    damaged_checkpoints,
    load_after_kill,
    process_saves,
    save_then_die,
    saves_between_compiled_steps,
)
from harness import run_ranks
from models import make_model
from torch.multiprocessing.spawn import ProcessException
from workers import (
    checkpoint_helpers,
    checkpoint_interop,
    checkpoint_load,
    checkpoint_save,
    full_state_dict_roundtrip,
    meta_init,
)

from fsdp2_compile.checkpoint import AsyncSave


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_an_async_save_runs_at_the_lowest_cpu_priority_and_the_caller_keeps_its_own(tmp_path):
    seen = {}
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pending = AsyncSave(
        str(tmp_path), lambda: seen.update(nice=os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    )
    pending.wait()
    assert seen["nice"] == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


@pytest.mark.parametrize(
    "save_ranks,save_hsdp,load_ranks,load_hsdp",
    [(2, False, 4, False), (4, True, 2, False), (2, False, 4, True)],
    ids=["2-to-4", "hsdp-2x2-to-2", "2-to-hsdp-2x2"],
)
def test_dcp_save_and_load_at_another_world_size(tmp_path, save_ranks, save_hsdp, load_ranks, load_hsdp):
    # HSDP's (Replicate, Shard(0)) state reshards into a 1-D mesh and back, as FSDP2's does; 4 ranks -> 2 is the
    # HSDP case (a plain 4-to-2 run repeated it: dropped to keep the suite's time)
    path = str(tmp_path / "ckpt")
    saved = run_ranks(checkpoint_save, save_ranks, path, save_hsdp)[0]
    loaded = run_ranks(checkpoint_load, load_ranks, path, load_hsdp)[0]
    for part in ("params", "optim"):
        assert saved["saved"][part].keys() == loaded["loaded"][part].keys()
        for k, v in saved["saved"][part].items():
            assert torch.equal(v, loaded["loaded"][part][k]), f"{part} {k} differs after loading"  # bit-identical
    # the steps after loading match the steps the saving run took next (other world size: fp32 parity bound)
    torch.testing.assert_close(loaded["losses"], saved["losses"], rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "saver,world_size,hsdp",
    [("fsdp2", 2, False), ("ours", 2, False), ("fsdp2", 4, True)],
    ids=["fsdp2", "ours", "fsdp2-hsdp"],
)
def test_checkpoints_move_between_fsdp2_eager_and_shard_compile(tmp_path, saver, world_size, hsdp):
    # hsdp: both systems on a 2x2 (replicate, shard) mesh
    result = run_ranks(checkpoint_interop, world_size, str(tmp_path / "ckpt"), saver, hsdp)[0]
    # the other system, loaded from the checkpoint, takes the same next steps as the one that saved it
    torch.testing.assert_close(result["loaded"], result["continued"], rtol=1e-6, atol=0)


def test_full_state_dict_on_rank0_and_loading_a_plain_state_dict():
    results = run_ranks(full_state_dict_roundtrip, 2)
    full, reloaded = results[0]["full"], results[0]["reloaded"]
    plain = make_model("gpt").state_dict()
    assert full.keys() == plain.keys() and results[1]["full"] == {}  # unsharded values on rank 0 only
    assert all(type(v) is torch.Tensor and v.shape == plain[k].shape for k, v in full.items())
    assert any(not torch.equal(full[k], plain[k]) for k in plain)  # it is the trained model, not the initial one
    for k, v in plain.items():
        assert torch.equal(reloaded[k], v), k


def test_meta_device_model_is_materialised_shard_by_shard():
    results = run_ranks(meta_init, 2)
    reference = make_model("gpt")
    for name, p in reference.named_parameters():
        rows = -(-p.shape[0] // 2)
        for r, result in enumerate(results):  # each rank allocated only its own rows, on the CPU
            assert result["types"][name] == "DTensor"
            assert result["local"][name] == ((min(rows, p.shape[0] - r * rows), *p.shape[1:]), "cpu"), name
        full = results[0]["full"][name]
        if name.endswith("bias") or "ln" in name:  # LayerNorm (1, 0) and zero biases, exactly
            torch.testing.assert_close(
                full, torch.ones_like(full) if name.endswith("weight") else torch.zeros_like(full)
            )
        else:  # normal(0, 0.02) drawn on the shards: the statistics of the whole tensor
            assert abs(full.std().item() - 0.02) < 0.002 and abs(full.mean().item()) < 0.002, name
    assert results[0]["losses"][-1] < results[0]["losses"][0]  # and it trains


def test_checkpoint_helpers_roundtrip_and_name_the_first_mismatching_entry(tmp_path):
    results = run_ranks(checkpoint_helpers, 2, str(tmp_path / "ckpt"))
    saved, loaded = results[0]["saved"], results[0]["loaded"]
    for part in ("params", "optim"):  # into a fresh optimizer that never stepped
        assert saved[part].keys() == loaded[part].keys()
        assert all(torch.equal(v, loaded[part][k]) for k, v in saved[part].items()), part
    for result in results:  # every rank raises the same clear error, before reading data
        wider, deeper = result["errors"]["wider"], result["errors"]["deeper"]
        assert "'tok_emb.weight' has shape (98, 32) in the checkpoint but (98, 48) in the model" in wider, wider
        assert "no entry for model parameter/buffer 'blocks.2." in deeper and "another architecture" in deeper, deeper


def _same_state(a: dict, b: dict) -> bool:
    return all(a[p].keys() == b[p].keys() and all(torch.equal(v, b[p][k]) for k, v in a[p].items()) for p in a)


@pytest.mark.parametrize(
    "kill", ["rank1-after-writing-its-data", "rank0-before-commit", "rank0-after-commit", "rank1-during-async-write"]
)
def test_a_save_killed_part_way_leaves_a_checkpoint_that_loads(tmp_path, kill):
    path, snapshot = str(tmp_path / "ckpt"), str(tmp_path / "states.pt")
    with pytest.raises(ProcessException) as ended:  # one rank dies inside the second save; the harness ends the other
        run_ranks(save_then_die, 2, path, kill, snapshot, timeout=300)
    assert os.path.exists(snapshot + ".died"), f"the job failed before the armed death: {ended.value}"
    states = torch.load(snapshot)
    assert not _same_state(states["committed"], states["next"])  # the killed save had other values to write
    result = run_ranks(load_after_kill, 2, path)[0]
    # bit-identical to the previous commit, or to the new one when the kill came after its commit
    expected = states["next"] if kill == "rank0-after-commit" else states["committed"]
    assert _same_state(result["loaded"], expected), f"killed at {kill}: loaded another state than was committed"
    assert result["left"] == ["committed.json", "save-000001", "save-000002"], result["left"]
    # the next save commits past the leftovers and deletes them
    assert result["after"] == ["committed.json", "save-000003"], result["after"]
    assert _same_state(result["reloaded"], result["resaved"])


def test_async_save_writes_the_state_at_the_call_and_its_failures_reach_every_rank(tmp_path):
    results = run_ranks(async_saves, 2, str(tmp_path))
    for r in results:
        assert r["gathers"] == 0, "saving gathered parameters"
        assert not _same_state(r["at_call"], r["later"])  # training changed the state while the save was written
        assert _same_state(r["loaded"]["async"], r["at_call"]), "the async save wrote another state than at the call"
        assert _same_state(r["loaded"]["async"], r["loaded"]["sync"])
        assert r["first_done"], "a save began before the previous async save had ended"
        assert r["listing"] == ["committed.json", "save-000003"], r["listing"]
        for how, error in r["errors"].items():  # a write failing on rank 1, raised on both ranks
            assert error.startswith("CheckpointError: DCP could not save to "), (how, error)
            assert "on rank 1: OSError: [Errno 28] No space left on device" in error, (how, error)
        assert _same_state(r["after_failures"], r["later"]), "the failed saves changed what is committed"
    assert results[0]["errors"] == results[1]["errors"]
    # the background saves' group: every rank, its gloo keys under a token the ranks drew together (a restarted
    # attempt on the store of the one that died never reads them)
    assert results[0]["save_group"] == results[1]["save_group"] and results[0]["save_group"][0] == 2
    assert results[0]["save_group"][1]


def test_async_saves_written_by_dcps_process_load_back_and_end_with_their_process_group(tmp_path):
    for r in run_ranks(process_saves, 2, str(tmp_path)):
        for at_call, later, loaded in r["saved"]:
            assert not _same_state(at_call, later)  # training changed the state while the save was written
            assert _same_state(loaded, at_call), "the process wrote another state than at the call"
        assert r["nice"] == [19, 19], "DCP's process runs at the priority of the save's thread"
        assert r["first_ended"] and r["two_processes"], "the old process group's writer outlived it"


def test_saving_does_not_make_the_compiled_model_recompile(tmp_path):
    """A save reads the sharded parameters (`sharded_parameters()`); the compiled step after it must pass its guards
    as before, not compile again."""
    assert run_ranks(saves_between_compiled_steps, 2, str(tmp_path)) == [0, 0]


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    results = run_ranks(damaged_checkpoints, 2, str(tmp_path_factory.mktemp("damaged")))
    assert results[0] == results[1], "the ranks raised different errors"  # same exception text on every rank
    return results[0]


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_truncated_or_missing_data_file_fails_naming_the_file_and_the_rank_that_wrote_it(damaged, damage):
    error = damaged[damage]
    assert error.startswith("CheckpointError: checkpoint ") and "is damaged" in error, error
    assert "save-000001/__1_0.distcp (written by rank 1)" in error, error
    assert ("bytes but had" in error) if damage == "truncated" else ("cannot be read (FileNotFoundError" in error)
    assert damaged["intact"] == "no error"  # the same checkpoint, undamaged, loads


@pytest.mark.parametrize("damage", ["flipped", "mixed", "metadata"])
def test_flipped_bytes_or_a_mixed_in_file_fail_their_checksum(damaged, damage):
    # "mixed": the same rank's file from a save one step later, as when a save overwrote only some files
    error = damaged[damage]
    name = "save-000001/.metadata " if damage == "metadata" else "save-000001/__1_0.distcp (written by rank 1)"
    assert error.startswith("CheckpointError: ") and name in error and "fails its checksum: sha256" in error, error


@pytest.mark.parametrize("where", ["empty", "nonexistent", "uncommitted", "plain", "save folder"])
def test_loading_where_no_checkpoint_was_committed_says_so(damaged, where):
    error = damaged[where]
    assert error.startswith("FileNotFoundError: no committed checkpoint at ") and "save_checkpoint" in error, error
    why = {
        "empty": "has no committed.json",
        "nonexistent": "the folder does not exist",
        "uncommitted": "holds only save-000001, which no save_checkpoint committed",
        "plain": "DCP files but no committed.json",
        "save folder": "a save folder of save_checkpoint; pass the folder above it",
    }[where]
    assert why in error, error


def test_saving_where_no_folder_can_be_made_and_dcp_failures_are_ordinary_errors(damaged):
    error = damaged["unwritable"]  # a CheckpointError (a RuntimeError), not DCP's BaseException
    assert error.startswith("CheckpointError: cannot save a checkpoint to ") and "a-file" + os.sep + "ckpt" in error
    assert "Not a directory" in error, error
    error = damaged["model-only into an optimizer"]
    assert error.startswith("ValueError: checkpoint ") and "holds no optimizer state" in error, error
    # DCP's own failure names the rank and its cause
    error = damaged["dcp failure"]
    assert (
        error.startswith("CheckpointError: DCP could not load from ")
        and "on rank 1: OSError: storage of rank 1" in error
    )
    assert "CheckpointException ranks" not in error, error


def test_extra_state_the_checkpoint_lacks_or_without_state_dict_is_refused(damaged):
    error = damaged["extra_state absent"]
    assert error.startswith("ValueError: checkpoint ") and "holds no extra_state 'lr' (saved without it)" in error, (
        error
    )
    error = damaged["extra_state not stateful"]
    assert error.startswith("TypeError: save_checkpoint: extra_state['step'] is a int, which has no state_dict()"), (
        error
    )
