"""FSDP + TP checkpoints: HF Llama on 2 dp x 2 tp (the plan of tests/tp_workers.py). DCP state
moves from FSDP + TP to FSDP only on 2 ranks and back (`save_checkpoint` / `load_checkpoint`), and between
`fully_shard` + TP and `shard_compile` + TP both ways (plain `dcp.save` / `dcp.load` with `get_state_dict` /
`set_state_dict`). Loaded state is bit-identical to the saved state; the next losses equal the uninterrupted run's
bitwise where the layout is the same, and within fp32 tolerance where it changes (FSDP only)."""

from __future__ import annotations

import functools

import pytest
import torch
from harness import run_ranks
from tp_checkpoint_workers import load_back_into_tp, load_into_dp_only, save_tp_and_interop


def assert_same_state(a: dict, b: dict) -> None:
    for part in ("params", "optim"):
        assert a[part].keys() == b[part].keys(), part
        for k, v in a[part].items():
            assert torch.equal(v, b[part][k]), f"{part} {k} differs"


@functools.cache
def results(root: str) -> tuple[dict, dict, dict]:
    tp = run_ranks(save_tp_and_interop, 4, root)[0]
    dp_only = run_ranks(load_into_dp_only, 2, root)[0]
    back = run_ranks(load_back_into_tp, 4, root)[0]
    return tp, dp_only, back


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return results(str(tmp_path_factory.mktemp("tp-ckpt")))


def test_fsdp_tp_checkpoint_loads_into_fsdp_only_on_2_ranks_and_back(ckpt):
    tp, dp_only, back = ckpt
    assert_same_state(tp["saved"], dp_only["loaded"])  # 2x2 (dp, tp) -> 1-D over 2 ranks: bit-identical
    torch.testing.assert_close(dp_only["losses"], tp["continued"], rtol=1e-5, atol=0)  # another layout: fp32 bound
    assert_same_state(tp["saved"], back["loaded"])  # and back onto 2x2
    assert back["losses"] == tp["continued"]  # the same layout again: bitwise


def test_checkpoints_move_between_fully_shard_tp_and_ours_both_ways(ckpt):
    tp, _, _ = ckpt
    assert_same_state(tp["saved"], tp["fsdp2_loaded"])  # ours + TP -> fully_shard + TP
    assert tp["fsdp2_losses"] == tp["continued"]
    assert_same_state(tp["fsdp2_saved"], tp["ours_loaded"])  # fully_shard + TP -> ours + TP
    assert tp["ours_losses"] == tp["fsdp2_continued"]
