"""The search's candidate layouts: every tp, pp, HSDP replica count and knob of a training step at N ranks and a
global batch, less those a rule prunes (tp beyond a node or not dividing the heads, pp beyond the blocks, a
global batch dp does not divide, ...).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import torch

from fsdp2_compile.planner.devices import device_for
from fsdp2_compile.planner.layout import Layout

__all__ = ["Candidate", "enumerate_candidates"]

NODE_GPUS = {"h100-nvlink": 8, "h100-infiniband": 8}
"""GPUs per node by profile: tensor parallelism stays inside one."""


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    local_batch: int
    """Samples per data-parallel rank per step (the factory's `batch=`)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _replicas(dp: int, tp: int, node: int, world_size: int) -> list[int]:
    """HSDP replica counts: every divisor of dp within one node; beyond one node, 1 and the count that shards
    each parameter over one node's GPUs (shard x tp = node, shard > 1: not DDP), HSDP's usual layout."""
    if world_size <= node:
        return _divisors(dp)
    return [r for r in _divisors(dp) if r == 1 or (dp // r * tp == node and dp // r > 1)]


HEAD_ATTRS = ("n_heads", "n_kv_heads", "num_heads", "num_attention_heads", "num_key_value_heads", "n_head")
"""Attributes naming a head count, on a module or its `cfg` / `config`: tensor parallelism splits heads whole."""


def _heads(model: torch.nn.Module) -> int | None:
    """The largest count that divides every head count the model names (query and key-value heads), or None."""
    counts = set()
    for module in model.modules():
        for owner in (module, getattr(module, "cfg", None), getattr(module, "config", None)):
            for attr in HEAD_ATTRS:
                value = getattr(owner, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    counts.add(value)
    return math.gcd(*counts) if counts else None


def enumerate_candidates(
    world_size: int,
    global_batch: int,
    layers: int,
    heads: int | None,
    profile: str,
    *,
    base: Layout,
    degrees: dict[str, int | None],
) -> tuple[list[Candidate], dict[str, int], int]:
    """(candidates, pruned count by rule, enumerated count). `base` gives the fixed knobs (mp, attention,
    compiler); `degrees` pins tp / pp / replicate where not None."""
    pruned: dict[str, int] = {}
    enumerated = 0

    def prune(rule: str, n: int = 1) -> None:
        pruned[rule] = pruned.get(rule, 0) + n

    node = NODE_GPUS.get(profile, world_size)
    float8 = (
        [False, True] if device_for(profile).float8_flops and base.mp_policy.param_dtype == torch.bfloat16 else [False]
    )
    pipeline_knobs = [
        (s, f8, ac) for s in ("1F1B", "Interleaved1F1B") for f8 in float8 for ac in ("none", "selective", "full")
    ]
    flat_knobs = [
        (r, pre, keep, f8, ac)
        for r, keep in ((None, None), (None, 0.5), (None, 1.0), (False, None))  # nothing to keep without resharding
        for pre in (1, 2)
        for f8 in float8
        for ac in ("none", "selective", "full")
    ]
    out = []
    for tp in [degrees["tp"]] if degrees["tp"] else _divisors(world_size):
        for pp in [degrees["pp"]] if degrees["pp"] else _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            reps = [degrees["replicate"]] if degrees["replicate"] else _replicas(dp, tp, node, world_size)
            local = global_batch // dp
            # micro-batches of one sample; with pp pinned (few candidates), each count of at least pp dividing the
            # local batch
            counts = (degrees["pp"] and [m for m in _divisors(local) if m >= pp]) or [local]
            n_knobs = len(pipeline_knobs) * len(counts) if pp > 1 else len(flat_knobs)
            enumerated += len(reps) * n_knobs
            rule = None
            if tp > node:
                rule = f"tp > {node} (one node)"
            elif heads is not None and heads % tp:
                rule = "tp does not divide the attention (key-value) heads"
            elif pp > 1 and pp > layers:
                rule = f"pp > the {layers} blocks"
            elif global_batch % dp:
                rule = "global batch not a multiple of dp"
            if rule:
                prune(rule, len(reps) * n_knobs)
                continue
            for rep in reps:
                if pp == 1:
                    for reshard, pre, keep, f8, ac in flat_knobs:
                        lay = dataclasses.replace(
                            base,
                            world_size=world_size,
                            replicate=rep,
                            tp=tp,
                            reshard_after_forward=reshard,
                            prefetch=pre,
                            keep_gathered=keep,
                            float8=f8,
                            ac=ac,
                        )
                        out.append(Candidate(lay, local))
                    continue
                for (schedule, f8, ac), m in itertools.product(pipeline_knobs, counts):
                    v = 2 if schedule == "Interleaved1F1B" else 1
                    if pp * v > layers:
                        prune("pp x stages per rank > blocks")
                        continue
                    if m < pp or (v > 1 and m % pp):
                        prune("micro-batches fewer than pp, or not a multiple of pp (interleaved)")
                        continue
                    lay = dataclasses.replace(
                        base,
                        world_size=world_size,
                        replicate=rep,
                        tp=tp,
                        pp=pp,
                        pp_schedule=schedule,
                        microbatches=m,
                        reshard_after_forward=None,
                        float8=f8,
                        ac=ac,
                        keep_gathered=None,
                        memory_budget_bytes=None,
                    )
                    out.append(Candidate(lay, local))
    return out, pruned, enumerated


def describe(cand: Candidate) -> str:
    """A layout in a few words: the mesh and the knobs that differ from the defaults."""
    lay = cand.layout
    dims = [("pp", lay.pp), ("replicate", lay.replicate), ("dp", lay.shard_size), ("tp", lay.tp)]
    mesh = " x ".join(f"{name} {n}" for name, n in dims if n > 1 or name == "dp")
    words = [mesh, f"AC {lay.ac}", f"local batch {cand.local_batch}"]
    if lay.pp > 1:
        words.append(f"{lay.pp_schedule}, {lay.microbatches} micro-batches")
    else:
        words.append("reshard" if lay.reshard_after_forward is not False else "no reshard")
        words.append(f"prefetch {lay.prefetch}")
        if lay.keep_gathered is not None:
            words.append(f"keep {lay.keep_gathered:g}")
    if lay.float8:
        words.append("float8")
    return ", ".join(words)
