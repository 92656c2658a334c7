"""Per-rank jobs for tests/test_user_errors.py: mistakes that used to train silently wrong, made on real gloo ranks;
each case returns what every rank was told."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import fsdp2_compile as fc


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the tests check
        return f"{type(e).__name__}: {e}"
    return None


def _ignored_param_of_another_model() -> None:
    model, copy = _net(), _net()
    fc.shard(model, ignored_params={copy[2].weight})


def _aliased_parameters() -> None:
    model = _net()
    model.head = nn.Parameter(model[0].weight.detach()[:4])  # a view of another parameter's memory
    fc.shard(model)


def _step_with_sync_left_off(rank: int) -> None:
    model = fc.shard_compile(_net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.set_requires_gradient_sync(False)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()
    opt.step()


def _different_initial_weights(rank: int) -> None:
    torch.manual_seed(rank)  # a seed per rank: each builds other weights
    fc.shard(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))


def _different_weights_check_off(rank: int) -> None:
    torch.manual_seed(rank)
    fc.shard(nn.Sequential(nn.Linear(8, 8)), check_same_init=False)


def silent_mistakes(rank: int, world_size: int) -> dict:
    """Each case in turn (a barrier between them): the error each rank got, or None."""
    cases = {
        "ignored_param_of_another_model": _ignored_param_of_another_model,
        "aliased_parameters": _aliased_parameters,
        "step_with_sync_left_off": lambda: _step_with_sync_left_off(rank),
        "different_initial_weights": lambda: _different_initial_weights(rank),
        "different_weights_check_off": lambda: _different_weights_check_off(rank),
    }
    out = {}
    for name, case in cases.items():
        dist.barrier()
        out[name] = _error(case)
    return out
