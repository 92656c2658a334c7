"""FSDP + TP beyond column / row parallel linears: torchtitan's Llama plan with
sequence-parallel norms, `PrepareModuleInput` and a vocab-parallel head under `loss_parallel` (tests/tt_llama.py) on
2 dp x 2 tp; and HSDP + TP on 8 ranks as (replicate, shard, tp) = 2 x 2 x 2 (HF Llama). Each bitwise equal to
`fully_shard` + the same plan and within fp32 tolerance of a single process; `clip_grad_norm_`, `optimizer.step()`
and `state_dict()` see the 2-D parameters as under `fully_shard`."""

from __future__ import annotations

import functools

import torch
from harness import run_ranks
from tp_plan_workers import hsdp_reference, hsdp_tp, sequence_parallel, tt_reference


@functools.cache
def sp_result() -> dict:
    return run_ranks(sequence_parallel, 4)[0]


def test_sequence_parallel_plan_with_loss_parallel_matches_fully_shard_bitwise():
    r = sp_result()
    ours, fsdp2 = r["ours"], r["fsdp2"]
    assert ours["losses"] == fsdp2["losses"]  # bitwise, every step
    for k, g in fsdp2["grads"].items():
        assert torch.equal(ours["grads"][k], g), k
    ref = tt_reference()
    torch.testing.assert_close(ours["losses"], ref["losses"], rtol=1e-5, atol=0)
    for k, g in ref["grads"].items():
        torch.testing.assert_close(ours["grads"][k], g, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_clip_grad_norm_step_and_state_dict_see_what_fully_shard_tp_gives():
    r = sp_result()
    ours, fsdp2 = r["ours"], r["fsdp2"]
    assert ours["norms"] == fsdp2["norms"]  # clip_grad_norm_'s total norm over the (dp, tp) DTensor gradients
    assert all(n > 0.5 for n in ours["norms"])  # above MAX_NORM: the gradients were clipped
    torch.testing.assert_close(ours["norms"], tt_reference()["norms"], rtol=1e-5, atol=0)
    for part in ("state_dict", "optim"):  # placements and full values after the last optimizer.step()
        assert ours[part].keys() == fsdp2[part].keys(), part
        for k, (placements, value) in fsdp2[part].items():
            assert ours[part][k][0] == placements, (part, k)
            assert torch.equal(ours[part][k][1], value), (part, k)
    sd = ours["state_dict"]
    assert sd["layers.0.attention.wq.weight"][0] == ("_S(0, 2)", "S(0)")  # colwise: strided dp over TP rows
    assert sd["layers.0.attention.wo.weight"][0] == ("S(0)", "S(1)")  # rowwise
    assert sd["layers.0.attention_norm.weight"][0] == ("S(0)", "R")  # sequence-parallel norm: replicated over tp
    assert sd["tok_embeddings.weight"][0] == ("_S(0, 2)", "S(0)")  # vocab-parallel embedding
    assert sd["output.weight"][0] == ("_S(0, 2)", "S(0)")  # vocab-parallel head
    assert ours["optim"]["layers.0.attention.wq.weight.exp_avg"][0] == ("_S(0, 2)", "S(0)")


def test_hsdp_plus_tp_on_8_ranks_matches_fully_shard_and_a_single_process():
    r = run_ranks(hsdp_tp, 8)[0]
    ours, fsdp2 = r["ours"], r["fsdp2"]
    assert ours["losses"] == fsdp2["losses"]  # bitwise
    for k, g in fsdp2["grads"].items():
        assert torch.equal(ours["grads"][k], g), k
    assert ours["placements"] == fsdp2["placements"]
    assert ours["placements"]["model.layers.0.self_attn.q_proj.weight"] == (
        ("replicate", "shard", "tp"),
        ("R", "_S(0, 2)", "S(0)"),
    )
    ref_losses, ref_grads = hsdp_reference()
    torch.testing.assert_close(ours["losses"], ref_losses, rtol=1e-5, atol=0)
    for k, g in ref_grads.items():
        torch.testing.assert_close(ours["grads"][k], g, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
