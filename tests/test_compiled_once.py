"""Identical blocks traced once (`fsdp2_compile/compiled_once.py`), on 2 gloo ranks against `fully_shard`."""

from harness import run_ranks
from module_api_workers import blocks_traced_once


def test_identical_blocks_are_traced_once_and_train_bitwise_like_fully_shard():
    """The three blocks run one subgraph (Dynamo traced it once, AOTAutograd partitioned it once), while every block
    is still gathered before its forward, gathered again for its backward (nothing gathered is saved) and
    reduce-scattered: losses bitwise equal to fully_shard's."""
    result = run_ranks(blocks_traced_once, 2, False)[0]
    assert result["ours"] == result["fsdp2"]
    forward, backward = result["calls"]["forward"], result["calls"]["backward"]
    assert len(forward) == len(backward) == 3 and len(set(forward)) == len(set(backward)) == 1
    assert result["gathers"] == {"forward": 4, "backward": 4}  # the root and every block, in each
    assert result["saved_gathered"] == 0


def test_a_block_with_other_settings_gets_a_trace_of_its_own():
    """The last block keeps its parameters from forward to backward (FSDP2's idiom): Dynamo's guards on the
    setting refuse the other blocks' trace, so it is traced again (and, called once, inlined by Dynamo); backward
    gathers the root and the first two blocks only, and the losses stay bitwise equal to fully_shard's with the
    same setting."""
    result = run_ranks(blocks_traced_once, 2, True)[0]
    assert result["ours"] == result["fsdp2"]
    forward = result["calls"]["forward"]
    assert len(forward) == 2 and len(set(forward)) == 1
    assert result["gathers"] == {"forward": 4, "backward": 3}
    assert result["saved_gathered"] > 0
