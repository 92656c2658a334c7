"""Run a function on N gloo ranks (processes of their own) and collect what each rank returns.

Each rank is forked from a server process of its own rank index that imported torch, fsdp2_compile and the tests'
worker modules once (`multiprocessing`'s forkserver with a preload list, one server per rank index): a rank is a
fresh process that never ran a job, as with `spawn`, without paying ~5 s of imports per rank per test. One server
per rank index keeps what separate interpreters differ in: each has its own str hash seed (set iteration order), as
the ranks of torchrun do, so code whose order depends on it still fails the rank-consistency checks here. A rank
runs with the caller's environment at the call.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pkgutil
import random
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing import forkserver
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessContext, _wrap

import fsdp2_compile

PRELOAD = [
    "torch",
    "torch.distributed",
    *(
        m.name
        for m in pkgutil.walk_packages(fsdp2_compile.__path__, "fsdp2_compile.")
        if not m.name.endswith("__main__")
    ),
    "workers",
    "checkpoint_workers",
    "module_api_workers",
    "feature_workers",
    "real_model_workers",
    "tp_workers",
    "tp_plan_workers",
    "tp_checkpoint_workers",
    "fault_workers",
    "pipeline_workers",
    "mistake_workers",
    "float8_workers",
    "moe_workers",
    "search_workers",
    "warm_workers",
    "group_of_one_workers",
]
"""What each rank's server imports before forking ranks: every module of fsdp2_compile (so a rank never mixes
what the server imported with files edited since) and the worker modules. One that fails to import there is
skipped; a rank that needs it imports it itself."""

_SERVERS: dict[int, forkserver.ForkServer] = {}


def free_port() -> int:
    """A TCP port free on this machine now (for a job's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _env(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def _server(rank: int) -> forkserver.ForkServer:
    """Rank index `rank`'s fork server, started on first use with its own hash seed (unless PYTHONHASHSEED is set)."""
    if rank not in _SERVERS:
        server = forkserver.ForkServer()
        server.set_forkserver_preload(PRELOAD)
        seed = os.environ.get("PYTHONHASHSEED") or str(random.randrange(1, 2**32))
        path = os.pathsep.join(p for p in (os.path.dirname(__file__), os.environ.get("PYTHONPATH")) if p)
        with _env(PYTHONHASHSEED=seed, PYTHONPATH=path):  # Python 3.11's forkserver ignores the sys.path it is given
            server.ensure_running()
        _SERVERS[rank] = server
    return _SERVERS[rank]


def start_rank(rank: int, target: Callable, args: tuple) -> mp.Process:
    """Start `target(*args)` in a process forked by rank index `rank`'s server."""
    process = mp.get_context("forkserver").Process(target=target, args=args)
    connect = forkserver.connect_to_new_process  # what Process.start asks for a child; pointed at this rank's server
    forkserver.connect_to_new_process = _server(rank).connect_to_new_process
    try:
        process.start()
    finally:
        forkserver.connect_to_new_process = connect
    return process


def rank_setup(env: dict, port: int) -> None:
    """What every rank does first: print its Python stack on an abort or segfault, take the caller's environment,
    compute on one thread (each rank is one core's worth), and end once the caller is gone (a forked rank's parent is its server, which outlives a killed test run; the
    rank would wait on its peers until the process group timed out)."""
    faulthandler.enable()
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    caller = mp.parent_process()  # the process that started this one: its sentinel ends when it does
    threading.Thread(target=lambda: (caller.join(), os._exit(1)), daemon=True, name="exit-with-caller").start()


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple, env: dict) -> None:
    rank_setup(env, port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 600) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the per-rank results.

    `fn` must be importable (defined at module level). A rank that raises fails the call with its traceback
    (torch's `ProcessRaisedException`), one that dies with its exit code or signal (`ProcessExitedException`); the
    other ranks are ended. A run past `timeout` seconds is killed and fails, so nothing hangs.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        job = (world_size, free_port(), out_dir, fn, args, dict(os.environ))
        errors = [os.path.join(out_dir, f"rank{r}.error") for r in range(world_size)]
        ctx = ProcessContext([start_rank(r, _wrap, (_entry, r, job, errors[r])) for r in range(world_size)], errors)
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks ran past {timeout} s")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
