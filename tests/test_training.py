"""Multi-process training on gloo (2 and 4 ranks) against a single-process reference of the same global batch.

Each `run(...)` spawns the ranks once (cached), and several tests assert on what it returned.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from harness import run_ranks
from models import batch, local_slice, loss_fn, make_model, reference_train
from torch.distributed.tensor import Replicate, Shard
from workers import (
    memory_budget_agreement,
    mismatched_configs,
    rank_dependent_lengths,
    train,
    unpublished_schedule,
)

STEPS = 10
bf16 = torch.bfloat16


@functools.cache
def run(name: str, world_size: int, mode: str = "compiled", **spec) -> dict:
    """Rank 0's result, plus every rank's collectives in graph order under "orders". `config` (hashable: a tuple
    of pairs) holds CompileConfig fields."""
    if "config" in spec:
        spec["config"] = dict(spec["config"])
    results = run_ranks(train, world_size, name, dict(mode=mode, steps=STEPS, **spec))
    return results[0] | dict(orders=[r["collective_order"] for r in results])


@functools.cache
def reference(name: str, world_size: int = 1, param_dtype=None, clip=None):
    return reference_train(name, STEPS, world_size, param_dtype, clip)


def assert_params_close(full: dict, ref: dict, rtol: float, atol: float) -> None:
    assert full.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(full[k], ref[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


# Parameter tolerance: AdamW divides by sqrt(v) + eps, so an entry whose gradient is ~0 takes an lr-sized step in
# a direction set by rounding; runs that only sum in another order then differ there by up to ~1e-4 after 10 steps.
PARAM_RTOL, PARAM_ATOL = 1e-4, 3e-4


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_fp32_training_matches_single_process(name, world_size):
    result = run(name, world_size)
    ref_losses, ref_params = reference(name)
    torch.testing.assert_close(result["losses"], ref_losses, rtol=1e-5, atol=0)
    assert_params_close(result["full"], ref_params, PARAM_RTOL, PARAM_ATOL)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_every_rank_issues_the_same_collectives_in_the_same_order(name, world_size):
    orders = run(name, world_size)["orders"]
    assert orders[0] and all(order == orders[0] for order in orders[1:])  # even where a rank's shard is empty


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_eager_sharded_module_matches_compiled_and_reference(name):
    eager, compiled = run(name, 2, "eager"), run(name, 2)
    torch.testing.assert_close(eager["losses"], compiled["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(eager["losses"], reference(name)[0], rtol=1e-5, atol=0)
    assert eager["graphs"] == []  # nothing was compiled
    # resharding after forward, eager and compiled: between forward and backward no gathered parameter is alive
    # (eager: saved-tensor hooks keep a recipe and gather again in backward)
    assert eager["live_after_forward"] == [] and compiled["live_after_forward"] == []


def test_bf16_params_fp32_reduce_matches_a_reference_with_the_same_casts():
    # The reference computes each rank's local batch in bf16 and averages fp32-cast gradients: the same arithmetic
    # as sharded mixed precision. What remains is bf16 rounding of differently ordered sums (matmuls over another
    # batch split, the gathered vs. locally cast weight): bf16 keeps 8 bits, 2^-8 = 0.4%, so losses agree to ~1e-3.
    result = run("gpt", 2, param_dtype=bf16)
    ref_losses, ref_params = reference("gpt", 2, bf16)
    torch.testing.assert_close(result["losses"], ref_losses, rtol=2e-3, atol=0)
    eager = run("gpt", 2, "eager", param_dtype=bf16)
    torch.testing.assert_close(result["losses"], eager["losses"], rtol=2e-3, atol=0)
    # and bf16 is not fp32: the run must differ from the fp32 one, or the casts did nothing
    assert max(abs(a - b) for a, b in zip(result["losses"], reference("gpt")[0])) > 1e-4


def test_bf16_gathers_in_bf16_and_reduces_in_fp32():
    graphs = run("gpt", 2, param_dtype=bf16)["graphs"]
    coll = [c for g in graphs for c in g["collectives"]]
    assert coll and {c.dtype for c in coll if c.kind == "all_gather"} == {bf16}
    assert {c.dtype for c in coll if c.kind == "reduce_scatter"} == {torch.float32}


def _padded_bytes(shape, world_size: int, dtype) -> int:
    rows = math.ceil(shape[0] / world_size) * world_size
    return rows * math.prod(shape[1:]) * torch.finfo(dtype).bits // 8


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_one_gather_per_parameter_one_reduce_scatter_per_trainable_parameter_and_exact_bytes(name):
    result = run(name, 2)
    model = make_model(name)
    params = dict(model.named_parameters())
    ignored = {"scale"} if name == "mlp" else set()
    managed = {k: p for k, p in params.items() if k not in ignored}
    trainable = {k for k, p in managed.items() if p.requires_grad}
    [fw] = [g for g in result["graphs"] if g["kind"] == "forward"]  # one graph: no graph break
    [bw] = [g for g in result["graphs"] if g["kind"] == "backward"]

    gathers = [c for c in fw["collectives"] if c.kind == "all_gather"]
    assert sorted(p for c in gathers for p in c.params) == sorted(managed)  # tied lm_head/tok_emb counted once
    assert sum(c.nbytes for c in gathers) == sum(_padded_bytes(p.shape, 2, p.dtype) for p in managed.values())
    reductions = [c for c in bw["collectives"] if c.kind == "reduce_scatter"]
    assert sorted(p for c in reductions for p in c.params) == sorted(trainable)
    assert sum(c.nbytes for c in reductions) == sum(
        _padded_bytes(managed[k].shape, 2, torch.float32) for k in trainable
    )
    # with resharding, backward gathers again only parameters it needs, each once
    regathered = [p for c in bw["collectives"] if c.kind == "all_gather" for p in c.params]
    assert len(regathered) == len(set(regathered)) and set(regathered) <= set(trainable) | set(managed)
    assert fw["saved_gathered"] == []  # no gathered parameter is saved for backward


def test_without_resharding_gathered_parameters_are_kept_and_not_gathered_twice():
    result = run("gpt", 2, reshard=False)
    torch.testing.assert_close(result["losses"], reference("gpt")[0], rtol=1e-5, atol=0)
    [fw] = [g for g in result["graphs"] if g["kind"] == "forward"]
    [bw] = [g for g in result["graphs"] if g["kind"] == "backward"]
    assert not [c for c in bw["collectives"] if c.kind == "all_gather"]
    assert fw["saved_gathered"]  # what backward needs is kept from forward
    assert result["live_after_forward"]  # ... and alive between forward and backward (what the measure sees)
    # and with resharding, the same model re-gathers in backward
    assert [
        c
        for g in run("gpt", 2)["graphs"]
        if g["kind"] == "backward"
        for c in g["collectives"]
        if c.kind == "all_gather"
    ]


@pytest.mark.parametrize("world_size", [2, 4])
def test_params_grads_and_adamw_state_are_sharded(world_size):
    result = run("gpt", world_size)
    model = make_model("gpt")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # each rank holds at most ceil(rows / N) rows of every parameter: total / N plus at most one row per parameter
    padding = sum(math.prod(p.shape[1:]) * p.element_size() for p in model.parameters())
    for kind, copies in (("params", 1), ("grads", 1), ("optimizer", 2)):  # AdamW: exp_avg and exp_avg_sq
        held = result["local_bytes"][kind]
        assert total * copies / world_size - copies * padding <= held <= copies * (total / world_size + padding), kind
    assert result["opt_state_all_sharded"]
    assert set(result["grad_placements"]) == {n for n, _ in model.named_parameters()}
    assert result["plain_grads"] == []
    assert result["live_unsharded"] == []  # no unsharded parameter is alive after the step


def test_state_dict_has_dtensor_values_under_the_original_names():
    result = run("mlp", 2)
    model = make_model("mlp")
    assert list(result["state_dict_types"]) == list(model.state_dict())
    assert result["state_dict_types"]["scale"] == "Tensor" and result["state_dict_types"]["shift"] == "Tensor"
    assert {v for k, v in result["state_dict_types"].items() if k not in ("scale", "shift")} == {"DTensor"}


@pytest.mark.parametrize("foreach", [True, False])
def test_gradient_accumulation_clipping_and_foreach(foreach):
    # two micro-batches per step (grads accumulate into the sharded .grad), clip_grad_norm_, zero_grad to zeros
    result = run("gpt", 2, accumulate=2, clip=0.5, foreach=foreach, set_to_none=False)
    ref_losses, ref_params = reference("gpt", clip=0.5)
    torch.testing.assert_close(result["losses"], ref_losses, rtol=1e-5, atol=0)
    assert_params_close(result["full"], ref_params, PARAM_RTOL, PARAM_ATOL)


@pytest.mark.parametrize(
    "config",
    [
        dict(buckets="none", prefetch=False, schedule=False),  # one collective per parameter, no reordering
        dict(buckets=20_000, prefetch_depth=2),  # byte-capped buckets across groups, deeper prefetch
        dict(buckets=("blocks.0", "blocks.1"), memory_budget_bytes=1),  # named buckets, budget allows no prefetch
    ],
    ids=["plain", "byte-cap", "named"],
)
def test_every_pipeline_configuration_keeps_parity(config):
    result = run("gpt", 2, config=tuple(sorted(config.items())))
    torch.testing.assert_close(result["losses"], reference("gpt")[0], rtol=1e-5, atol=0)
    assert result["live_unsharded"] == []


def test_selective_unsharding_keeps_the_last_buckets_gathered_with_parity():
    # keep_gathered=0.5: of the GPT's buckets (root, blocks.0, blocks.1), the ones backward needs first that fit
    # half the gathered bytes stay gathered from forward; backward gathers only the others
    plain = run("gpt", 2)
    result = run("gpt", 2, config=(("keep_gathered", 0.5),))
    torch.testing.assert_close(result["losses"], reference("gpt")[0], rtol=1e-5, atol=0)
    assert result["losses"] == plain["losses"]  # the same arithmetic, fewer collectives

    def backward_gathers(r):
        [bw] = [g for g in r["graphs"] if g["kind"] == "backward"]
        return [c for c in bw["collectives"] if c.kind == "all_gather"]

    kept = {c.params for c in backward_gathers(plain)} - {c.params for c in backward_gathers(result)}
    assert kept and len(backward_gathers(result)) < len(backward_gathers(plain))
    kept_bytes = sum(c.nbytes for c in backward_gathers(plain) if c.params in kept)
    all_bytes = sum(c.nbytes for c in backward_gathers(plain))
    assert 0 < kept_bytes <= all_bytes / 2
    assert all(order == result["orders"][0] for order in result["orders"])


@pytest.mark.parametrize("budget", [("memory_budget_bytes", 1 << 40), ("memory_budget_fraction", 0.5)])
def test_a_memory_budget_keeps_what_the_prefetch_window_leaves_gathered_with_parity(budget):
    # memory_budget_bytes beyond the prefetch window keeps buckets gathered from forward to backward (selective
    # unsharding without keep_gathered): with room for every bucket, backward gathers nothing. Half of this host's
    # free memory (hundreds of MB at least) has room for the test GPT's every bucket too.
    result = run("gpt", 2, config=(budget,))
    torch.testing.assert_close(result["losses"], reference("gpt")[0], rtol=1e-5, atol=0)
    [bw] = [g for g in result["graphs"] if g["kind"] == "backward"]
    assert [c for c in bw["collectives"] if c.kind == "all_gather"] == []
    assert [c for c in bw["collectives"] if c.kind == "reduce_scatter"]


@pytest.mark.parametrize("world_size, hsdp", [(2, False), (4, True)])
def test_ranks_agree_on_a_memory_budget_from_their_free_memory(world_size, hsdp):
    # each rank sees a different free memory; shard_compile's budget is the smallest over the whole mesh (HSDP:
    # over both dims), so every rank keeps the same buckets gathered and issues the same collectives
    assert run_ranks(memory_budget_agreement, world_size, hsdp) == [(500, None)] * world_size


def test_ranks_configured_differently_fail_clearly_on_every_rank():
    messages = run_ranks(mismatched_configs, 2, timeout=300)
    for message in messages:  # the configs are compared (field by field) before the schedules
        assert "rank 1 has CompileConfig.buckets='none', rank 0 'shard_calls'" in message, message
        assert "Give every rank the same CompileConfig" in message


def test_a_rank_that_never_compiles_the_graph_is_named_after_the_timeout():
    message = run_ranks(unpublished_schedule, 2, timeout=120)[0]
    assert "rank(s) [1] did not publish their forward schedule within 2 s" in message, message
    assert "recompiling" not in message
    message = run_ranks(unpublished_schedule, 2, True, timeout=120)[0]  # rank 0 recompiles: a guard failed there
    assert "This rank is recompiling a graph it compiled before" in message and "TORCH_LOGS=recompiles" in message
    assert "data-dependent branch" in message


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_hsdp_on_a_2x2_mesh_matches_single_process(name):
    # 4 ranks as (replicate=2, shard=2): sharded within a pair, replicated across pairs; clip_grad_norm_ reduces
    # the norm over the (Replicate, Shard) gradients
    result = run(name, 4, hsdp=True, clip=0.5)
    ref_losses, ref_params = reference(name, clip=0.5)
    torch.testing.assert_close(result["losses"], ref_losses, rtol=1e-5, atol=0)
    assert_params_close(result["full"], ref_params, PARAM_RTOL, PARAM_ATOL)
    managed = {k: t for k, t in result["param_types"].items() if t[1] is not None}
    assert {placements for _, placements in managed.values()} == {(Replicate(), Shard(0))}
    assert result["opt_state_all_sharded"] and result["live_unsharded"] == []
    assert all(order == result["orders"][0] for order in result["orders"])


def test_hsdp_reduce_scatters_within_the_shard_group_then_all_reduces_across_replicas():
    result = run("gpt", 4, hsdp=True, clip=0.5)
    params = dict(make_model("gpt").named_parameters())
    [fw] = [g for g in result["graphs"] if g["kind"] == "forward"]
    [bw] = [g for g in result["graphs"] if g["kind"] == "backward"]
    gathers = [c for c in fw["collectives"] if c.kind == "all_gather"]  # gathered from the 2-rank shard group
    assert sum(c.nbytes for c in gathers) == sum(_padded_bytes(p.shape, 2, p.dtype) for p in params.values())
    reductions = [c for c in bw["collectives"] if c.kind == "reduce_scatter"]
    replicas = [c for c in bw["collectives"] if c.kind == "all_reduce"]
    # one all-reduce per bucket, right behind its reduce-scatter, over that bucket's reduced shards (half the rows)
    assert [c.params for c in replicas] == [c.params for c in reductions] and len(replicas) == 3
    assert [2 * c.nbytes for c in replicas] == [c.nbytes for c in reductions]
    # and the all-reduces overlap the rest of the backward: the first starts before the last reduce-scatter
    kinds = [c.kind for c in bw["collectives"]]
    assert kinds.index("all_reduce") < len(kinds) - 1 - kinds[::-1].index("reduce_scatter"), kinds


@pytest.mark.parametrize("mode,compiler", [("compiled", "aot_eager"), ("compiled", "inductor"), ("eager", None)])
def test_set_requires_gradient_sync_accumulates_unsharded_and_reduces_once(mode, compiler):
    # 2 micro-batches a step: the first with gradient sync off, the second on — equal to one large batch; with
    # Inductor too (its fused elementwise ops may sum in another order, still within these bounds)
    config = (("compiler", compiler),) if compiler else ()
    result = run("gpt", 2, mode, accumulate=2, no_sync=True, config=config)
    ref_losses, ref_params = reference("gpt")
    torch.testing.assert_close(result["losses"], ref_losses, rtol=1e-5, atol=0)
    assert_params_close(result["full"], ref_params, PARAM_RTOL, PARAM_ATOL)
    assert result["live_unsharded"] == []  # the kept unsharded gradients were released by the synced backward
    if mode == "compiled":  # one graph per setting; the unsynced backward issues no reduce-scatter
        backward = [[c.kind for c in g["collectives"]] for g in result["graphs"] if g["kind"] == "backward"]
        # unsynced, synced, and (after training) a recompile for the worker's final full-batch backward
        assert len(backward) == 3 and "reduce_scatter" not in backward[0] and "all_gather" in backward[0]
        assert all(b.count("reduce_scatter") == 3 for b in backward[1:])


def test_ranks_recompiling_for_new_shapes_at_different_steps_do_not_wait_for_each_other(tmp_path, monkeypatch):
    # rank 0 meets a new sequence length at step 1, rank 1 only at step 2: each recompiles alone, and the schedule
    # check must not wait for the other rank (before, it waited 120 s and failed); so with saved compiles
    # (`CompileConfig.compile_cache`), where a relaunch loads both graphs, each rank when it meets its new shape
    lengths = [[16, 12, 12, 9], [16, 16, 12, 9]]
    results = run_ranks(rank_dependent_lengths, 2, lengths, timeout=300)
    # reference: one process, each step the mean of the ranks' losses on their own slices and lengths
    model, world = make_model("gpt"), 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(4):
        x, y = batch("gpt", step)
        per_rank = [
            loss_fn(
                "gpt",
                model(local_slice(x, r, world)[:, : lengths[r][step]]),
                local_slice(y, r, world)[:, : lengths[r][step]],
            )
            for r in range(world)
        ]
        sum(per_rank).div(world).backward()
        opt.step()
        opt.zero_grad()
        for r in range(world):
            torch.testing.assert_close(results[r]["losses"][step], per_rank[r].item(), rtol=1e-5, atol=0)
    assert_params_close(results[0]["full"], dict(model.named_parameters()), PARAM_RTOL, PARAM_ATOL)
    assert [r["forwards"] for r in results] == [2, 2]  # the static graph, then one dynamic recompile each
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    saved = run_ranks(rank_dependent_lengths, 2, lengths, True, timeout=300)
    assert [r["saved"] for r in saved] == [["miss", "stored"] * 2] * 2 and [r["forwards"] for r in saved] == [2, 2]
    # a relaunch loads the static graph, then, on each rank alone when it meets a new length, the dynamic one
    again = run_ranks(rank_dependent_lengths, 2, lengths, True, timeout=300)
    assert [r["saved"] for r in again] == [["hit", "hit"]] * 2 and [r["forwards"] for r in again] == [0, 0]
    assert [r["losses"] for r in saved] == [r["losses"] for r in again] == [r["losses"] for r in results]
