"""Mixture of experts with expert parallelism, laid out as torchtitan lays it out (tests/moe_workers.py): 4 gloo
ranks, experts `Shard(0)` on ep=2 with all-to-all token dispatch, sharded over dp_shard_mod_ep=2, the rest of each
block and the root over dp=4; compared bitwise with `fully_shard` on the same model, layout and steps."""

from __future__ import annotations

import functools

import pytest
import torch
from harness import run_ranks
from moe_workers import moe_training


@functools.cache
def results() -> list[dict]:
    return run_ranks(moe_training, 4)


@pytest.mark.parametrize("num_experts", [4, 2])
def test_expert_parallel_moe_matches_fully_shard_bitwise(num_experts):
    """4 experts: sharded over dp_shard_mod_ep on dim 0 (strided on ep's rows); 2 experts, one per ep rank:
    dp_shard_mod_ep x ep exceeds them, so on dim 1, as torchtitan's shard_placement_fn chooses."""
    for r in results():
        ours, fsdp2 = r[(num_experts, "ours")], r[(num_experts, "fsdp2")]
        assert ours["losses"] == fsdp2["losses"]  # bitwise, every step
        assert ours["experts"] == fsdp2["experts"]
        assert ours["params"].keys() == fsdp2["params"].keys()
        for name, p in ours["params"].items():
            assert torch.equal(p, fsdp2["params"][name]), name
    mesh_dims, placements = results()[0][(num_experts, "ours")]["experts"]
    assert mesh_dims == ("dp_shard_mod_ep", "ep")
    assert placements == (("_S(0, 2)" if num_experts == 4 else "S(1)"), "S(0)")
    # each rank trained on its own batch: the losses differ between ranks, the parameters do not
    assert len({tuple(r[(num_experts, "ours")]["losses"]) for r in results()}) == 4


def test_token_all_to_alls_trace_into_the_compiled_graphs_next_to_fsdp_collectives():
    """One forward and one backward graph: each holds the 4 all-to-alls of the 2 blocks' dispatch and combine
    (told from FSDP's collectives: they serve no parameter); forward gathers each of the 5 groups (root, 2 blocks,
    their 2 expert groups) once, backward reduce-scatters each once."""
    for num_experts in (4, 2):
        graphs = dict(results()[0][(num_experts, "ours")]["graphs"])
        assert graphs.keys() == {"forward", "backward"}
        for kind, found in graphs.items():
            assert [k for k, serves_params in found if not serves_params] == ["all_to_all"] * 4
            fsdp = [k for k, serves_params in found if serves_params]
            if kind == "forward":
                assert fsdp == ["all_gather"] * 5
            else:
                assert fsdp.count("reduce_scatter") == 5


def test_token_all_to_alls_of_other_sizes_on_another_rank_compile_the_same_schedule():
    """Dropless routing sends a different number of tokens from each rank: the rank-consistency check compares the
    order and kind of a model's own all-to-alls, not their data-dependent sizes."""
    from torch import fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp2_compile.compiler.rank_consistency import schedule_signature

    def dispatch_graph(tokens: int) -> fx.GraphModule:
        graph = fx.Graph()
        x = graph.placeholder("x")
        with FakeTensorMode():
            x.meta["val"] = torch.empty(tokens, 4)
            out = graph.call_function(
                torch.ops._c10d_functional.all_to_all_single.default, (x, [tokens - 1, 1], [tokens - 1, 1], "ep")
            )
            out.meta["val"] = torch.empty(tokens, 4)
        graph.output(out)
        return fx.GraphModule(torch.nn.Module(), graph)

    assert schedule_signature(dispatch_graph(7)) == schedule_signature(dispatch_graph(9)) == "all_to_all:float32:*:"
