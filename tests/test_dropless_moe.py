"""A dropless mixture of experts written as torchtitan writes it (tests/dropless_moe_workers.py): token counts
exchanged by all-to-all, turned into split sizes with `.tolist()`, variable-split all-to-all dispatch and combine,
a loop over the local experts' runs, a shared expert and the auxiliary-loss-free load-balancing bias. 4 gloo ranks
(dp_shard_mod_ep 2 x ep 2), each with its own batch; compared bitwise with `fully_shard` on the same layout and
steps, with the rank-consistency check on (the default `CompileConfig`)."""

from __future__ import annotations

import functools

import torch
from dropless_moe_workers import EXPERTS, STEPS, dropless_training, routing_differs_on_rank_1
from harness import run_ranks


@functools.cache
def results() -> list[dict]:
    return run_ranks(dropless_training, 4)


TP_STEPS = 2


@functools.cache
def results_with_tp() -> list[dict]:
    return run_ranks(dropless_training, 8, TP_STEPS, True, 2)


def test_dropless_moe_matches_fully_shard_bitwise():
    for r in results():
        ours, fsdp2 = r["ours"], r["fsdp2"]
        assert len(ours["losses"]) == STEPS
        assert ours["losses"] == fsdp2["losses"]  # bitwise, every step
        assert ours["counts"] == fsdp2["counts"]  # the same routing, step by step
        assert ours["experts"] == fsdp2["experts"] == (("dp_shard_mod_ep", "ep"), ("_S(0, 2)", "S(0)"))
        assert ours["attention"] == fsdp2["attention"] == ((("dp",), ("S(0)",)),) * 2
        assert ours["params"].keys() == fsdp2["params"].keys()
        for name, p in ours["params"].items():
            assert torch.equal(p, fsdp2["params"][name]), name
        for name, b in ours["buffers"].items():  # the load-balancing bias moved, identically
            assert torch.equal(b, fsdp2["buffers"][name]), name
        assert ours["buffers"]["layers.0.moe.expert_bias"].abs().sum() > 0
    assert len({tuple(r["ours"]["losses"]) for r in results()}) == 4  # each rank its own batch


def test_token_counts_differ_between_ranks_and_steps():
    """Dropless: every rank sends a different number of tokens to each expert, step by step, so the all-to-alls'
    split sizes differ from rank to rank within one compiled schedule."""
    counts = [r["ours"]["counts"] for r in results()]  # rank -> step -> layer -> tokens per expert
    for step in range(STEPS):
        for layer in range(2):
            per_rank = [tuple(c[step][layer]) for c in counts]
            assert all(sum(t) == 2 * 8 * 2 and len(t) == EXPERTS for t in per_rank)  # batch x seq x top-k
            assert len(set(per_rank)) > 1, (step, layer, per_rank)
    for c in counts:
        assert len({tuple(step[0]) for step in c}) > 1


def test_one_forward_and_one_backward_graph_and_no_recompile():
    """Under `capture_scalar_outputs` the counts' `.tolist()` becomes unbacked sizes inside one graph: per block,
    the counts' all-to-all and the token dispatch and combine sit in the forward graph beside FSDP's gathers, and
    the tokens' two all-to-alls of backward in the backward graph; nothing recompiles when the counts change."""
    for r in results():
        after_first, after_all = r["ours"]["compile_counts"]
        assert (after_all.forward, after_all.backward, after_all.frames, after_all.recompiles) == (1, 1, 1, 0)
        assert after_first == after_all
        graphs = dict(r["ours"]["graphs"])
        assert graphs.keys() == {"forward", "backward"}
        assert [k for k, serves_params in graphs["forward"] if not serves_params] == ["all_to_all"] * 6
        assert [k for k, serves_params in graphs["backward"] if not serves_params] == ["all_to_all"] * 4


def test_a_rank_whose_routing_differs_is_named():
    """Rank 1 skips the exchange of counts (one all-to-all fewer per block): both ranks raise, naming each other
    and the first differing collective, instead of hanging in the all-to-all."""
    r0, r1 = run_ranks(routing_differs_on_rank_1, 2)
    assert r0 is not None and "rank 0 and rank 1 compiled different forward schedules" in r0, r0
    assert r1 is not None and "rank 1 and rank 0 compiled different forward schedules" in r1, r1
    assert "all_to_all:int64:* here vs all_to_all:float32:* on rank 1" in r0, r0


def test_expert_and_tensor_parallel_on_8_ranks_match_fully_shard_bitwise():
    """EP + TP: a (dp_shard_mod_ep 2, ep 2, tp 2) mesh; the experts as on 4 ranks, the attention's projections
    column- and row-wise over tp, the rest of each block and the root over the flattened dp dims (4 ranks, each
    pair of tensor-parallel peers with one batch)."""
    runs = results_with_tp()
    for r in runs:
        ours, fsdp2 = r["ours"], r["fsdp2"]
        assert len(ours["losses"]) == TP_STEPS and ours["losses"] == fsdp2["losses"]
        assert ours["counts"] == fsdp2["counts"]
        assert ours["experts"] == fsdp2["experts"] == (("dp_shard_mod_ep", "ep"), ("_S(0, 2)", "S(0)"))
        assert ours["attention"] == fsdp2["attention"]
        assert ours["attention"][0][0] == ("dp", "tp")
        for name, p in ours["params"].items():
            assert torch.equal(p, fsdp2["params"][name]), name
        assert ours["compile_counts"][1].recompiles == 0
    assert len({tuple(r["ours"]["losses"]) for r in runs}) == 4  # one batch per dp rank
    assert len({tuple(map(tuple, r["ours"]["counts"][0])) for r in runs}) == 4


def test_under_dynamos_defaults_the_graph_breaks_train_with_the_check_on():
    """Without `capture_scalar_outputs` each `.tolist()` breaks the graph and the split sizes reach the pieces after
    it as this rank's Python ints: the token all-to-alls' sizes differ between ranks in one exchanged schedule, and
    the check agrees. Not bitwise: the MoE's input, used on both sides of a break, gets its gradients summed in
    another order than in eager (benchmarks/dropless_moe.py reports it)."""
    runs = run_ranks(dropless_training, 4, 2, False)
    for r in runs:
        ours, fsdp2 = r["ours"], r["fsdp2"]
        assert ours["losses"][0] == fsdp2["losses"][0]  # forward alone: bitwise
        assert torch.allclose(torch.tensor(ours["losses"]), torch.tensor(fsdp2["losses"]), rtol=1e-5)
        assert ours["counts"] == fsdp2["counts"]
        _, after = ours["compile_counts"]
        assert after.frames > 1 and after.forward > 2
        assert [k for kind, found in ours["graphs"] for k, params in found if not params].count("all_to_all") >= 6
