"""torchao's float8 training weights gathered as float8, as `fully_shard` gathers them."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from fsdp2_compile._torch_private import check_torchao_version, float8_weight_cast, float8_weight_data
from fsdp2_compile._torch_private import functional_collectives as _funcol
from fsdp2_compile.core.group_caches import dropped_with_groups
from fsdp2_compile.core.ops import ParamSpec, backward_facts, unshard, unshard_backward

__all__ = ["Float8Cast", "float8_cast_of", "gather_float8", "gather_key", "high_precision"]

_FLOAT8_WEIGHT = "WeightWithDynamicFloat8CastTensor"


# `convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))` makes each
# `Float8Linear` weight a `WeightWithDynamicFloat8CastTensor`: a high-precision tensor that FSDP2 casts to float8
# before its all-gather (`fsdp_pre_all_gather`) and hands to the layer as a `Float8TrainingTensor` after
# (`fsdp_post_all_gather`). `shard` records the cast of such a weight (`Float8Cast`, `ParamInfo.float8`) and keeps
# its plain high-precision shard as the DTensor's local tensor. Each forward, `gather_float8` does what those two
# methods do in the graph: the shard's amax, all-reduced with MAX over the shard group, gives the weight's scale
# (torchao's `amax_to_scale`); the shard cast with it is gathered as bytes by `fsdp2::unshard` (one byte per element
# instead of two or four) and wrapped with the scale, which `Float8Linear` multiplies without casting again. The
# gradient is the high-precision one, reduced as any parameter's.
#
# torchao's `precompute_float8_dynamic_scale_for_fsdp` finds no weight of a sharded module to precompute: the scale
# is computed where the gather is, from the same amax, to the same value.
@dataclasses.dataclass(frozen=True)
class Float8Cast:
    """How a torchao float8 weight is cast before its all-gather (the float8 dtype, the layer's matmul config), and
    this rank's shard of it (rows, dtype), which its gradient is reduced into."""

    dtype: torch.dtype
    mm_config: Any
    shard_rows: int = 0
    shard_dtype: torch.dtype = torch.float32


def _local(param: Tensor) -> Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _has_gather_extension(t: Tensor) -> bool:
    return hasattr(type(t), "fsdp_pre_all_gather")


def _is_float8_weight(t: Tensor) -> bool:
    return type(t).__name__ == _FLOAT8_WEIGHT and type(t).__module__.startswith("torchao.")


@functools.cache
def _check_torchao() -> None:
    """The installed torchao is one whose float8 weights this project reads (once a process: a metadata lookup)."""
    check_torchao_version(importlib.metadata.version("torchao"))


def float8_cast_of(fqn: str, param: Tensor, shard: Tensor | None = None) -> Float8Cast | None:
    """The cast of torchao's float8 weight `param` (None for any other parameter), whose local shard is `shard`;
    a tensor subclass with FSDP2's all-gather extensions that is not one is refused, naming parameter `fqn`."""
    local = _local(param)
    if not _has_gather_extension(local):
        return None
    if not _is_float8_weight(local):
        raise TypeError(
            f"parameter '{fqn}' is a {type(local).__name__} with FSDP2's all-gather extensions "
            "(fsdp_pre_all_gather): fsdp2_compile gathers torchao's float8 weights (WeightWithDynamicFloat8CastTensor) "
            "only; shard it with torch.distributed.fsdp.fully_shard, or pass it in ignored_params"
        )
    _check_torchao()
    dtype, mm_config = float8_weight_cast(local)
    if shard is None:
        return Float8Cast(dtype, mm_config)
    return Float8Cast(dtype, mm_config, shard.shape[0], shard.dtype)


def high_precision(t: Tensor) -> Tensor:
    """`t`'s high-precision tensor if it is a torchao float8 weight, else `t`."""
    return float8_weight_data(t) if _is_float8_weight(t) else t


def _scale(shard: Tensor, spec: ParamSpec, cast: Float8Cast) -> Tensor:
    """The weight's scale: torchao's `amax_to_scale` of the largest magnitude over every rank's shard."""
    from torchao.float8.float8_utils import amax_to_scale

    amax = torch.max(torch.abs(shard)) if shard.numel() else shard.new_zeros(())
    if spec.world_size > 1:  # over a group of one the shard's amax is the weight's
        amax = _funcol.wait_tensor(_funcol.all_reduce(amax, "max", spec.group_name))
    return amax_to_scale(amax, cast.dtype)


_GATHERS: dict[str, tuple[ParamSpec, ParamSpec, Float8Cast]] = dropped_with_groups({})
"""By key (`gather_key`): a float8 weight's spec, the spec of its float8 bytes and its cast. The autograd functions
take the key, a text Dynamo guards by value (it has no guard for an opaque `ParamSpec` argument)."""
_BACKWARDS: dict[str, SimpleNamespace] = dropped_with_groups({})
"""What the weight's backward needs (`ops.backward_facts`), by the same key: made before Dynamo traces, which
cannot build it."""


class _GradientAnchor(torch.autograd.Function):
    """A zero-strided stand-in of the gathered high-precision weight: what reaches it in backward is the weight's
    gradient, reduced as `fsdp2::unshard`'s backward reduces it."""

    @staticmethod
    def forward(ctx, shard: Tensor, key: str) -> Tensor:
        spec = _GATHERS[key][0]
        ctx.key = key
        return shard.new_zeros((), dtype=spec.param_dtype or shard.dtype).expand(spec.dim0, *shard.shape[1:])

    @staticmethod
    def backward(ctx, grad: Tensor):
        return unshard_backward(_BACKWARDS[ctx.key], grad)


class _Float8Weight(torch.autograd.Function):
    """The gathered float8 bytes and their scale as the `Float8TrainingTensor` of the weight `anchor` stands for;
    its gradient goes to `anchor` unchanged (as torchao's own casts pass it)."""

    @staticmethod
    def forward(ctx, anchor: Tensor, data: Tensor, scale: Tensor, key: str) -> Tensor:
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        cast = _GATHERS[key][2]
        return Float8TrainingTensor(data, scale, anchor.dtype, cast.mm_config, gemm_input_role=GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None, None


def gather_key(spec: ParamSpec, cast: Float8Cast) -> str:
    """The key `gather_float8` takes for a shard with `spec`, cast as `cast` says (registered on first use)."""
    key = repr((spec, cast))
    if key not in _GATHERS:
        _GATHERS[key] = (spec, dataclasses.replace(spec, param_dtype=None), cast)
        shard = torch.empty((cast.shard_rows,), dtype=cast.shard_dtype, device="meta")  # its rows and dtype
        _BACKWARDS[key] = backward_facts(spec, shard, 2)
    return key


def gather_float8(shard: Tensor, key: str) -> Tensor:
    """The gathered float8 weight (a `Float8TrainingTensor`) of `shard`, as `gather_key` registered it: the shard
    cast with the weight's scale, all-gathered as bytes."""
    from torchao.float8.float8_utils import to_fp8_saturated

    spec, bytes_spec, cast = _GATHERS[key]
    local = shard.detach()
    scale = _scale(local, spec, cast)
    bits = to_fp8_saturated(local.to(torch.float32) * scale, cast.dtype)
    data = unshard(bits.view(torch.uint8), bytes_spec).view(cast.dtype)
    return _Float8Weight.apply(_GradientAnchor.apply(shard, key), data, scale, key)
