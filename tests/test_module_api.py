"""FSDP2's module API on `shard_compile`d models, used exactly as on `fully_shard` ones (2 gloo ranks): the losses
are bitwise equal, and the compiled graphs show what the call changed."""

from __future__ import annotations

import inspect

import pytest
import torch
from harness import run_ranks
from module_api_workers import (
    aborted_iteration,
    all_reduce_hook,
    cpu_offload,
    divide_factor,
    hsdp_accumulation,
    kept_per_optimizer,
    manual_finalization,
    module_api,
    narrow_reduce_accumulation,
    optimizer_in_backward,
    optimizer_in_backward_changes,
    reshard_after_backward,
    reshard_to_smaller_group,
    shard_placement,
    sum_only_reductions,
    sync_set_after_forward,
    torch_policy,
)
from torch import nn

import fsdp2_compile as fc
from fsdp2_compile._torch_private import grads_summed_in_reduce_dtype


def test_a_list_of_modules_is_one_group_as_in_fully_shard():
    result = run_ranks(module_api, 2, "list_group")[0]
    assert result["ours"] == result["fsdp2"]
    forward = dict(result["graphs"])["forward"]
    # tok_emb, ln_f and lm_head (whose weight is tok_emb's, named lm_head.weight): one all-gather of their own
    assert ("all_gather", ("lm_head", "ln_f")) in forward
    assert ("all_gather", ("pos_emb",)) in forward


def test_set_reshard_after_forward_recompiles_and_backward_gathers_nothing():
    result = run_ranks(module_api, 2, "reshard_setter")[0]
    assert result["ours"] == result["fsdp2"]
    graphs = result["graphs"]
    assert [kind for kind, _ in graphs] == ["forward", "backward", "forward", "backward"]  # a guard recompiled
    first_backward, second_backward = graphs[1][1], graphs[3][1]
    assert sum(kind == "all_gather" for kind, _ in first_backward) == 2  # both blocks re-gathered (the root kept)
    assert sum(kind == "all_gather" for kind, _ in second_backward) == 0  # nothing resharded after forward


def test_gradient_sync_set_between_forward_and_backward_takes_effect_in_that_backward():
    """As in FSDP2 (and as torch's pipeline schedules use it), `set_requires_gradient_sync` counts when backward
    runs: a forward compiled with sync on, then sync turned off, keeps its gradients unsharded; one compiled with it
    off, then turned on, reduces them. Bitwise equal to fully_shard; each backward graph is compiled once and then
    its variant with the other setting once (a forward recompiles when the setting it is traced with changes, and
    once more when sync was first turned off: the parameters then name where their kept gradients are)."""
    result = run_ranks(sync_set_after_forward, 2)[0]
    assert result["ours"] == result["fsdp2"]
    assert result["graphs"] == [
        ("forward", 0),
        ("backward", 3),  # compiled with sync on (the first forward's setting) ...
        ("backward", 0),  # ... and run with it off: its variant keeps the gradients
        ("forward", 0),
        ("backward", 0),  # the second forward, compiled with sync off ...
        ("backward", 3),  # ... run with it on: reduced, what the first kept added
        ("forward", 0),  # the next step's first: sync on, with a place for kept gradients
        ("backward", 3),
        ("backward", 0),
    ]


def test_shard_placement_fn_shards_chosen_parameters_on_another_dim_as_fully_shard():
    """`shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None` on the blocks, 4 ranks: the same
    placements as fully_shard's, and losses and parameters bitwise equal after training."""
    from torch.distributed.tensor import Shard

    result = run_ranks(shard_placement, 4)[0]
    ours, fsdp2 = result["ours"], result["fsdp2"]
    assert ours["placements"] == fsdp2["placements"]
    assert ours["placements"]["blocks.0.attn.qkv.weight"] == (Shard(1),)
    assert ours["placements"]["blocks.0.ln1.weight"] == (Shard(0),)
    assert ours["losses"] == fsdp2["losses"]
    for name, value in ours["params"].items():
        assert torch.equal(value, fsdp2["params"][name]), name


def test_reshard_after_forward_int_gathers_backward_from_the_smaller_group():
    """4 ranks, blocks with `reshard_after_forward=2`: losses bitwise equal to fully_shard's with the same
    setting; backward gathers each block from 2 ranks (the rows forward kept: half of each block), not the root
    (sharded with the default: kept for backward, as fully_shard's), and reduce-scatters every gradient over all 4."""
    result = run_ranks(reshard_to_smaller_group, 4, 2)[0]
    assert result["ours"] == result["fsdp2"]
    graphs = dict(result["graphs"])
    assert {(kind, size) for kind, size, _ in graphs["forward"]} == {("all_gather", 4)}
    backward = {(kind, groups): size for kind, size, groups in graphs["backward"]}
    assert backward == {
        ("all_gather", ("blocks.1",)): 2,
        ("all_gather", ("blocks.0",)): 2,
        ("reduce_scatter", ("blocks.1",)): 4,
        ("reduce_scatter", ("blocks.0",)): 4,
        ("reduce_scatter", ("root",)): 4,
    }
    assert result["saved_rows_bytes"] == result["regathered_bytes"] // 2 > 0


def test_reshard_after_backward_false_keeps_parameters_for_the_next_forward():
    """Accumulating micro-batches, the first with set_reshard_after_backward(False): the second forward gathers
    nothing and its backward only reduces; losses and parameters bitwise equal to fully_shard's and to ours
    resharding after every backward (the tied embedding/head weight included: its two uses are summed before the
    kept gradient is added, as autograd does)."""
    result = run_ranks(reshard_after_backward, 2)[0]
    assert result["ours"] == result["fsdp2"] == result["ours_resharding"]
    for name, value in result["ours_params"].items():
        assert torch.equal(value, result["ours_resharding_params"][name]), name
        assert torch.equal(value, result["fsdp2_params"][name]), name
    kinds = [(kind, [c for c, _, _ in collectives]) for kind, collectives in result["graphs"]]
    assert kinds == [
        ("forward", ["all_gather"] * 3),
        ("backward", ["all_gather"] * 2),  # first micro-batch: no reduction
        ("forward", []),
        ("backward", ["reduce_scatter"] * 3),  # second: the parameters kept, nothing gathered
    ]


def test_an_optimizer_step_drops_only_the_kept_parameters_it_holds():
    """Two models with set_reshard_after_backward(False), one optimizer each: stepping the first's drops the first's
    kept gathered parameters (its next forward gathers its updated shards) and leaves the second's for its next
    forward; losses and parameters bitwise equal to both models resharding after every backward."""
    result = run_ranks(kept_per_optimizer, 2)[0]
    assert result["ours"] == result["ours_resharding"]
    for ours, resharding in zip(result["ours_params"], result["ours_resharding_params"]):
        for name, value in ours.items():
            assert torch.equal(value, resharding[name]), name
    assert result["ours_kept"] == [[False, True]] * 4
    assert result["ours_resharding_kept"] == [[False, False]] * 4
    # the second model's forwards after its first take its kept parameters: one forward graph gathers nothing
    assert [] in result["ours_forwards"] and [] not in result["ours_resharding_forwards"]


def test_cpu_offload_policy_trains_as_fully_shard_on_a_cpu_mesh():
    """On a CPU mesh the shards are on the CPU already: the graphs are those without offload, and the losses
    bitwise equal to fully_shard's with the same policy (the copies to an accelerator: tests/test_passes.py)."""
    result = run_ranks(cpu_offload, 2)[0]
    assert result["ours"] == result["fsdp2"]


def test_prefetch_lists_unshard_reshard_and_is_last_backward_leave_training_as_fully_shard():
    result = run_ranks(module_api, 2, "unshard_calls")[0]
    assert result["ours"] == result["fsdp2"]


def test_explicit_prefetch_lists_steer_the_scheduler(fake_pg):
    """blocks.0 asks for blocks.2 and blocks.3 in forward, blocks.3 for blocks.0 in backward: with prefetch depth 1
    (the scheduler alone would start each gather one block ahead) their all-gathers are issued right before the
    asking block's first use."""
    import cli_factories

    from fsdp2_compile.compiler.graph_records import clear_compiled_graphs, compiled_graphs

    clear_compiled_graphs()
    torch.manual_seed(0)
    model = cli_factories.Tiny(layers=4)
    blocks = model.blocks
    for block in blocks:
        fc.shard(block)
    fc.shard_compile(model, compile_config=fc.CompileConfig(prefetch_depth=1, hardware="cpu-gloo-loopback"))
    blocks[0].set_modules_to_forward_prefetch([blocks[2], blocks[3]])
    blocks[3].set_modules_to_backward_prefetch([blocks[0]])
    model(torch.randint(0, 33, (2, 4))).sum().backward()
    with pytest.raises(TypeError, match=r"modules\[0\] \(Linear\) was not passed to fsdp2_compile.shard"):
        blocks[0].set_modules_to_forward_prefetch([blocks[0].fc])

    def issue_order(gm) -> list[str]:
        """Buckets in the order their all-gathers are issued, with "use:<bucket>" at each gather's first use."""
        order, waits = [], {}
        for node in gm.graph.nodes:
            if node.target is torch.ops._c10d_functional.all_gather_into_tensor.default:
                order.append(node.meta["fsdp.bucket"])
                waits[next(iter(node.users))] = node.meta["fsdp.bucket"]
            elif node.target is torch.ops._c10d_functional.wait_tensor.default and node in waits:
                order.append(f"use:{waits[node]}")
        return order

    forward, backward = (r.gm for r in compiled_graphs())
    fw = issue_order(forward)
    assert fw.index("blocks.2") < fw.index("use:blocks.0") and fw.index("blocks.3") < fw.index("use:blocks.0"), fw
    bw = issue_order(backward)
    assert bw.index("blocks.0") < bw.index("use:blocks.3"), bw
    clear_compiled_graphs()


@pytest.mark.parametrize(
    "variant, world_size",
    [
        ("every_step", 2),
        ("accumulating_unsynced", 2),
        ("hsdp", 4),
        ("hsdp_partial", 4),
        ("bf16", 2),
        ("blocks_hooked", 2),
        ("activation_checkpointing", 2),
    ],
)
def test_optimizer_in_backward_by_post_accumulate_grad_hooks_trains_as_fully_shard(variant, world_size):
    """FSDP2's optimizer in backward: an optimizer per sharded parameter, stepped (and its gradient cleared) by a
    post-accumulate-grad hook on the parameter, with no optimizer step in the loop. Every hook runs once per step
    on every system (not in a backward with gradient sync or HSDP's all-reduce off: nothing was fully reduced)
    and the losses are bitwise equal to fully_shard's, with `fc.shard` alone (eager) too; also with bf16
    parameters, with hooks on the blocks' parameters only (the root's stepped after backward) and with activation-checkpointed blocks. Compiled, ours runs the hooks inside the backward,
    each bucket's right after the next bucket's reduce-scatter is issued (as FSDP2 runs them after each
    reduce-scatter; HSDP: after the next all-reduce is issued), not after the whole backward (except after
    unsynced HSDP micro-batches, whose synced backward finishes every reduction at the end)."""
    result = run_ranks(optimizer_in_backward, world_size, variant)[0]
    assert result["ours"] == result["eager"] == result["fsdp2"]
    assert result["ours_hooks"] == result["eager_hooks"] == result["fsdp2_hooks"] == 4 * result["hooked"]
    assert result["ours_hooks_in_graph"] == result["ours_hooks"]
    assert result["fsdp2_hooks_in_graph"] == result["eager_hooks_in_graph"] == 0
    assert result["ours_grads_left"] == result["eager_grads_left"] == result["fsdp2_grads_left"] == 0
    events = result["backward"]
    assert sum(what == "deliver" for what, _ in events) == result["hooked"]
    if variant == "hsdp_partial":
        return  # that synced backward adds the kept partial shards first: its reductions all finish at the end
    last = "all_reduce" if variant == "hsdp" else "reduce_scatter"  # what delivered gradients come from
    issued = [bucket for what, bucket in events if what == last]
    assert len(issued) == 3  # the two blocks, then the root
    for bucket, following in zip(issued[:-1], issued[1:]):
        # block k's reduction is waited for, the next one issued, then k's deliveries run while it is in flight
        delivered = [i for i, event in enumerate(events) if event == ("deliver", bucket)]
        assert delivered
        assert events.index((f"{last} wait", bucket)) < events.index((last, following)) < min(delivered)
        assert max(delivered) < events.index((f"{last} wait", following))


def test_optimizer_in_backward_follows_freezing_and_removed_hooks_as_fully_shard():
    """Hooks on every parameter, then block 0 frozen, then the hooks removed and an optimizer stepped after backward
    (each change recompiles ours): losses bitwise equal to fully_shard's, and the same hooks run at every step."""
    result = run_ranks(optimizer_in_backward_changes, 2)[0]
    assert result["ours"] == result["fsdp2"]
    every, thawed = result["params"], result["params"] - result["frozen"]
    expected = [every, 2 * every] + [2 * every + thawed * k for k in (1, 2, 2, 2)]  # none after step 3
    assert result["ours_hooks"] == result["fsdp2_hooks"] == expected


def test_gradient_divide_factor_sums_scaled_gradients():
    """On 2 ranks: factor 1 sums the ranks' gradients (exactly twice the average), factor 2 is the average, factor
    4 half of it (powers of two: exact)."""
    grads = run_ranks(divide_factor, 2)[0]
    average = grads[None]
    for factor, scale in ((1.0, 2.0), (2.0, 1.0), (4.0, 0.5)):
        for k, g in average.items():
            assert torch.equal(grads[factor][k], g * scale), (factor, k)


@pytest.mark.parametrize(
    "reduce_dtype,force_sum,hsdp",
    [(torch.float32, True, False), (torch.float64, False, False), (torch.float32, True, True)],
)
def test_sum_only_reductions_as_fully_shard(reduce_dtype, force_sum, hsdp):
    """FSDP2's divide rule with a divide factor of 3: `set_force_sum_reduction_for_comms(True)` sums (HSDP: the
    reduce-scatter and the all-reduce), then divides by 3; a reduce dtype other than fp32 / bf16 (fp16's overflow
    risk) divides by 2 before the sum and by 1.5 after. Losses and parameters bitwise equal to fully_shard's
    (multiplying by 1/3 before the sum, as without either, rounds differently)."""
    r = run_ranks(sum_only_reductions, 4 if hsdp else 2, reduce_dtype, force_sum, hsdp)[0]
    assert r["ours"] == r["fsdp2"]
    for k, p in r["fsdp2_params"].items():
        assert torch.equal(r["ours_params"][k], p), k
    assert r["divisions"] > 0


@pytest.mark.parametrize("hsdp", [False, True])
def test_all_reduce_hook_as_fully_shard(hsdp):
    """`set_all_reduce_hook` on every group with a hook that averages the reduced shards over another group
    (torchft's layout: FSDP within a replica group, the hook over 2 ranks across them; on HSDP, after its
    all-reduce, over all 4 ranks). Compiled: bitwise fully_shard's losses and parameters, the hook called once per
    group on the group's flat shards in fully_shard's layout (a 4-rank all-reduce rounds by position). Eager calls
    it once per parameter: bitwise where the hook's group has 2 ranks, within rounding on 4."""
    r = run_ranks(all_reduce_hook, 4, hsdp)[0]
    assert r["compiled"] == r["fsdp2"]
    assert r["compiled_calls"] == r["fsdp2_calls"] > 0
    for k, p in r["fsdp2_params"].items():
        assert torch.equal(r["compiled_params"][k], p), k
        if hsdp:
            torch.testing.assert_close(r["eager_params"][k], p)
        else:
            assert torch.equal(r["eager_params"][k], p), k
    assert r["eager"] == r["fsdp2"] if not hsdp else r["eager"] == pytest.approx(r["fsdp2"], rel=1e-5)


def test_unsynced_gradients_accumulate_in_a_narrower_reduce_dtype_as_fully_shard():
    """fp32 parameters, `reduce_dtype=torch.bfloat16`, three micro-batches per step with gradient sync on the last:
    the kept gradients are summed in bf16 as the installed torch's fully_shard sums them (torch 2.15: each cast
    first); compiled bitwise equal to fully_shard. Eager too before torch 2.15; on it, within rounding: an eager
    backward reduces a tied parameter's uses one by one (limits.md)."""
    r = run_ranks(narrow_reduce_accumulation, 2)[0]
    assert r["compiled"] == r["fsdp2"]
    for k, p in r["fsdp2_params"].items():
        assert torch.equal(r["compiled_params"][k], p), k
        if not grads_summed_in_reduce_dtype:
            assert torch.equal(r["eager_params"][k], p), k
    assert r["eager"] == (pytest.approx(r["fsdp2"], rel=1e-3) if grads_summed_in_reduce_dtype else r["fsdp2"])


def test_buffer_dtype_casts_floating_buffers_of_the_group_only(fake_pg):
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    fc.shard(model[1], mp_policy=fc.MixedPrecisionPolicy(buffer_dtype=torch.float64))
    fc.shard(model, mp_policy=fc.MixedPrecisionPolicy(buffer_dtype=torch.bfloat16))
    assert model[0].running_mean.dtype == torch.bfloat16 and model[0].num_batches_tracked.dtype == torch.int64
    assert model[1][1].running_var.dtype == torch.float64  # its own call's dtype, not the root's


def test_hsdp_accumulation_without_the_all_reduce_matches_fully_shard_bitwise():
    """4 ranks as (replicate 2, shard 2): per step, a micro-batch with set_requires_all_reduce(False), then one with
    it; the same under fully_shard. The backward without it issues reduce-scatters and no all-reduce."""
    r = run_ranks(hsdp_accumulation, 4)[0]
    assert r["ours"] == r["fsdp2"]
    for k, p in r["fsdp2_params"].items():
        assert torch.equal(r["ours_params"][k], p), k
    backward = [kinds for kind, kinds in r["graphs"] if kind == "backward"]
    assert len(backward) == 2  # one graph per setting (guarded)
    without, with_ = backward
    assert "all_reduce" not in without and without.count("reduce_scatter") == 3
    # the kept shards are added before the all-reduce, so today those all-reduces are per parameter, not bucketed
    assert with_.count("all_reduce") == len(r["ours_params"])  # one per parameter


def test_setter_values_are_checked(fake_pg):
    model = fc.shard(nn.Linear(4, 4))
    model.set_requires_all_reduce(True)  # the default is accepted
    with pytest.raises(ValueError, match=r"set_gradient_divide_factor\(0\): use a positive number"):
        model.set_gradient_divide_factor(0)


def test_every_fully_shard_method_exists_and_says_what_it_does_here(fake_pg):
    """Each public `FSDPModule` method of torch's is on ours: FSDP2's result, accepted as changing nothing here
    (stream and buffer settings), or refused naming the module, the method and what to do instead."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    public = {n for n in vars(TorchFSDPModule) if not n.startswith("_")}
    assert public <= set(dir(fc.FSDPModule)), sorted(public - set(dir(fc.FSDPModule)))
    model = fc.shard(nn.Linear(4, 4))
    model.set_unshard_in_backward(False)
    model.set_post_optim_event(object())
    model.set_reduce_scatter_unused_params(False)
    model.set_reduce_scatter_max_input_buffers(2)
    model.set_separate_reduce_scatter_group(True)
    model.set_force_sum_reduction_for_comms(True)
    assert all(info.force_sum_reduction for info in model._param_infos(recurse=False))
    with pytest.raises(TypeError, match=r"set_force_sum_reduction_for_comms\(enable=1\): use True or False"):
        model.set_force_sum_reduction_for_comms(1)
    with pytest.raises(TypeError, match=r"set_all_reduce_hook\(hook=3\): give a function hook\(tensor\)"):
        model.set_all_reduce_hook(3)
    for call, what in (
        (lambda: model.set_custom_all_gather(None), "inserts and buckets the all-gathers"),
        (lambda: model.set_reduce_scatter_unused_params(True), "the same parameters"),
    ):
        with pytest.raises(NotImplementedError, match=f"ShardedLinear.*not supported by fsdp2_compile.*{what}"):
            call()


def test_reset_iter_state_discards_what_a_failed_accumulation_kept():
    """A micro-batch with gradient sync off runs its backward, the next raises after its forward; after
    `reset_iter_state()` on the root, training equals a run that never failed, bitwise (without it, the failed
    micro-batch's kept gradients would be added to the next reduction)."""
    r = run_ranks(aborted_iteration, 2)[0]
    (clean_losses, clean), (reset_losses, reset), (_, leaked) = r["clean"], r["reset"], r["no_reset"]
    assert reset_losses == clean_losses
    assert all(torch.equal(reset[k], p) for k, p in clean.items())
    assert not all(torch.equal(leaked[k], p) for k, p in clean.items())  # what the reset discards matters


def test_reset_iter_state_on_a_submodule_names_the_root(fake_pg):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fc.shard(model[0])
    fc.shard(model)
    model.reset_iter_state()
    with pytest.raises(
        RuntimeError,
        match=r"ShardedLinear.reset_iter_state must be called on the root .*inside "
        r"ShardedSequential: call it on the outermost module passed to shard",
    ):
        model[0].reset_iter_state()


@pytest.mark.skipif(not hasattr(torch.distributed.fsdp, "GradientReductionHandle"), reason="torch 2.15's FSDP2 API")
@pytest.mark.parametrize("async_op", [False, True])
def test_manual_backward_finalization_as_fully_shard(async_op):
    """torch 2.15: `set_manual_backward_finalization`, `finalize_backward` with and without `async_op` and
    `set_keep_unsharded_storage`, used as torch's pipeline stages use them: bitwise equal to fully_shard."""
    result = run_ranks(manual_finalization, 2, async_op)[0]
    assert result["ours"]["losses"] == result["fsdp2"]["losses"]
    assert all(torch.equal(a, b) for a, b in zip(result["ours"]["shards"], result["fsdp2"]["shards"]))


@pytest.mark.parametrize(
    "override",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                "param_dtype_override_fn" not in str(inspect.signature(torch.distributed.fsdp.MixedPrecisionPolicy)),
                reason="torch 2.15's param_dtype_override_fn",
            ),
        ),
    ],
)
def test_torchs_own_mixed_precision_policy_trains_as_fully_shard(override):
    result = run_ranks(torch_policy, 2, override)[0]
    assert result["ours"] == result["fsdp2"]
