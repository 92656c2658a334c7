"""What `shard` caches per process group lives as long as that group: a process that destroys its default process
group and makes it again trains a new model as a fresh process does (2 gloo ranks, one process each)."""

from __future__ import annotations

import pytest
from harness import run_ranks
from models import reference_train
from workers import two_process_group_rounds


def test_a_new_default_process_group_trains_a_new_model_as_a_fresh_process():
    """init_process_group -> shard_compile -> train -> destroy_process_group -> init_process_group -> a new model
    (same seed) -> shard_compile -> train: the second round's losses are bitwise the first's (a fresh process's),
    and both are one process's training of the same model."""
    ref_losses, _ = reference_train("gpt", 3)
    for first, second in run_ranks(two_process_group_rounds, 2):
        assert second == first
        assert first == pytest.approx(ref_losses, rel=1e-5)
