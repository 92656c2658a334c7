"""What `shard` sets up in the process lives as long as what it was set up for: the optimizer step pre-hook as long
as a sharded module, the caches keyed by process group as long as the group (a process that destroys its default
process group and makes it again trains a new model as a fresh process does: 2 gloo ranks, one process each)."""

from __future__ import annotations

import gc

import pytest
import torch
from harness import run_ranks
from models import reference_train
from torch import nn
from workers import two_process_group_rounds

import fsdp2_compile as fc


def test_a_new_default_process_group_trains_a_new_model_as_a_fresh_process():
    """init_process_group -> shard_compile -> train -> destroy_process_group -> init_process_group -> a new model
    (same seed) -> shard_compile -> train: the second round's losses are bitwise the first's (a fresh process's),
    and both are one process's training of the same model."""
    ref_losses, _ = reference_train("gpt", 3)
    for first, second in run_ranks(two_process_group_rounds, 2):
        assert second == first
        assert first == pytest.approx(ref_losses, rel=1e-5)


def test_no_optimizer_hook_outlives_the_sharded_modules(fake_pg):
    """An optimizer built before `shard` is refused at its step while a sharded module lives; once the last one is
    gone, nothing of fsdp2_compile runs at an optimizer's step."""
    model, other = nn.Sequential(nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 8))
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    fc.shard(model)
    fc.shard(other)
    with pytest.raises(RuntimeError, match="SGD holds parameter '0.weight'"):
        early.step()
    del model
    gc.collect()
    with pytest.raises(RuntimeError, match="SGD holds parameter '0.weight'"):
        early.step()  # `other` is still sharded
    del other
    gc.collect()
    early.step()
