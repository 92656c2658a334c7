"""Per-rank jobs for tests/test_user_errors.py: mistakes that used to train silently wrong, made on real gloo ranks;
each case returns what every rank was told. Cases that must train as `fully_shard` does raise when they differ."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import fsdp2_compile as fc


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the tests check
        return "\n".join([f"{type(e).__name__}: {e}", *getattr(e, "__notes__", [])])
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


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def groups(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _same_as_fully_shard(rank: int, build, step, exact: bool = True) -> None:
    """Raise unless `step(model, x)` returns bitwise the same tensors for a model `build()` sharded by
    `shard` / `shard_compile` as by `fully_shard` (its `groups()` first, then the root); `exact=False`: equal
    up to float32 rounding (torch.testing.assert_close)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    results = []
    for shard, root in ((fully_shard, fully_shard), (fc.shard, fc.shard_compile)):
        model = build()
        for group in model.groups():
            shard(group)
        root(model)
        results.append(step(model, x))
    assert len(results[0]) == len(results[1])
    for i, (ours, theirs) in enumerate(zip(results[1], results[0])):
        if not exact:
            torch.testing.assert_close(ours, theirs, msg=lambda m, i=i: f"tensor {i}: {m}")
        elif not torch.equal(ours, theirs):
            raise AssertionError(f"tensor {i} differs from fully_shard's by {(ours - theirs).abs().max()}")


def _backward_twice_with_retain_graph(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Two backwards of one loss: the second adds the same gradients again (each reduced)."""
    loss = model(x).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    return [p.grad.full_tensor() for p in model.parameters()]


def _regularised_over_parameters(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """An L2 term over `model.parameters()` (DTensor shards) added to the loss, as docs/mistakes.md says to."""
    l2 = sum(p.pow(2).sum() for p in model.parameters()).full_tensor()
    (model(x).sum() + 1e-2 * l2).backward()
    return [p.grad.full_tensor() for p in model.parameters()]


class _Complex(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.cfloat))

    def forward(self, x):
        return x.to(torch.cfloat) @ self.w


class _WithComplex(nn.Module):
    """A complex parameter in a module of its own (fully_shard needs one dtype per group)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rotate = _Complex()
        self.head = nn.Linear(8, 2)

    def groups(self) -> list[nn.Module]:
        return [self.rotate]

    def forward(self, x):
        return self.head(self.rotate(x).abs())


def _adamw_steps(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() for p in model.parameters()]


def _clipped_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """`torch.nn.utils.clip_grad_norm_` over `model.parameters()` (DTensor shards): the norm of all ranks' rows."""
    model(x).pow(2).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
    return [norm.full_tensor(), *(p.grad.full_tensor() for p in model.parameters())]


class _Frozen(_Blocks):
    """The first block's weight frozen (`requires_grad=False`) inside a group that trains the rest."""

    def __init__(self):
        super().__init__()
        self.blocks[0][0].weight.requires_grad_(False)


class _CheckpointedTwice(_Blocks):
    """Blocks under activation checkpointing; two forwards before one backward (e.g. DPO's two passes)."""

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def _two_forwards_one_backward(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Both forwards' gradients add up in one backward (compared up to rounding: the compiled backward sums the
    two uses of a weight in another order)."""
    (model(x) - model(x.flip(0))).pow(2).sum().backward()
    return [p.grad.full_tensor() for p in model.parameters()]


class _Tied(nn.Module):
    """An embedding and an output layer sharing one weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(6, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.out = nn.Linear(8, 6, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):
        return self.out(self.body(self.embed((x.abs() * 3).long().clamp(max=5))))


def _tied_in_separate_shard_calls(rank: int) -> None:
    """The tied modules sharded by separate `shard` calls train bitwise as `fully_shard` with them in one group,
    the way `fully_shard` needs them (parameters after three AdamW steps)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    results = []
    for separate in (False, True):
        model = _Tied()
        if separate:
            fc.shard(model.embed)
            fc.shard(model.out)
            fc.shard_compile(model)
        else:
            fully_shard([model.embed, model.out])
            fully_shard(model)
        results.append(_adamw_steps(model, x))
    for i, (ours, theirs) in enumerate(zip(results[1], results[0], strict=True)):
        if not torch.equal(ours, theirs):
            raise AssertionError(f"tensor {i} differs from fully_shard's by {(ours - theirs).abs().max()}")


def _full_state_dict_loaded() -> None:
    """`load_state_dict` of an unsharded model's state dict is refused saying how; `set_model_state_dict` with
    `full_state_dict=True`, the way it names, loads it. Raises what the user was told."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = _net().state_dict()
    torch.manual_seed(1)
    model = fc.shard(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    try:
        model.load_state_dict(full)
    except RuntimeError as e:
        told = str(e)
    else:
        raise AssertionError("a plain full state dict loaded into DTensor parameters")
    set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True))
    for name, value in full.items():
        assert torch.equal(model.state_dict()[name].full_tensor(), value), name
    raise RuntimeError(told)


def _feature_dim_differs_between_ranks(rank: int) -> None:
    """Rank 1's batch has 17 features, rank 0's the 16 the model takes."""
    torch.manual_seed(0)
    model = fc.shard_compile(nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2)))
    model(torch.randn(4, 16 + rank)).sum().backward()


def silent_mistakes(rank: int, world_size: int) -> dict:
    """Each case in turn (a barrier between them): the error each rank got, or None."""
    cases = {
        "ignored_param_of_another_model": _ignored_param_of_another_model,
        "aliased_parameters": _aliased_parameters,
        "step_with_sync_left_off": lambda: _step_with_sync_left_off(rank),
        "different_initial_weights": lambda: _different_initial_weights(rank),
        "different_weights_check_off": lambda: _different_weights_check_off(rank),
        "backward_twice_with_retain_graph": lambda: _same_as_fully_shard(
            rank, _Blocks, _backward_twice_with_retain_graph
        ),
        "regularised_over_parameters": lambda: _same_as_fully_shard(rank, _Blocks, _regularised_over_parameters),
        "complex_parameter": lambda: _same_as_fully_shard(rank, _WithComplex, _adamw_steps),
        "full_state_dict_loaded": _full_state_dict_loaded,
        "clip_grad_norm": lambda: _same_as_fully_shard(rank, _Blocks, _clipped_grads),
        "frozen_parameter": lambda: _same_as_fully_shard(rank, _Frozen, _adamw_steps),
        "two_forwards_checkpointed": lambda: _same_as_fully_shard(
            rank, _CheckpointedTwice, _two_forwards_one_backward, exact=False
        ),
        "tied_in_separate_shard_calls": lambda: _tied_in_separate_shard_calls(rank),
        "feature_dim_differs_between_ranks": lambda: _feature_dim_differs_between_ranks(rank),
    }
    out = {}
    for name, case in cases.items():
        dist.barrier()
        out[name] = _error(case)
    return out
