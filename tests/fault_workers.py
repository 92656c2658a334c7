"""Per-rank jobs for the fault tests (tests/test_faults.py) and their launcher: ranks start as in `harness.run_ranks`
(`harness.start_rank`), but the process group gets a short timeout and each rank reports what ended it (result,
error or exit code) and when.

Each job returns {case: outcome}, where an outcome is {"error": "<type>: <message>" or None, "seconds": time from
the case's start (a barrier) to its end}; `run_faults` adds "exitcode" per rank.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from harness import free_port, rank_setup, start_rank
from torch import nn

import fsdp2_compile as fc

PG_TIMEOUT_S = 20.0
"""The process groups' timeout in these tests: the schedule check waits at most 15 s of it."""


def _entry(rank: int, world_size: int, port: int, out: str, job: Callable, pg_timeout_s: float, env: dict) -> None:
    rank_setup(env, port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))
    try:
        result = job(rank, world_size)
    except Exception as e:  # noqa: BLE001 - a job's own error (outside its cases) is what the test reports
        result = {"job": {"error": f"{type(e).__name__}: {e}", "seconds": None, "traceback": traceback.format_exc()}}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def run_faults(job: Callable, world_size: int, pg_timeout_s: float = PG_TIMEOUT_S, limit_s: float = 150) -> list[dict]:
    """Run `job(rank, world_size)` on `world_size` gloo ranks whose process group times out after
    `pg_timeout_s`; kill whatever still runs after `limit_s`. Per rank: the job's {case: outcome} dict (empty when
    the rank died) and its "exitcode" (None when it was killed at the limit)."""
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        job_args = (world_size, port, out, job, pg_timeout_s, dict(os.environ))
        procs = [start_rank(r, _entry, (r, *job_args)) for r in range(world_size)]
        deadline = time.monotonic() + limit_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        results = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
            path = os.path.join(out, f"rank{r}.json")
            result = json.load(open(path)) if os.path.exists(path) else {}
            results.append(result | {"exitcode": p.exitcode if p.exitcode is not None and p.exitcode >= 0 else None})
        return results


class Net(nn.Module):
    """A small MLP: Linear layers of the given widths with ReLUs between them."""

    def __init__(self, widths: tuple[int, ...] = (8, 16, 16, 1)):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(torch.relu(x))
        return x


class Branchy(nn.Module):
    """A data-dependent branch: `b` when the first layer's output sums to more than zero, else `c`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = self.b(h) if h.sum() > 0 else self.c(h)
        return self.d(torch.relu(h))


def _compiled(model: nn.Module, mesh=None, check_same_init: bool = True, **config) -> nn.Module:
    for layer in model.children():
        if isinstance(layer, nn.ModuleList):
            for sub in layer:
                fc.shard(sub, mesh, check_same_init=check_same_init)
        else:
            fc.shard(layer, mesh, check_same_init=check_same_init)
    return fc.shard_compile(model, mesh, check_same_init=check_same_init, compile_config=fc.CompileConfig(**config))


def _steps(model: nn.Module, rank: int, steps: int = 2, x: torch.Tensor | None = None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        inputs = torch.randn(4, 8, generator=g) if x is None else x
        loss = model(inputs).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _case(fn: Callable[[], object]) -> dict:
    """Run one case after a barrier: its error (None if it passed), the error's notes and how long it took to end."""
    dist.barrier()
    start = time.monotonic()
    try:
        fn()
        error = None
    except Exception as e:  # noqa: BLE001 - the message is what the tests check
        error = f"{type(e).__name__}: {e}"
        notes = getattr(e, "__notes__", [])
    return {"error": error, "seconds": round(time.monotonic() - start, 1)} | ({"notes": notes} if error else {})


def _raise_in_compile(rank: int) -> None:
    """Rank 1's pass pipeline raises (an extra pass appended on rank 1 only)."""
    from fsdp2_compile.compiler import pass_list

    def broken_pass(gm, ctx):
        raise ValueError(f"injected failure in a pass on rank {rank}\nsecond line, not published")

    if rank == 1:
        pass_list.PASSES.append(broken_pass)
    try:
        _steps(_compiled(Net()), rank)
    finally:
        if rank == 1:
            pass_list.PASSES.remove(broken_pass)


def _compile_after_reset(rank: int) -> None:
    """Rank 1's pass pipeline raises at the first compile of a model; then Dynamo's caches are reset and the same
    model trains (the failure fixed), rank 1 coming back to it 2 s after rank 0 (so rank 0's new exchange finds
    what rank 1 published for the failed one, if it reads the same keys)."""
    from fsdp2_compile.compiler import pass_list

    def broken_pass(gm, ctx):
        raise ValueError("injected failure")

    model = _compiled(Net())
    if rank == 1:
        pass_list.PASSES.append(broken_pass)
    try:
        _steps(model, rank)
    except Exception:  # noqa: BLE001 - both ranks raise (rank 1 its own error, rank 0 naming it)
        pass
    finally:
        if rank == 1:
            pass_list.PASSES.remove(broken_pass)
    torch._dynamo.reset()
    if rank == 1:
        time.sleep(2)
    _steps(model, rank)


def _late(rank: int) -> None:
    """Rank 1 starts its first step 8 s late (slow data loading): well within the process group's timeout."""
    model = _compiled(Net())
    if rank == 1:
        time.sleep(8)
    _steps(model, rank)


def _raise_before_compile(rank: int) -> None:
    """Rank 1 raises in its own code after sharding, before its first forward (so before the first compile)."""
    model = _compiled(Net())
    if rank == 1:
        raise ValueError("data loader failed on rank 1")
    _steps(model, rank)


def same_process_group_faults(rank: int, world_size: int) -> dict:
    """On 2 ranks, one case after the other (the process group stays usable after each): a pass raising on rank 1,
    a new model compiled after that failure and `torch._dynamo.reset()` (which numbers frames from 0 again),
    different widths, a data-dependent branch, different configs, a late rank, and last (it leaves rank 0 with a
    frame rank 1 never compiled) rank 1 raising before its first compile."""
    branch_x = torch.full((4, 8), 1.0 if rank == 0 else -1.0)
    outcomes = {
        "raise_in_compile": _case(lambda: _raise_in_compile(rank)),
        "compile_after_reset": _case(lambda: _compile_after_reset(rank)),
        # past shard's own check of the initial weights (which names the first parameter of other sizes)
        "different_widths": _case(
            lambda: _steps(_compiled(Net((8, 16, 16 if rank == 0 else 24, 1)), check_same_init=False), rank)
        ),
        "data_dependent_branch": _case(lambda: _steps(_compiled(Branchy()), rank, x=branch_x)),
        "prefetch_depth": _case(lambda: _steps(_compiled(Net(), prefetch_depth=2 if rank == 0 else 1), rank)),
        "check_off_on_rank_1": _case(lambda: _steps(_compiled(Net(), check_rank_consistency=rank == 0), rank)),
        "late_rank": _case(lambda: _late(rank)),
    }
    dist.barrier()
    outcomes["keys_left"] = _exchange_keys_left(world_size)
    outcomes["raise_before_compile"] = _case(lambda: _raise_before_compile(rank))
    return outcomes


def _exchange_keys_left(world_size: int) -> list[str]:
    """The store keys left by this rank's rank-consistency exchanges (every one it made so far)."""
    from fsdp2_compile._torch_private import default_store
    from fsdp2_compile.runtime import rank_agreement

    names = ["d", "n", "c", "v", "f", "done"] + [f"r/{r}" for r in range(world_size)]
    keys = [
        f"{key}/{i}/{name}"
        for key, agreed in rank_agreement._AGREED.items()
        for i in range(len(agreed) + 1)
        for name in names
    ]
    return [k for k in keys if default_store().check([k])]


def killed_mid_run(rank: int, world_size: int) -> dict:
    """Rank 1's process exits (os._exit) after its first step; rank 0 goes on to its second."""
    model = _compiled(Net())

    def run() -> None:
        _steps(model, rank, steps=1)
        if rank == 1:
            os._exit(3)
        _steps(model, rank, steps=1)

    return {"killed_mid_run": _case(run)}


def store_host_raises_before_compile(rank: int, world_size: int) -> dict:
    """Rank 0, whose process hosts the store, raises before its first compile and exits."""

    def run() -> None:
        model = _compiled(Net())
        if rank == 0:
            raise ValueError("data loader failed on rank 0")
        _steps(model, rank)

    return {"store_host_raises_before_compile": _case(run)}


def sub_meshes(rank: int, world_size: int) -> dict:
    """On 4 ranks: a pipeline-parallel layout, where ranks 0, 1 shard and train model A over a mesh of [0, 1] and
    ranks 2, 3 a different model B over [2, 3] (the stages never talk to each other); then HSDP on a (replicate=2,
    shard=2) mesh, where each rank's graphs use two groups (its shard pair and its replica pair)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]  # every rank creates every group
    widths = (8, 16, 16, 1) if rank < 2 else (8, 32, 24, 12, 1)
    stage_losses: list[float] = []
    stages = _case(lambda: stage_losses.extend(_steps(_compiled(Net(widths), mesh), rank, steps=3)))
    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp_losses: list[float] = []
    hsdp = _case(lambda: hsdp_losses.extend(_steps(_compiled(Net(), hsdp_mesh), rank, steps=3)))
    return {
        "pipeline_stages": stages | {"losses": stage_losses, "mesh": mesh.mesh.tolist()},
        "hsdp": hsdp | {"losses": hsdp_losses},
    }


def shard_faults(rank: int, world_size: int) -> dict:
    """On 2 ranks: rank 1 skips the first of two `shard` calls (it shards the root while rank 0 shards a layer), then
    (last: it leaves rank 0 one exchange ahead) rank 1 skips the root's `shard` call."""

    def skip_first() -> None:
        model = Net()
        if rank == 0:
            fc.shard(model.layers[0])
        fc.shard(model)

    def skip_last() -> None:
        model = Net()
        fc.shard(model.layers[0])
        if rank == 0:
            fc.shard(model)

    return {"shard_skipped_first": _case(skip_first), "shard_on_rank_0_only": _case(skip_last)}


def checkpoint_faults(rank: int, world_size: int) -> dict:
    """On 2 ranks: rank 0 saves while rank 1 loads the same folder, then (last: it leaves rank 0 one exchange
    ahead) rank 0 saves while rank 1 does not call `save_checkpoint` at all."""
    from fsdp2_compile.checkpoint import load_checkpoint, save_checkpoint

    path = os.path.join(tempfile.gettempdir(), f"fsdp2-checkpoint-faults-{os.environ['MASTER_PORT']}")
    torch.manual_seed(0)
    model = fc.shard(nn.Linear(8, 8))
    dist.barrier()
    save_checkpoint(path, model)  # a checkpoint to load
    call = load_checkpoint if rank == 1 else save_checkpoint
    outcomes = {
        "save_against_load": _case(lambda: call(path, model)),
        "save_on_rank_0_only": _case(lambda: save_checkpoint(path, model) if rank == 0 else None),
    }
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return outcomes


def _steps_skipping(model: nn.Module, rank: int, skip: Callable[[int, int], str]) -> None:
    """Three steps of `_steps`, where `skip(rank, step)` says what this rank changes: "step" (skips all of it),
    "backward" (skips it, as after a loss found not finite), "extra forward" (runs one under no_grad first, as an
    evaluation would) or "" (nothing)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        left_out = skip(rank, step)
        if left_out == "step":
            continue
        if left_out == "extra forward":
            with torch.no_grad():
                model(torch.randn(4, 8))
        loss = model(torch.randn(4, 8)).square().mean()
        if left_out != "backward":
            loss.backward()
        opt.step()
        opt.zero_grad()


def skipped_steps(rank: int, world_size: int) -> dict:
    """On 2 ranks, one case after the other: rank 0 skips the backward of its second step (its third forward then
    meets rank 1's second backward); rank 1 runs an extra no-grad forward before its third step (both ranks ran
    one before their second: the no-grad graph is compiled on both)."""

    def extra_forward(r: int, s: int) -> str:
        return "extra forward" if s == 1 or (r, s) == (1, 2) else ""

    return {
        "skipped_backward": _case(
            lambda: _steps_skipping(_compiled(Net()), rank, lambda r, s: "backward" if (r, s) == (0, 1) else "")
        ),
        "extra_forward": _case(lambda: _steps_skipping(_compiled(Net()), rank, extra_forward)),
    }


def skipped_backward_saved(rank: int, world_size: int) -> dict:
    """`skipped_steps`' skipped backward on a model whose compile is saved (`CompileConfig.compile_cache`, in the
    directory $TORCHINDUCTOR_CACHE_DIR names); a second run of the job loads it. Also its cache events."""
    from fsdp2_compile.compiler.compile_cache import cache_events

    def skip(r: int, s: int) -> str:
        return "backward" if (r, s) == (0, 1) else ""

    case = _case(lambda: _steps_skipping(_compiled(Net(), compile_cache=True), rank, skip))
    return {"skipped_backward": case | {"cache": cache_events()}}


def elsewhere(rank: int, world_size: int) -> dict:
    """Rank 1 skips its last step and sleeps past the process group's timeout (in its own code, not in a
    collective): rank 0 waits in its third step's first collective."""

    def sleep_past_timeout(r: int, s: int) -> str:
        if (r, s) != (1, 2):
            return ""
        time.sleep(PG_TIMEOUT_S + 3)
        return "step"

    import logging

    logged: list[tuple[float, str]] = []
    start = time.monotonic()

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                logged.append((round(time.monotonic() - start, 1), record.getMessage()))

    logging.getLogger("fsdp2_compile").addHandler(Keep())
    outcome = _case(lambda: _steps_skipping(_compiled(Net()), rank, sleep_past_timeout))
    ended = round(time.monotonic() - start, 1)
    return {"elsewhere": outcome | {"logged": logged, "ended": ended}}


def skipped_step_then_exit(rank: int, world_size: int) -> dict:
    """Rank 1 skips its second step, finishes its loop and its process exits; rank 0 runs a third step alone."""
    return {
        "skipped_step": _case(
            lambda: _steps_skipping(_compiled(Net()), rank, lambda r, s: "step" if (r, s) == (1, 1) else "")
        )
    }


def sync_off_on_one_rank(rank: int, world_size: int) -> dict:
    """After a first step, rank 0 turns gradient sync off (as for accumulation) and rank 1 does not."""

    model = _compiled(Net())
    _steps(model, rank, steps=1)

    def run() -> None:
        model.set_requires_gradient_sync(rank != 0)
        _steps(model, rank, steps=1)

    return {"sync_off_on_one_rank": _case(run)}


LATE_PG_TIMEOUT_S = 8.0
"""The process groups' timeout of `late_peer_then_stall`: short, so a peer late for 0.7 of it costs little."""


def late_peer_then_stall(rank: int, world_size: int) -> dict:
    """Three steps of a model, then three of another where rank 0 sleeps 0.7 of the process group's timeout in its
    own code before the second (an evaluation, a checkpoint: rank 1 waits in the graph past half the timeout); then
    rank 1 leaves that loop (its process exits) while rank 0 runs a fourth step. The records the `fsdp2_compile`
    logger logged at warning or above on each rank, by level."""
    import logging

    from fsdp2_compile.compiler import step_watch

    logged: list[tuple[str, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                logged.append((record.levelname, record.getMessage()))

    logging.getLogger("fsdp2_compile").addHandler(Keep())
    plain: list[float] = []
    late: list[float] = []
    model = _compiled(Net())

    def late_steps() -> None:
        g = torch.Generator().manual_seed(rank)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            if (rank, step) == (0, 1):
                time.sleep(0.7 * LATE_PG_TIMEOUT_S)
            loss = model(torch.randn(4, 8, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            late.append(loss.item())
        with step_watch._WATCH.lock:  # the watching thread is done with the late step (and logged what it would)
            time.sleep(2 * step_watch._TICK_S)

    def stall() -> None:
        if rank == 0:
            model(torch.randn(4, 8)).square().mean().backward()

    outcomes = {
        "plain": _case(lambda: plain.extend(_steps(_compiled(Net()), rank, steps=3))),
        "late_peer": _case(late_steps),
    }
    outcomes["late_peer"] |= {"losses": late, "plain_losses": plain, "logged": list(logged)}
    outcomes["stall"] = _case(stall)
    return outcomes
