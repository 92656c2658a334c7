"""What the warm-restart tests run on each rank: a model trained with `CompileConfig.cache_dir`, per variant."""

from __future__ import annotations

import logging

from models import batch, local_slice, loss_fn, make_model, make_optimizer

import fsdp2_compile as fc
from fsdp2_compile.compiler.warm_start import cache_events


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def train_cached(
    rank: int,
    world_size: int,
    cache_dir: str | None,
    variants: list[dict],
    name: str = "mlp",
    steps: int = 2,
    flip_sync: bool = False,
    accumulate: bool = False,
) -> list[dict]:
    """For each variant (CompileConfig fields, `cache_dir` by default) the test model `name` (`models.py`; a GPT's blocks sharded first)
    trained `steps` steps; returns per variant the losses, the parameters' local shards, the cache events of its
    first call and the warnings logged; with `flip_sync`, also the error of a backward run after gradient sync
    was turned off following its forward (`flip_error`, if it raised), whether it reduced into each parameter's
    `.grad` (`flip_reduced`) and the cache events after it. `accumulate`: each step's batch in two micro-batches,
    gradient sync off for the first."""
    out = []
    for variant in variants:
        model = make_model(name)
        for block in getattr(model, "blocks", []):
            fc.shard(block)
        fc.shard_compile(model, compile_config=fc.CompileConfig(**{"cache_dir": cache_dir} | variant))
        opt = make_optimizer(model)
        warnings = _Warnings()
        logging.getLogger("fsdp2_compile").addHandler(warnings)
        before = len(cache_events())
        losses = []
        try:
            for step in range(steps):
                x, y = (local_slice(t, rank, world_size) for t in batch(name, step))
                for micro in (slice(0, None, 2), slice(1, None, 2)) if accumulate else (slice(None),):
                    model.set_requires_gradient_sync(micro.start != 0)
                    loss = loss_fn(name, model(x[micro]), y[micro])
                    loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        finally:
            logging.getLogger("fsdp2_compile").removeHandler(warnings)
        shards = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
        events = cache_events()[before:]
        out.append(dict(losses=losses, shards=shards, events=events, warnings=warnings.messages))
        if flip_sync:  # gradient sync turned off between a forward and its backward: a loaded backward refuses
            x, y = batch(name, 0)
            loss = loss_fn(name, model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
            model.set_requires_gradient_sync(False)
            try:
                loss.backward()
            except RuntimeError as e:
                out[-1]["flip_error"] = str(e)
            # unsynced: kept unsharded, the sharded gradients zero
            out[-1]["flip_reduced"] = [p.grad is not None and bool(p.grad.to_local().any()) for p in model.parameters()]
            model.set_requires_gradient_sync(True)
            out[-1]["flip_events"] = [what for what, _ in cache_events()[before:]]
    return out


def first_call(rank: int, world_size: int, cache_dirs: list[str | None], hardware: str | None = None) -> dict:
    """One step of a `shard_compile`d MLP, rank r with `cache_dirs[r]` and every rank with `hardware`: the error
    its first call raised (or None), the seconds it took and whether the link of its process group was measured."""
    import time

    from fsdp2_compile.runtime.link_profile import measured_profile
    from fsdp2_compile.runtime.param_state import infos_of

    model = fc.shard_compile(
        make_model("mlp"), compile_config=fc.CompileConfig(cache_dir=cache_dirs[rank], hardware=hardware)
    )
    group_name = next(info.group_name for m in model.modules() for info in infos_of(m).values())
    start, error = time.monotonic(), None
    try:
        x, y = batch("mlp", 0)
        loss_fn("mlp", model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    except RuntimeError as e:
        error = str(e)
    return dict(error=error, seconds=time.monotonic() - start, measured=measured_profile(group_name) is not None)
