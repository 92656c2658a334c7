"""What a plan is made for (`Layout`): the ranks, their mesh and the knobs of the training step, checked when
built as the compiler checks its own options.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp2_compile.config import CompileConfig, MixedPrecisionPolicy

__all__ = ["Layout"]

_FUSED = {"aot_eager": False, "inductor": True, "inductor-blocks": "blocks"}
"""The kernels a plan assumes, and what the traced step fuses under each (`StepTrace.materialized`)."""


def _is_count(value: object) -> bool:
    """A whole number >= 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Layout:
    """What a plan is made for: the ranks, their mesh and the knobs of the training step. Frozen and compared by
    value (hashable): layouts can be enumerated, compared and used as keys. Checked when built."""

    world_size: int
    """Ranks in all (N); `make_plan` needs the default process group of that many ranks (the fake one)."""
    replicate: int = 1
    """HSDP replicas (R): the mesh is R x N/R (replicate x shard); 1 = plain FSDP over all ranks."""
    tp: int = 1
    """Tensor-parallel degree (T) inside FSDP (`tensor_parallel.py`): the mesh is N/T x T (dp x tp), or R x N/(R T) x T;
    the factory's `tp_plan` or the default one is applied to every block; 1 = no tensor parallelism."""
    reshard_after_forward: bool | None = None
    """As `shard`'s: None FSDP2's default (the blocks reshard, the root keeps its parameters), True or False."""
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()
    """Mixed precision as `shard`'s; MixedPrecisionPolicy() computes and reduces in the parameters' dtype."""
    attention: str = "fused"
    """The attention kernel the trace assumes: "fused" (flash / memory-efficient) or "math"."""
    ac: str = "none"
    """Activation checkpointing of the blocks: "none", "full" or "selective" (torchtitan's op policy); a model the
    factory already checkpointed is planned as given."""
    compiler: str = "aot_eager"
    """Kernels: "aot_eager" (eager), "inductor" (fused elementwise) or "inductor-blocks" (Inductor on each block
    only, the rest eager: torchtitan's per-block compile)."""
    prefetch: int = CompileConfig.prefetch_depth
    """Blocks gathered ahead of the one in use (`CompileConfig.prefetch_depth`)."""
    keep_gathered: int | float | None = None
    """Selective unsharding as `CompileConfig.keep_gathered`, decided on the full model's buckets (blocks in order,
    then the root) by the compiler's own rule (`selective_unshard.choose_kept`): the kept buckets' backward
    all-gathers leave the bytes and the schedule, their gathered parameters stay in memory from forward to backward
    (counted in activations and the peak)."""
    memory_budget_bytes: int | None = None
    """As `CompileConfig.memory_budget_bytes`: what it leaves beyond the prefetch window is kept the same way
    (`selective_unshard.keep_amount`)."""
    pp: int = 1
    """Pipeline-parallel degree (P, `pipeline_schedule.py`): the mesh is (pp, [replicate,] dp [, tp]) and the
    blocks split into P x V stages (the embedding with the first, the head and the loss with the last); 1 = no
    pipeline."""
    microbatches: int | None = None
    """Micro-batches per step under pp (M), dividing the local batch (dim 0 of the factory's inputs); None:
    torchtitan's default, micro-batches of one sample (M = the local batch)."""
    pp_schedule: str = "1F1B"
    """The pipeline schedule: "1F1B", "GPipe" or "Interleaved1F1B" (`pipeline_schedule.SCHEDULES`)."""
    stages_per_rank: int | None = None
    """Stages each pp rank runs (V); None: 1, or 2 for Interleaved1F1B (torchtitan's default)."""
    float8: bool = False
    """torchao float8 training with float8 all-gather: the blocks' Linear weights gathered as float8 (1 byte an
    element), their matmuls at the device's float8 peak; needs bf16 parameters (mp_policy param_dtype)."""

    def __post_init__(self) -> None:
        for name, what in (
            ("world_size", "a number of ranks"),
            ("replicate", "a number of replicas (1: no HSDP)"),
            ("tp", "a tensor-parallel degree (1: no TP)"),
            ("pp", "a pipeline-parallel degree (1: no PP)"),
        ):
            if not _is_count(getattr(self, name)):
                raise ValueError(f"Layout.{name}={getattr(self, name)!r}: use {what}, a whole number >= 1")
        if self.world_size % (self.pp * self.replicate * self.tp):
            pp = f"pp {self.pp} x " if self.pp > 1 else ""
            raise ValueError(
                f"Layout.world_size={self.world_size} is not a multiple of {pp}replicate {self.replicate} x tp "
                f"{self.tp}: the mesh is {'pp x ' if pp else ''}replicate x shard x tp; pass a world_size that is a "
                f"multiple of {self.pp * self.replicate * self.tp}, or degrees whose product divides "
                f"{self.world_size}"
            )
        self._check_pipeline()
        if self.float8 is not False and (self.float8 is not True or self.mp_policy.param_dtype != torch.bfloat16):
            raise ValueError(
                f"Layout.float8={self.float8!r} with param_dtype {self.mp_policy.param_dtype}: float8 training "
                "(True) needs bf16 parameters; pass mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                "reduce_dtype=torch.float32) (--mp bf16)"
            )
        if self.reshard_after_forward not in (None, True, False):
            raise ValueError(
                f"Layout.reshard_after_forward={self.reshard_after_forward!r}: use None (FSDP2's "
                "default), True or False (resharding to a smaller group is not planned)"
            )
        if not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise ValueError(
                f"Layout.mp_policy={self.mp_policy!r}: use a MixedPrecisionPolicy "
                "(MixedPrecisionPolicy() for the parameters' own dtype)"
            )
        for name, choices in (
            ("attention", ("fused", "math")),
            ("ac", ("none", "full", "selective")),
            ("compiler", tuple(_FUSED)),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"Layout.{name}={getattr(self, name)!r} is not one of: {', '.join(choices)}")
        # the compiler's own checks, so that the plan refuses what the compiler refuses
        for name, option in (
            ("prefetch", "prefetch_depth"),
            ("keep_gathered", "keep_gathered"),
            ("memory_budget_bytes", "memory_budget_bytes"),
        ):
            try:
                CompileConfig(**{option: getattr(self, name)})
            except ValueError as e:
                raise ValueError(f"Layout.{name}: {e}") from None

    def _check_pipeline(self) -> None:
        from fsdp2_compile.planner.pipeline_schedule import SCHEDULES

        if self.pp_schedule not in SCHEDULES:
            raise ValueError(f"Layout.pp_schedule={self.pp_schedule!r} is not one of: {', '.join(SCHEDULES)}")
        for name in ("microbatches", "stages_per_rank"):
            value = getattr(self, name)
            if value is not None and not _is_count(value):
                raise ValueError(f"Layout.{name}={value!r}: use a whole number >= 1, or None for the default")
            if value is not None and self.pp == 1:
                raise ValueError(f"Layout.{name}={value!r} without pipeline parallelism: pass pp > 1 or leave it None")
        interleaved = self.pp_schedule == "Interleaved1F1B"
        if self.stages_per_rank is not None and (self.stages_per_rank >= 2) != interleaved:
            raise ValueError(
                f"Layout.stages_per_rank={self.stages_per_rank} with {self.pp_schedule}: "
                + ("Interleaved1F1B runs 2 or more stages per rank" if interleaved else "use 1 (or Interleaved1F1B)")
            )
        if self.pp > 1 and (self.keep_gathered is not None or self.memory_budget_bytes is not None):
            raise ValueError(
                "Layout.keep_gathered / memory_budget_bytes with pp > 1: the pipeline keeps each stage's parameters "
                "gathered for the whole step already (torch's schedules reshard after the last micro-batch); "
                "leave them None"
            )

    @property
    def shard_size(self) -> int:
        """Ranks each parameter is sharded over by FSDP: world_size / (pp x replicate x tp)."""
        return self.world_size // (self.pp * self.replicate * self.tp)

    @property
    def v(self) -> int:
        """Stages per pp rank."""
        return self.stages_per_rank or (2 if self.pp_schedule == "Interleaved1F1B" else 1)
