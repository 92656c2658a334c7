"""User-facing configuration objects (frozen dataclasses, FSDP2 names where the meaning is the same)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

__all__ = ["CPUOffloadPolicy", "CompileConfig", "MixedPrecisionPolicy", "OffloadPolicy"]
"""`OffloadPolicy` / `CPUOffloadPolicy` are torch's own (`torch.distributed.fsdp`), re-exported for `shard`'s
`offload_policy`, as `fully_shard` takes them."""


def _check_floating(name: str, dtype: torch.dtype | None) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(
            f"MixedPrecisionPolicy.{name}={dtype!r} is not a floating-point dtype; "
            "use e.g. torch.bfloat16, torch.float16 or torch.float32, or None to keep the parameter's dtype"
        )
    if dtype is not None and dtype.itemsize < 2:
        raise ValueError(
            f"MixedPrecisionPolicy.{name}={dtype}: a one-byte float needs a scale per tensor, which a cast does not "
            "give. For float8 training use torchao's float8 layers (torchao.float8.convert_to_float8_training), which "
            "keep weights in a wider dtype and cast them with a scale in forward; keep this dtype torch.bfloat16 or None"
        )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtypes to compute and communicate in, with FSDP2's meaning."""

    param_dtype: torch.dtype | None = None
    """Dtype parameters are cast to *before* the all-gather and computed in; None keeps the stored dtype."""
    reduce_dtype: torch.dtype | None = None
    """Dtype gradients are reduce-scattered in; None as the installed torch's `fully_shard` reads it: from torch
    2.15 the parameter's stored dtype, before it `param_dtype` (or the stored dtype if that is None)."""
    output_dtype: torch.dtype | None = None
    """Dtype floating-point forward outputs of the sharded module are cast to; None leaves them as they are."""
    cast_forward_inputs: bool = True
    """Cast floating-point forward inputs of the sharded module to `param_dtype`."""
    buffer_dtype: torch.dtype | None = None
    """Dtype the module's floating-point buffers (e.g. BatchNorm statistics) are kept and computed in: `shard`
    casts them once, in place; None leaves them. Not in torch's FSDP2 policy (FSDP1 had it); the FSDP2 overview
    names it."""
    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = field(default=None, kw_only=True)
    """Per parameter, as torch 2.15's FSDP2 policy: called once per managed parameter by `shard`; returning the
    parameter's own dtype keeps it in that dtype, None or `param_dtype` uses `param_dtype`."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype", "buffer_dtype"):
            _check_floating(name, getattr(self, name))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(f"MixedPrecisionPolicy.cast_forward_inputs={self.cast_forward_inputs!r}: use True or False")
        if self.param_dtype_override_fn is not None and not callable(self.param_dtype_override_fn):
            raise TypeError(
                f"MixedPrecisionPolicy.param_dtype_override_fn={self.param_dtype_override_fn!r}: use a function of "
                "a parameter returning a dtype or None"
            )

    @classmethod
    def of(cls, policy: object) -> MixedPrecisionPolicy:
        """`policy`, ours or torch's `torch.distributed.fsdp.MixedPrecisionPolicy` (the same fields and meaning)."""
        if isinstance(policy, cls):
            return policy
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

        if not isinstance(policy, TorchPolicy):
            raise TypeError(
                "shard(mp_policy=...) takes a fsdp2_compile.MixedPrecisionPolicy or torch's "
                f"torch.distributed.fsdp.MixedPrecisionPolicy, got {type(policy).__name__}"
            )
        return cls(
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
            param_dtype_override_fn=getattr(policy, "param_dtype_override_fn", None),
        )

    def param_dtype_of(self, param: nn.Parameter) -> torch.dtype | None:
        """The dtype `param` is gathered and computed in (`param_dtype_override_fn` applied); None: its own."""
        dtype = self.param_dtype
        if self.param_dtype_override_fn is not None:
            override = self.param_dtype_override_fn(param)
            if override is not None and not isinstance(override, torch.dtype):
                raise ValueError(
                    f"MixedPrecisionPolicy.param_dtype_override_fn must return a torch.dtype or None, got "
                    f"{type(override).__name__}"
                )
            if override is not None and override not in (self.param_dtype, param.dtype):
                raise ValueError(
                    "MixedPrecisionPolicy.param_dtype_override_fn must return None, param_dtype or the "
                    f"parameter's own dtype, got {override} for a parameter of {param.dtype} with param_dtype "
                    f"{self.param_dtype}"
                )
            dtype = override or dtype
        return None if dtype == param.dtype else dtype


@dataclass(frozen=True)
class CompileConfig:
    """How the backend turns captured graphs into executable sharded graphs."""

    compiler: str | None = None
    """What runs the final graphs: "aot_eager" (the FX graphs as they are) or "inductor" (Inductor compiles them,
    the collectives staying where the scheduler put them); None chooses by the mesh's device (`compiler_for`):
    Inductor on CUDA, aot_eager on the CPU, whose first step Inductor's C++ compile makes far slower."""
    buckets: str | int | tuple[str, ...] = "shard_calls"
    """How collectives are fused: "shard_calls" (one bucket per module `shard` was called on, as FSDP2 groups
    parameters), "none" (one collective per parameter), an int (consecutive parameters packed up to that many
    bytes), or a tuple of module names (one bucket per named module, the rest in one more)."""
    prefetch: bool = True
    """Reorder for overlap: start all-gathers ahead of use, wait right before first use, wait for
    reduce-scatters as late as possible."""
    prefetch_depth: int = 2
    """How many buckets ahead of the one in use an all-gather may start (the scheduler may choose fewer)."""
    memory_budget_bytes: int | None = None
    """Bytes of gathered parameters allowed alive at once. The prefetch window (the bucket in use and those
    gathered ahead) takes up to `prefetch_depth + 1` times the largest bucket of it; what is left keeps buckets
    gathered from forward to backward (selective unsharding, as `keep_gathered` with that many bytes, unless
    `keep_gathered` is set). None (the default): no cap, a window of `prefetch_depth + 1` largest buckets, nothing
    kept (FSDP2's behaviour)."""
    memory_budget_fraction: float | None = None
    """`memory_budget_bytes` as this fraction (in (0, 1]) of the free memory of the mesh's device, measured once by
    `shard_compile` (before the optimizer's states and the activations exist; CUDA: free device memory, CPU: the
    host's available memory divided among its ranks) and agreed over the mesh's ranks (the smallest). Only with
    `shard_compile`, and not with `memory_budget_bytes`."""
    keep_gathered: int | float | None = None
    """Selective unsharding: a budget for gathered parameters kept from forward to backward instead of resharded
    and gathered again — bytes (int), or a fraction (float in (0, 1]) of the resharded parameters' gathered bytes.
    The last buckets of the forward are kept first (`selective_unshard.py`). None (the default): what
    `memory_budget_bytes` leaves, else nothing (FSDP2's behaviour)."""
    schedule: bool = True
    """Let the cost-model scheduler pick each all-gather's start (within `prefetch_depth` and the budget)."""
    hardware: str | None = None
    """Cost-model profile name (see `hardware.PROFILES`); None measures alpha/beta on the process group once."""
    check_rank_consistency: bool = True
    """At compile time, compare a hash of every schedule across ranks and raise on a mismatch; on the CPU, also
    compare the ranks' step counts before each compiled graph runs (`compiler/step_watch.py`)."""
    keep_snapshots: bool = field(default=False, metadata={"rank_local": True})
    """Keep the graph after every pass in the report (`graph_records.compiled_graphs()[i].snapshots`), for dumps; also
    on when $FSDP2_COMPILE_DUMP is set. A debugging switch: it changes no decision, so ranks may differ in it."""
    defer_full_gc: bool = field(default=True, metadata={"rank_local": True})
    """While the fsdp2 backend compiles (for a `shard_compile`d module: its whole call, Dynamo's tracing included),
    Python's full garbage collections wait, young ones still run; the thresholds are restored afterwards, raising or
    not (`compile_gc.py`). Other compiles in the process are untouched. It changes no decision: ranks may differ."""
    compile_cache: bool = False
    """Save what the backend compiles in torch's AOTAutograd cache (in torch's compile cache directory,
    $TORCHINDUCTOR_CACHE_DIR), so that a later compile of the same graph, in this process or a relaunch, loads it
    instead of compiling. Dynamo traces and guards every call as without it; the key is torch's AOTAutograd cache
    key of the captured graph (its code and constants, the inputs' metadata, grad mode, autocast, torch's settings
    and source) with this package's source, this config, the ranks and process groups, and each parameter's state.
    Graphs with symbolic sizes are compiled as usual. The link is not measured: the scheduler uses `hardware` (else
    the device's named profile), so that a relaunch finds the same key. Set it alike on every rank."""

    def __post_init__(self) -> None:
        if self.compiler not in (None, "aot_eager", "inductor"):
            raise ValueError(f"CompileConfig.compiler={self.compiler!r} is not one of: None, 'aot_eager', 'inductor'")
        ok = (
            self.buckets in ("shard_calls", "none")
            or (_is_int(self.buckets) and self.buckets > 0)
            or (isinstance(self.buckets, tuple) and all(isinstance(b, str) for b in self.buckets))
        )
        if not ok:
            raise ValueError(
                f"CompileConfig.buckets={self.buckets!r}: use 'shard_calls', 'none', a positive byte cap (int), "
                "or a tuple of module names"
            )
        if not _is_int(self.prefetch_depth) or self.prefetch_depth < 0:
            raise ValueError(
                f"CompileConfig.prefetch_depth={self.prefetch_depth!r}: use a whole number of buckets >= 0 "
                "(0 = no prefetch, 2 = the default)"
            )
        if self.memory_budget_bytes is not None and not (
            _is_int(self.memory_budget_bytes) and self.memory_budget_bytes > 0
        ):
            whole = (
                f" (an int: memory_budget_bytes={int(self.memory_budget_bytes)})"
                if isinstance(self.memory_budget_bytes, float) and self.memory_budget_bytes >= 1
                else ""
            )
            raise ValueError(
                f"CompileConfig.memory_budget_bytes={self.memory_budget_bytes!r}: use a positive whole number of "
                f"bytes{whole}, or None for prefetch_depth + 1 times the largest bucket"
            )
        fraction = self.memory_budget_fraction
        if fraction is not None and not (
            isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0.0 < fraction <= 1.0
        ):
            raise ValueError(
                f"CompileConfig.memory_budget_fraction={fraction!r}: use a fraction of the free memory in (0, 1], "
                "e.g. 0.2, or None"
            )
        if fraction is not None and self.memory_budget_bytes is not None:
            raise ValueError(
                "CompileConfig: set memory_budget_bytes or memory_budget_fraction, not both "
                f"(got {self.memory_budget_bytes!r} and {fraction!r})"
            )
        keep = self.keep_gathered
        if keep is not None and not ((_is_int(keep) and keep >= 0) or (isinstance(keep, float) and 0.0 <= keep <= 1.0)):
            raise ValueError(
                f"CompileConfig.keep_gathered={keep!r}: use a number of bytes (int >= 0), a fraction of the "
                "gathered parameter bytes (float in [0, 1]), or None"
            )
        for name in (
            "prefetch",
            "schedule",
            "check_rank_consistency",
            "keep_snapshots",
            "defer_full_gc",
            "compile_cache",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CompileConfig.{name}={getattr(self, name)!r}: use True or False")
        if self.hardware is not None and not isinstance(self.hardware, str):
            raise TypeError(f"CompileConfig.hardware={self.hardware!r}: use a profile name (str) or None")


def _is_int(value: object) -> bool:
    """An int that is not a bool (True would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def compiler_for(config: CompileConfig, device_type: str) -> str:
    """The compiler `config` runs on a mesh of `device_type`: the one it names, else Inductor on CUDA and aot_eager
    elsewhere."""
    if config.compiler is not None:
        return config.compiler
    return "inductor" if device_type == "cuda" else "aot_eager"
