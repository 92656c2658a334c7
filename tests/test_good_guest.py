"""Sharding leaves the user's process as `fully_shard` does (2 gloo ranks)."""

from __future__ import annotations

import torch
from guest_workers import random_draws_after_sharding
from harness import run_ranks


def test_sharding_draws_nothing_from_the_users_random_generator():
    for rank, result in enumerate(run_ranks(random_draws_after_sharding, 2)):
        assert torch.equal(result["ours"], result["fsdp2"]), rank
        assert torch.equal(result["ours_dropout"], result["fsdp2_dropout"]), rank
