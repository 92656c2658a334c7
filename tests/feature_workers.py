"""Per-rank jobs for tests/test_features.py (module level, so spawned ranks can import them): evaluation, activation
checkpointing, LR schedulers / optimizer state dicts / gradient clipping, and per-module reshard_after_forward on
the sharded, compiled GPT. Each job returns plain values; the tests compare them with a single-process reference."""

from __future__ import annotations

import copy
import gc
import math
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from models import batch, local_slice, loss_fn, make_model, make_optimizer
from torch import fx
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.distributed.tensor import DTensor
from torch.fx.experimental.symbolic_shapes import optimization_hint

import fsdp2_compile as fc
from fsdp2_compile.compiler.graph_records import clear_compiled_graphs, collectives, compiled_graphs

STEPS = 4
EVAL_STEPS = (50, 51)
"""`batch("gpt", i)` of these i are the evaluation batches (training uses 0 .. STEPS-1)."""
RESUME_AT = 2
CLIP = 0.5


def warmup(step: int) -> float:
    """LambdaLR factor: linear warm-up over 3 steps."""
    return min(1.0, (step + 1) / 3)


def build(*, ac: bool = False, reshard_blocks: tuple[bool, ...] = (True, True), reshard_root: bool = True):
    """The GPT sharded FSDP2-style (each block, then the root, compiled); with `ac`, each block is wrapped in
    `checkpoint_wrapper` first, as FSDP2 users do (activation checkpointing, then fully_shard)."""
    model = make_model("gpt")
    for i, block in enumerate(model.blocks):
        if ac:
            block = model.blocks[i] = checkpoint_wrapper(block)
        fc.shard(block, reshard_after_forward=reshard_blocks[i])
    fc.shard_compile(model, reshard_after_forward=reshard_root)
    return model


def _mean_over_ranks(t: torch.Tensor) -> float:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train_step(model, opt, i: int, *, clip: float | None = None, foreach: bool | None = None, sched=None) -> dict:
    """One step on this rank's slice of global batch `i`: the loss averaged over ranks, the clipping norm, the lr."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = batch("gpt", i)
    loss = loss_fn("gpt", model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
    loss.backward()
    norm = None
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=foreach)
        norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
    lr = opt.param_groups[0]["lr"]
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()
    return {"loss": _mean_over_ranks(loss), "norm": norm, "lr": lr}


_RETURNED: set[int] = set()
"""data_ptr of every unsharded parameter copy a job returns (kept alive until the end, not a leak)."""


def _full_params(model) -> dict[str, torch.Tensor]:
    """Unsharded parameters under the reference's names (checkpoint_wrapper's prefix dropped)."""
    with torch.no_grad():  # else each copy's autograd graph keeps the model's parameters alive
        full = {k.replace("_checkpoint_wrapped_module.", ""): p.full_tensor() for k, p in model.named_parameters()}
    _RETURNED.update(t.data_ptr() for t in full.values())
    return full


def _live_unsharded(model, opt) -> list[tuple[int, ...]]:
    """Shapes of plain tensors alive in this process that have a sharded parameter's full shape and are not
    one of the shards (parameters, gradients, optimizer state) or a returned copy: gathered parameters somebody
    still holds."""
    params = list(model.parameters())
    gc.collect()
    full_shapes = {tuple(p.shape) for p in params if isinstance(p, DTensor) and p.to_local().shape != p.shape}
    shards = params + [p.grad for p in params] + [v for s in opt.state.values() for v in s.values()]
    shard_ptrs = {t.to_local().data_ptr() for t in shards if isinstance(t, DTensor)} | _RETURNED
    return sorted(
        {
            tuple(o.shape)
            for o in gc.get_objects()
            if type(o) in (torch.Tensor, torch.nn.Parameter)
            and tuple(o.shape) in full_shapes
            and o.data_ptr() not in shard_ptrs
        }
    )


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of a (fake) tensor; symbolic sizes at their hint (AC saves the CPU RNG state, of unbacked size)."""
    return math.prod(optimization_hint(d) for d in t.shape) * t.element_size()


def saved_bytes(fw: fx.GraphModule, user_outputs: int = 1) -> dict:
    """Bytes of what a forward graph returns for backward (its outputs after the `user_outputs` model outputs),
    in all and without the graph's inputs (parameter shards, token ids): the saved activations."""
    outs = fw.graph.output_node().args[0]
    saved = [o for o in outs[user_outputs:] if isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor)]

    def nbytes(nodes) -> int:
        return sum(_nbytes(o.meta["val"]) for o in nodes)

    return {
        "first_output_shape": tuple(outs[0].meta["val"].shape),
        "total": nbytes(saved),
        "activations": nbytes(o for o in saved if o.op != "placeholder"),
        "count": len(saved),
    }


def _graphs() -> list[dict]:
    return [
        {"kind": r.kind, "collectives": collectives(r.gm), "saved": saved_bytes(r.gm) if r.kind == "forward" else None}
        for r in compiled_graphs()
    ]


def _timed(job: Callable[[], dict]) -> dict:
    """`job()`'s result, the graphs it compiled and its run time; a failure is returned (as "error"), so that the
    other jobs still run and each test reports its own."""
    clear_compiled_graphs()
    start = time.perf_counter()
    try:
        result = job()
    except Exception:  # noqa: BLE001 - every rank compiles the same graphs, so every rank fails alike
        result = {"error": traceback.format_exc(limit=-8)}
    return result | {"graphs": _graphs(), "seconds": time.perf_counter() - start}


def _evaluation() -> dict:
    """Train RESUME_AT steps, evaluate (eval mode, no_grad) on the EVAL_STEPS batches, train the rest."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build()
    opt = make_optimizer(model)
    steps = [train_step(model, opt, i) for i in range(RESUME_AT)]
    model.eval()
    evals = []
    with torch.no_grad():
        for i in EVAL_STEPS:
            x, y = batch("gpt", i)
            logits = model(local_slice(x, rank, world_size))
            loss = loss_fn("gpt", logits, local_slice(y, rank, world_size))
            evals.append({"logits": logits, "loss": _mean_over_ranks(loss), "requires_grad": logits.requires_grad})
    live_after_eval = _live_unsharded(model, opt)
    grads_after_eval = [k for k, p in model.named_parameters() if p.grad is not None]
    model.train()
    steps += [train_step(model, opt, i) for i in range(RESUME_AT, STEPS)]
    return {
        "steps": steps,
        "evals": evals,
        "live_after_eval": live_after_eval,
        "grads_after_eval": grads_after_eval,
        "full": _full_params(model),
    }


def _plain_training(**build_options) -> dict:
    model = build(**build_options)
    opt = make_optimizer(model)
    steps = [train_step(model, opt, i) for i in range(STEPS)]
    live = _live_unsharded(model, opt)
    return {"steps": steps, "live": live, "full": _full_params(model)}


def _scheduled(foreach: bool) -> dict:
    """AdamW + LambdaLR + clip_grad_norm_ for STEPS steps; with foreach=True, also save model, optimizer and
    scheduler state after RESUME_AT steps and continue from them in a fresh sharded model."""
    options = {"clip": CLIP, "foreach": foreach}
    model = build()
    opt = make_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    steps = [train_step(model, opt, i, sched=sched, **options) for i in range(RESUME_AT)]
    saved = (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        copy.deepcopy(opt.state_dict()),
        copy.deepcopy(sched.state_dict()),
    )
    steps += [train_step(model, opt, i, sched=sched, **options) for i in range(RESUME_AT, STEPS)]
    result = {"steps": steps, "full": _full_params(model)}
    if foreach:
        fresh = build()
        fresh_opt = make_optimizer(fresh)
        fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, warmup)
        fresh.load_state_dict(saved[0])
        fresh_opt.load_state_dict(saved[1])
        fresh_sched.load_state_dict(saved[2])
        resumed = [train_step(fresh, fresh_opt, i, sched=fresh_sched, **options) for i in range(RESUME_AT, STEPS)]
        state = [v for s in fresh_opt.state.values() for k, v in s.items() if k != "step"]
        result |= {
            "resumed": resumed,
            "resumed_full": _full_params(fresh),
            "opt_state_types": sorted({type(v).__name__ for v in state}),
        }
    return result


def features(rank: int, world_size: int) -> dict:
    """Every feature job on one set of ranks, in one process each; rank 0 returns all results, the other ranks
    their evaluation logits (each rank holds its slice of the batch)."""
    results = {
        "evaluation": _timed(_evaluation),
        "ac": _timed(lambda: _plain_training(ac=True)),
        "scheduled_foreach": _timed(lambda: _scheduled(foreach=True)),
        "scheduled_for_loop": _timed(lambda: _scheduled(foreach=False)),
        "per_module_reshard": _timed(lambda: _plain_training(reshard_blocks=(True, False), reshard_root=False)),
    }
    if rank != 0:
        return {"evaluation": {"evals": results["evaluation"].get("evals")}}
    return results
