"""Identical blocks traced once (`runtime/traced_blocks.py`, `compiler/block_gathers.py`), on 2 gloo ranks against `fully_shard`."""

import pytest
import torch
from harness import run_ranks
from module_api_workers import blocks_traced_once


def test_identical_blocks_are_traced_once_and_train_bitwise_like_fully_shard():
    """The three blocks run one subgraph (Dynamo traced it once, AOTAutograd partitioned it once), while every block
    is still gathered before its forward, gathered again for its backward (nothing of it gathered is saved) and
    reduce-scattered; the root, as fully_shard's by default, stays gathered for backward: losses bitwise equal to
    fully_shard's."""
    result = run_ranks(blocks_traced_once, 2, False)[0]
    assert result["ours"] == result["fsdp2"]
    forward, backward = result["calls"]["forward"], result["calls"]["backward"]
    assert len(forward) == len(backward) == 3 and len(set(forward)) == len(set(backward)) == 1
    assert result["gathers"] == {"forward": 4, "backward": 3}  # the root and every block; every block again
    assert result["saved_gathered"] == 3  # the root's parameters backward reads, none of a block's


def test_blocks_traced_once_under_inductor_keep_the_inputs_their_backward_reads():
    """Under Inductor too the three blocks run one subgraph. A block's forward saves its input for backward, which
    Inductor would take from the call's output as a buffer of its own while the calling graph reuses the input's
    memory (every block's gradients but the last's wrong: the second step's loss off by 0.5%); read from the caller
    instead, the losses match fully_shard's to Inductor's rounding."""
    result = run_ranks(blocks_traced_once, 2, False, "inductor")[0]
    forward, backward = result["calls"]["forward"], result["calls"]["backward"]
    assert len(forward) == len(backward) == 3 and len(set(forward)) == len(set(backward)) == 1
    torch.testing.assert_close(result["ours"], result["fsdp2"], rtol=1e-5, atol=0)


def test_a_block_with_other_settings_gets_a_trace_of_its_own():
    """The last block keeps its parameters from forward to backward (FSDP2's idiom): Dynamo's guards on the
    setting refuse the other blocks' trace, so it is traced again (and, called once, inlined by Dynamo); backward
    gathers the first two blocks only (the root is kept by default), and the losses stay bitwise equal to fully_shard's with the
    same setting."""
    result = run_ranks(blocks_traced_once, 2, True)[0]
    assert result["ours"] == result["fsdp2"]
    forward = result["calls"]["forward"]
    assert len(forward) == 2 and len(set(forward)) == 1
    assert result["gathers"] == {"forward": 4, "backward": 2}
    assert result["saved_gathered"] > 0


@pytest.mark.parametrize("dynamic", [False, True])
def test_aotautograd_derives_a_block_subgraphs_schema_once_not_at_every_call(fake_pg, monkeypatch, dynamic):
    """torch 2.13 traces an `invoke_subgraph`'s whole subgraph again to derive its schema at every call AOTAutograd
    makes under autograd; the backend derives it once per subgraph and operand layout
    (`_torch_private.subgraph_schemas_reused`), symbolic sizes included (a dynamic sequence length). With 4
    identical blocks, a schema derivation per call would be at least 4 per AOTAutograd pass."""
    import dataclasses

    import torch
    from gpt import GPT, gpt_loss
    from models import GPT_CFG
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    import fsdp2_compile as fc
    from fsdp2_compile.compiler.graph_records import clear_compiled_graphs, compiled_graphs

    derived = []
    derive = InvokeSubgraphHOP.gen_schema

    def counted(self, subgraph, identifier, *operands):
        derived.append(identifier)
        return derive(self, subgraph, identifier, *operands)

    monkeypatch.setattr(InvokeSubgraphHOP, "gen_schema", counted)
    clear_compiled_graphs()
    torch.manual_seed(0)
    cfg = dataclasses.replace(GPT_CFG, n_layer=4)
    model = GPT(cfg)
    for block in model.blocks:
        fc.shard(block)
    fc.shard_compile(model)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    torch._dynamo.reset()  # no sizes made dynamic by earlier compiles of the same code
    if dynamic:
        torch._dynamo.mark_dynamic(x, 1)
    gpt_loss(model(x), x).backward()
    [forward] = [r.gm for r in compiled_graphs() if r.kind == "forward"]
    calls = forward.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
    assert len(calls) == 4
    assert 0 < len(derived) <= 3, derived
    assert InvokeSubgraphHOP.gen_schema is counted  # restored after compiling


def test_aotautograd_traces_one_gather_op_per_block_call_and_the_passes_see_one_per_parameter(fake_pg, monkeypatch):
    """AOTAutograd traces one `fsdp2::unshard_group` per block call and, in its backward, one
    `fsdp2::reduce_group` (each custom op call costs it about a millisecond per trace), not one `fsdp2::unshard`
    and one `fsdp2::reduce_grad` per parameter; the partitioner and the passes see one `fsdp2::unshard` per
    parameter again, and the backward graph one `fsdp2::reduce_grad` per parameter, so each block's parameters
    are still gathered in forward and again in backward, and reduce-scattered, one bucket each."""
    import dataclasses

    import torch
    from gpt import GPT, gpt_loss
    from models import GPT_CFG

    import fsdp2_compile as fc
    from fsdp2_compile.compiler import backend
    from fsdp2_compile.compiler.graph_records import clear_compiled_graphs, collectives, compiled_graphs
    from fsdp2_compile.core.grouped_unshard import REDUCE_GROUP, UNSHARD_GROUP
    from fsdp2_compile.core.ir import REDUCE_GRAD, UNSHARD

    def count(gm, target):
        return len(gm.graph.find_nodes(op="call_function", target=target))

    seen = []
    split = backend.split_unshard_groups

    def counted(gm):
        groups = gm.graph.find_nodes(op="call_function", target=UNSHARD_GROUP)
        seen.append(
            ([len(g.args[0]) for g in groups], count(gm, UNSHARD), count(gm, REDUCE_GROUP), count(gm, REDUCE_GRAD))
        )
        split(gm)
        assert count(gm, UNSHARD_GROUP) == 0

    monkeypatch.setattr(backend, "split_unshard_groups", counted)
    clear_compiled_graphs()
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(GPT_CFG, n_layer=4))
    for block in model.blocks:
        fc.shard(block)
    fc.shard_compile(model)
    per_block = len(list(model.blocks[0].parameters()))
    root = len(list(model.parameters())) - 4 * per_block
    x = torch.randint(0, GPT_CFG.vocab_size, (2, GPT_CFG.block_size))
    torch._dynamo.reset()
    gpt_loss(model(x), x).backward()
    # the calling graph's joint graph (the block subgraph's own is partitioned first, and holds neither); the
    # root's parameters are gathered and reduced one by one (its tied embedding gathered twice, once per read)
    joints = [s for s in seen if s[0]]
    assert joints == [([per_block] * 4, root + 1, 4, root + 1)], seen
    graphs = {r.kind: r.gm for r in compiled_graphs()}
    assert count(graphs["backward"], REDUCE_GROUP) == 0
    kinds = {kind: [c.kind for c in collectives(gm)] for kind, gm in graphs.items()}
    assert kinds["forward"].count("all_gather") == 5 and kinds["backward"].count("all_gather") == 4
    assert kinds["backward"].count("reduce_scatter") == 5
