"""FSDP + tensor parallelism: 4 gloo ranks as 2 dp x 2 tp. The TP plan is applied with `parallelize_module` on
mesh["tp"], then the model is sharded over mesh["dp"]; compared bitwise with `fully_shard` + the same plan, and with
a single process."""

from __future__ import annotations

import functools

import pytest
import torch
from harness import run_ranks
from tp_workers import reference, tp_parity_dtypes


@functools.cache
def results(name: str) -> dict:
    """fp32 (and for the Llamas bf16 params) in one set of 4 processes."""
    return run_ranks(tp_parity_dtypes, 4, name, (None, torch.bfloat16) if name.startswith("llama") else (None,))[0]


def result(name: str, param_dtype=None) -> dict:
    return results(name)[str(param_dtype)]


@pytest.mark.parametrize("name", ["llama", "llama-sp", "gpt"])
def test_fsdp_tp_matches_fully_shard_bitwise_and_a_single_process(name):
    """llama: HF LlamaForCausalLM with q/k/v/gate/up column-wise, o/down row-wise; llama-sp: the same with
    sequence-parallel norms (tp_workers.LLAMA_SP_PLAN); gpt: the GPT's MLPs."""
    r = result(name)
    (ours, ours_grads), (fsdp2, fsdp2_grads) = r["ours"], r["fsdp2"]
    assert ours == fsdp2  # bitwise, every step
    ref_losses, ref_grads = reference(name)
    torch.testing.assert_close(ours, ref_losses, rtol=1e-5, atol=0)
    for k, g in ref_grads.items():
        torch.testing.assert_close(ours_grads[k], g, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
        assert torch.equal(ours_grads[k], fsdp2_grads[k]), k
    # the placements fully_shard gives: dp sharding on top of TP's, strided where TP also shards dim 0
    assert r["placements"] == r["fsdp2_placements"]
    if name == "llama":
        q, o = (
            r["placements"]["model.layers.0.self_attn.q_proj.weight"],
            r["placements"]["model.layers.0.self_attn.o_proj.weight"],
        )
        assert q == (("dp", "tp"), ("_S(0, 2)", "S(0)"))  # _StridedShard(0, split_factor=2), Shard(0)
        assert o == (("dp", "tp"), ("S(0)", "S(1)"))


@pytest.mark.parametrize("name", ["llama", "llama-sp"])
def test_fsdp_tp_bf16_params_match_fully_shard_bitwise(name):
    r = result(name, torch.bfloat16)
    assert r["ours"][0] == r["fsdp2"][0]


def test_fsdp_collectives_are_told_from_tp_collectives_and_state_is_split_four_ways():
    r = result("llama")
    for kind, found in r["graphs"]:
        fsdp = [k for k, serves_params in found if serves_params]
        tp = [k for k, serves_params in found if not serves_params]
        # one per block and the root in forward; per block in backward (the root is kept, as fully_shard's)
        assert fsdp.count("all_gather") == (3 if kind == "forward" else 2)
        assert fsdp.count("reduce_scatter") == (3 if kind == "backward" else 0)
        assert tp and set(tp) == {"all_reduce"}  # rowwise outputs (forward), colwise input grads (backward)
    # each rank holds 1 / (dp * tp) of every TP-sharded parameter and 1 / dp of the others (norms, embeddings),
    # up to padding
    held = sum(local for _, local, _ in r["sizes"])
    expected = sum(numel / (4 if tp_sharded else 2) for numel, _, tp_sharded in r["sizes"])
    assert expected <= held <= expected * 1.05 and expected < sum(n for n, _, _ in r["sizes"]) / 3
