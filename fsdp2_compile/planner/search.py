"""The planner's search: every layout and knob of a training step at N ranks and a global batch, planned as
`make_plan` plans one, those that fit the device's memory ranked by tokens/s per GPU.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fsdp2_compile.debug.sizes import size_text
from fsdp2_compile.planner.candidates import Candidate, _heads, describe, enumerate_candidates
from fsdp2_compile.planner.layout import Layout
from fsdp2_compile.planner.plan import Plan, _assemble
from fsdp2_compile.planner.reduced_depth import block_list, reduced_copy
from fsdp2_compile.planner.search_stages import _Stages

__all__ = ["DEVICE_MEMORY", "Scored", "SearchResult", "plan_candidates", "search"]

DEVICE_MEMORY = {"h100-nvlink": 80 * 2**30, "h100-infiniband": 80 * 2**30}
"""Device memory by profile: the common H100 SXM's 80 GB (torchtitan's published H100 runs had 96 GB: pass
`device_memory` for such devices); a CPU profile needs the budget given."""

MEMORY_BINDS = 0.9
"""A candidate whose reserved peak is at least this fraction of the device's memory is bound by memory."""


# Enumerated: tp (dividing N, the attention heads, at most a node's 8 GPUs on the H100 profiles), pp (dividing N / tp,
# at most the block count; schedules 1F1B and Interleaved1F1B with micro-batches of one sample, or with pp pinned
# every micro-batch count of at least pp that divides the local batch), HSDP replicas
# (dividing the data-parallel size), activation checkpointing (none, selective, full), reshard_after_forward (FSDP2's
# default or False; under pp the pipeline keeps stages gathered), prefetch depth (1, 2), keep_gathered (none, half,
# all of the resharded bytes) and float8 where the device has it. The local batch is the global batch / dp.
#
# The stages of `make_plan` are shared between candidates by what each depends on (`search_stages.py`): the full
# model is sharded once per tp and its figures at another dp split derived from its parameters' shapes; each copy is
# compiled once per (tp, shard size 1 or more) with FSDP's collectives derived for the candidate's shard size,
# replicas and resharding, and TP's for its rows per micro-batch (those that carry the activations scale with the
# rows, the rest keep their bytes: learned from the first tp compiled at two row counts); each copy is traced once per
# (tp, activation checkpointing, rows). A derivation is checked against the stage it comes from, and a stage whose
# check fails is built for each candidate. The candidates are enumerated in `candidates.py`.
@dataclass
class Scored:
    """A candidate's plan on the searched profile and what binds it."""

    candidate: Candidate
    plan: Plan
    profile: str
    device_memory: int

    @property
    def tokens_per_s(self) -> float:
        return self.plan.tokens_per_s_per_rank[self.profile]

    @property
    def reserved(self) -> int:
        return self.plan.peak_reserved_bytes[self.profile]

    @property
    def step_s(self) -> float:
        return self.plan.step_time_s[self.profile]

    @property
    def compute_s(self) -> float:
        return sum(self.plan.compute_s[self.profile].values())

    @property
    def exposed_s(self) -> float:
        return self.plan.exposed_comm_s[self.profile]

    @property
    def bubble_s(self) -> float:
        return self.plan.bubble_s.get(self.profile, 0.0)

    @property
    def fits(self) -> bool:
        return self.reserved <= self.device_memory

    @property
    def binds(self) -> str:
        """memory (reserved >= MEMORY_BINDS of the device), else the largest share of the step: compute, link
        (exposed communication) or bubble."""
        if self.reserved >= MEMORY_BINDS * self.device_memory:
            return "memory"
        shares = {"compute": self.compute_s, "link": self.exposed_s, "bubble": self.bubble_s}
        return max(shares, key=shares.get)

    def to_json(self) -> dict:
        lay = self.candidate.layout
        return {
            "layout": layout_json(lay),
            "local_batch": self.candidate.local_batch,
            "tokens_per_s_per_gpu": self.tokens_per_s,
            "step_time_s": self.step_s,
            "compute_s": self.compute_s,
            "exposed_comm_s": self.exposed_s,
            "bubble_s": self.bubble_s,
            "peak_reserved_bytes": self.reserved,
            "device_memory_bytes": self.device_memory,
            "mfu": self.plan.mfu[self.profile],
            "binds": self.binds,
        }


def layout_json(lay: Layout) -> dict:
    """The layout's fields as JSON (the mixed precision policy's dtypes by name)."""
    out = {f.name: getattr(lay, f.name) for f in dataclasses.fields(lay) if f.name != "mp_policy"}
    mp = lay.mp_policy
    out["mp_policy"] = {
        "param_dtype": str(mp.param_dtype).removeprefix("torch.") if mp.param_dtype else None,
        "reduce_dtype": str(mp.reduce_dtype).removeprefix("torch.") if mp.reduce_dtype else None,
    }
    return out


@dataclass
class SearchResult:
    world_size: int
    global_batch: int
    profile: str
    device_memory: int
    enumerated: int
    pruned: dict[str, int]
    evaluated: int
    fitting: int
    top: list[Scored]
    wall_s: float = 0.0
    stages: dict[str, int] = field(default_factory=dict)
    """How many times each stage was built (real shards, compiles, traces)."""

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "hardware": self.profile,
            "device_memory_bytes": self.device_memory,
            "enumerated": self.enumerated,
            "pruned": self.pruned,
            "evaluated": self.evaluated,
            "fitting": self.fitting,
            "wall_s": self.wall_s,
            "stages_built": self.stages,
            "top": [s.to_json() for s in self.top],
        }


def search(
    factory: Callable,
    world_size: int,
    global_batch: int,
    profile: str,
    *,
    base: Layout,
    call: Callable = lambda f, **kw: f(**kw),
    device_memory: int | None = None,
    degrees: dict[str, int | None] | None = None,
    top: int = 5,
    progress: Callable[[str], object] | None = None,
) -> SearchResult:
    """Plan every candidate layout of `factory`'s model at `world_size` ranks and `global_batch` samples per step
    on `profile`, and rank those whose reserved peak fits `device_memory` by tokens/s per GPU. Needs the default
    process group of `world_size` ranks (the fake one). ValueError when nothing is left to plan or nothing fits."""
    start = time.perf_counter()
    step = progress or (lambda msg: None)
    degrees = degrees or {"tp": None, "pp": None, "replicate": None}
    if device_memory is None:
        if profile not in DEVICE_MEMORY:
            raise ValueError(
                f"profile {profile!r} has no device memory on record; pass device_memory (--device-memory BYTES)"
            )
        device_memory = DEVICE_MEMORY[profile]
    name = getattr(factory, "__name__", repr(factory))
    if "batch" not in inspect.signature(factory).parameters:
        raise ValueError(
            f"factory {name}() takes no batch=: the search builds each layout's local batch (global "
            "batch / dp) through it; give the factory a batch= argument (dim 0 of its inputs)"
        )
    step("building a 1-block copy for the model's blocks and heads")
    model = reduced_copy(factory, 1, lambda f, **kw: call(f, batch=1, **kw))[0]
    heads = _heads(model)
    layers = _block_count(factory, call)
    cands, pruned, enumerated = enumerate_candidates(
        world_size, global_batch, layers, heads, profile, base=base, degrees=degrees
    )
    if not cands:
        raise ValueError(_nothing_left(world_size, global_batch, pruned, degrees))
    step(f"planning {len(cands):,} candidates ({enumerated:,} enumerated)")
    scored, built = plan_candidates(factory, cands, profile, device_memory, call=call, progress=step)
    fitting = [s for s in scored if s.fits]
    if not fitting:
        best = min(scored, key=lambda s: s.reserved)
        raise ValueError(
            f"no layout fits: the smallest reserved peak, at {describe(best.candidate)}, is "
            f"{size_text(best.reserved)}, {size_text(best.reserved - device_memory)} over the device's "
            f"{size_text(device_memory)} ({profile}, {len(scored):,} layouts planned); use more ranks, a smaller "
            "global batch, or a larger --device-memory"
        )
    fitting.sort(key=lambda s: (-s.tokens_per_s, s.reserved))
    return SearchResult(
        world_size,
        global_batch,
        profile,
        device_memory,
        enumerated,
        pruned,
        len(scored),
        len(fitting),
        fitting[:top],
        time.perf_counter() - start,
        built,
    )


def plan_candidates(
    factory: Callable,
    cands: list[Candidate],
    profile: str,
    device_memory: int,
    *,
    call: Callable = lambda f, **kw: f(**kw),
    progress: Callable[[str], object] | None = None,
) -> tuple[list[Scored], dict[str, int]]:
    """Each candidate's plan on `profile` (as `make_plan(factory, layout, call=<call with batch=local_batch>)`'s),
    the stages shared between them; and how many times each stage was built."""
    stages = _Stages(factory, call, profile, progress or (lambda msg: None))
    scored = []
    for cand in cands:
        full = stages.full(cand)
        ac_used = "as given" if full.given_ac else cand.layout.ac
        copies = stages.copies(cand, full, ac_used)
        plan = _assemble(cand.layout, full, copies, [profile])
        scored.append(Scored(cand, plan, profile, device_memory))
    return scored, stages.built


def _block_count(factory: Callable, call: Callable) -> int:
    """Blocks of the full model: the factory's default `layers`, else its model's block list (built once)."""
    default = inspect.signature(factory).parameters.get("layers")
    if default is not None and isinstance(default.default, int):
        return default.default
    model = call(factory, batch=1)[0]
    _, blocks = block_list(model)
    return len(blocks) if blocks is not None else 0


def _nothing_left(world_size: int, global_batch: int, pruned: dict[str, int], degrees: dict) -> str:
    pinned = ", ".join(f"{k} {v}" for k, v in degrees.items() if v)
    rules = "; ".join(f"{rule}: {n:,}" for rule, n in pruned.items())
    if "global batch not a multiple of dp" in pruned and len(pruned) == 1:
        return (
            f"global batch {global_batch} is not a multiple of the data-parallel size of any layout "
            f"(dp = {world_size} / (tp x pp){', ' + pinned if pinned else ''}); pass a global batch that is a "
            "multiple of one, e.g. of " + str(world_size // ((degrees.get("tp") or 1) * (degrees.get("pp") or 1)))
        )
    return f"no layout left to plan at {world_size} ranks, global batch {global_batch} ({rules})"
