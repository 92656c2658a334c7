"""Per-rank jobs for the checkpoint safety tests: saves killed part-way, damaged files, paths holding no checkpoint.

The GPT is sharded but runs eagerly (no compilation), which keeps these jobs fast; what they test is the files."""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from models import make_model, make_optimizer
from torch.distributed.checkpoint.api import CheckpointException
from workers import _full_state, _gpt_steps, remake_process_group

import fsdp2_compile as fc
from fsdp2_compile import checkpoint
from fsdp2_compile.checkpoint import load_checkpoint, save_checkpoint
from fsdp2_compile.compiler.graph_records import compiled_graphs
from fsdp2_compile.runtime.param_state import ParamInfo
from fsdp2_compile.runtime.process_groups import attempt_token


def _gpt():
    model = make_model("gpt")
    for block in model.blocks:
        fc.shard(block)
    fc.shard(model)
    return model, make_optimizer(model)


def _state(model, opt) -> dict:
    """The full (unsharded) parameters and optimizer state, copied: `_full_state` shares the `step` tensors, which
    the optimizer increments in place."""
    return {part: {k: v.clone() for k, v in d.items()} for part, d in _full_state(model, opt).items()}


def _die(marker: str) -> None:
    """Leave `marker` (the test's proof that the armed death came), then exit: no cleanup, no collective, as if the
    process were killed."""
    open(marker, "w").close()
    os._exit(1)


def _arm(kill: str, rank: int, marker: str) -> None:
    """Make this rank die at `kill` during the next save_checkpoint, leaving `marker`."""
    if kill in ("rank1-after-writing-its-data", "rank1-during-async-write") and rank == 1:
        writer = dcp.FileSystemWriter
        write_data = writer.write_data

        def write_then_die(self, plan, planner):
            write_data(self, plan, planner).wait()  # its __1_*.distcp is on disk; rank 0 waits in DCP's gather
            _die(marker)

        writer.write_data = write_then_die
    elif kill == "rank0-before-commit" and rank == 0:  # every file written and checksummed, rank 1 waits for rank 0
        checkpoint._commit = lambda *args: _die(marker)
    elif kill == "rank0-after-commit" and rank == 0:  # the new record is in place, the old save folder not deleted
        shutil.rmtree = lambda *args, **kwargs: _die(marker)


def save_then_die(rank: int, world_size: int, path: str, kill: str, snapshot: str) -> None:
    """Commit a checkpoint after 2 steps, take a 3rd step, then die in the next save. Both states go to `snapshot`;
    the dying rank leaves `snapshot + ".died"`."""
    model, opt = _gpt()
    _gpt_steps(model, opt, rank, world_size, range(2))
    save_checkpoint(path, model, opt)
    committed = _state(model, opt)
    _gpt_steps(model, opt, rank, world_size, range(2, 3))
    states = dict(committed=committed, next=_state(model, opt))
    if rank == 0:
        torch.save(states, snapshot)
    dist.barrier()
    _arm(kill, rank, snapshot + ".died")
    if kill == "rank1-during-async-write":  # rank 1 dies in the background thread, rank 0 waits for it
        save_checkpoint(path, model, opt, async_save=True).wait()
    else:
        save_checkpoint(path, model, opt)
    dist.barrier()  # a rank whose part survived waits here for the one that died, until the harness ends it


def load_after_kill(rank: int, world_size: int, path: str) -> dict:
    """Load what is committed at `path` into a fresh model; then save over the leftovers and load that."""
    model, opt = _gpt()
    load_checkpoint(path, model, opt)
    loaded, left = _state(model, opt), sorted(os.listdir(path))
    dist.barrier()  # every rank listed `path` before the next save changes it
    _gpt_steps(model, opt, rank, world_size, range(2, 3))
    save_checkpoint(path, model, opt)
    fresh, fresh_opt = _gpt()
    load_checkpoint(path, fresh, fresh_opt)
    after = sorted(os.listdir(path))
    return dict(loaded=loaded, left=left, after=after, resaved=_state(model, opt), reloaded=_state(fresh, fresh_opt))


def _attempt(fn, *args, **kwargs) -> str:
    """ "Type: message" of what `fn(*args, **kwargs)` raised, or "no error"."""
    try:
        fn(*args, **kwargs)
        return "no error"
    except Exception as e:  # every error the checkpoint helpers raise is an ordinary Exception
        return f"{type(e).__name__}: {e}"


def saves_between_compiled_steps(rank: int, world_size: int, root: str) -> int:
    """Graphs the backend compiled after a sync and an async save of a model trained through `shard_compile`."""
    model = make_model("gpt")
    for block in model.blocks:
        fc.shard(block)
    fc.shard_compile(model)
    opt = make_optimizer(model)
    _gpt_steps(model, opt, rank, world_size, range(2))
    compiled = len(compiled_graphs())
    save_checkpoint(os.path.join(root, "sync"), model, opt)
    pending = save_checkpoint(os.path.join(root, "async"), model, opt, async_save=True)
    _gpt_steps(model, opt, rank, world_size, range(2, 4))
    pending.wait()
    return len(compiled_graphs()) - compiled


def process_saves(rank: int, world_size: int, root: str) -> dict:
    """Async saves written by DCP's background process (AsyncCheckpointerType.PROCESS) while training goes on, loaded
    back; then the default process group destroyed and made again (on the same store) and another such save: DCP's
    process of the old group has ended, a new one wrote it."""
    from torch.distributed.checkpoint import _async_process_executor as dcp_process
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from fsdp2_compile._torch_private import default_store

    how = dict(async_save=True, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    store, saved, children = default_store(), [], []
    for r in range(2):
        if r:
            remake_process_group(store, f"round{r}", rank, world_size)
        model, opt = _gpt()
        _gpt_steps(model, opt, rank, world_size, range(2))
        path = os.path.join(root, f"round{r}")
        at_call = _state(model, opt)
        pending = save_checkpoint(path, model, opt, **how)
        _gpt_steps(model, opt, rank, world_size, range(2, 4))  # the state changes while the save is written
        pending.wait()
        fresh, fresh_opt = _gpt()
        load_checkpoint(path, fresh, fresh_opt)
        saved.append((at_call, _state(model, opt), _state(fresh, fresh_opt)))
        child = dcp_process._CHECKPOINT_PROCESS._save_process
        children.append((child, os.getpriority(os.PRIO_PROCESS, child.pid)))
    return dict(
        saved=saved,
        nice=[nice for _, nice in children],
        first_ended=not children[0][0].is_alive(),
        two_processes=children[0][0].pid != children[1][0].pid,
    )


def async_saves(rank: int, world_size: int, root: str) -> dict:
    """An async save while training goes on, and a sync save, both loaded back; two async saves in a row; then async
    saves whose writes fail on rank 1, raised by wait() and by the next save; then what is committed, loaded."""
    model, opt = _gpt()
    _gpt_steps(model, opt, rank, world_size, range(2))
    sync_path, async_path = os.path.join(root, "sync"), os.path.join(root, "async")
    at_call = _state(model, opt)
    gathers, gather = [0], ParamInfo._gather
    ParamInfo._gather = lambda info, param: (gathers.__setitem__(0, gathers[0] + 1), gather(info, param))[1]
    try:  # torch's state-dict helpers read each parameter by attribute: the shard, never a gather of it
        save_checkpoint(sync_path, model, opt)
        pending = save_checkpoint(async_path, model, opt, async_save=True)
    finally:
        ParamInfo._gather = gather
    _gpt_steps(model, opt, rank, world_size, range(2, 4))  # the parameters and AdamW state change meanwhile
    pending.wait()
    later = _state(model, opt)
    loaded = {}
    for name, path in (("sync", sync_path), ("async", async_path)):
        fresh, fresh_opt = _gpt()
        load_checkpoint(path, fresh, fresh_opt)
        loaded[name] = _state(fresh, fresh_opt)
    first = save_checkpoint(async_path, model, opt, async_save=True)
    second = save_checkpoint(async_path, model, opt, async_save=True)  # waits for the first
    first_done = first.done()
    second.wait()
    listing = sorted(os.listdir(async_path))
    dist.barrier()  # every rank listed the folder before the next save changes it
    writer, write_data = dcp.FileSystemWriter, dcp.FileSystemWriter.write_data
    if rank == 1:

        def fail(self, plan, planner):
            raise OSError(28, "No space left on device")

        writer.write_data = fail
    errors = {"wait": _attempt(save_checkpoint(async_path, model, opt, async_save=True).wait)}
    save_checkpoint(async_path, model, opt, async_save=True)
    errors["next save"] = _attempt(save_checkpoint, async_path, model, opt)
    writer.write_data = write_data
    fresh, fresh_opt = _gpt()
    load_checkpoint(async_path, fresh, fresh_opt)
    save_group = checkpoint._save_group()
    return dict(
        save_group=(save_group.size(), attempt_token(save_group.group_name)),
        gathers=gathers[0],
        at_call=at_call,
        later=later,
        loaded=loaded,
        first_done=first_done,
        listing=listing,
        errors=errors,
        after_failures=_state(fresh, fresh_opt),
    )


def _flip(file: str, count: int = 16) -> None:
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) // 2)
        data = f.read(count)
        f.seek(-len(data), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))


def _failing_dcp(state: dict, **_kwargs) -> None:
    """DCP's load failing on rank 1, as every rank hears of it (DCP gathers the failures)."""
    raise CheckpointException("load", {1: OSError("storage of rank 1 unreachable")})


def _truncate(file: str) -> None:
    os.truncate(file, os.path.getsize(file) // 2)


def damaged_checkpoints(rank: int, world_size: int, root: str) -> dict:
    """Commit a checkpoint, then damage it (one way at a time, undone after) and load it; load paths that hold no
    committed checkpoint; save where no folder can be made. Returns each attempt's error, as "Type: message"."""
    model, opt = _gpt()
    _gpt_steps(model, opt, rank, world_size, range(2))
    path, later = os.path.join(root, "ckpt"), os.path.join(root, "later")
    save_checkpoint(path, model, opt)
    _gpt_steps(model, opt, rank, world_size, range(2, 3))
    save_checkpoint(later, model, opt)  # the same files one step later: the source of a mixed-in file
    save_checkpoint(os.path.join(root, "model-only"), model)
    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(root, "plain"))
    if rank == 0:
        os.mkdir(os.path.join(root, "empty"))
        os.mkdir(os.path.join(root, "uncommitted"))
        shutil.copytree(os.path.join(path, "save-000001"), os.path.join(root, "uncommitted", "save-000001"))
        open(os.path.join(root, "a-file"), "w").close()
    folder = os.path.join(path, "save-000001")
    data1 = os.path.join(folder, "__1_0.distcp")
    damages = {
        "truncated": lambda: _truncate(data1),
        "flipped": lambda: _flip(data1),
        "mixed": lambda: shutil.copy(os.path.join(later, "save-000001", "__1_0.distcp"), data1),
        "missing": lambda: os.remove(data1),
        "metadata": lambda: _flip(os.path.join(folder, ".metadata"), 1),
    }
    fresh, fresh_opt = _gpt()

    errors = {}
    for label, damage in damages.items():
        dist.barrier()
        if rank == 0:
            shutil.copy(data1, data1 + ".bak")
            shutil.copy(os.path.join(folder, ".metadata"), os.path.join(root, "metadata.bak"))
            damage()
        dist.barrier()
        errors[label] = _attempt(load_checkpoint, path, fresh, fresh_opt)
        dist.barrier()
        if rank == 0:
            os.replace(data1 + ".bak", data1)
            os.replace(os.path.join(root, "metadata.bak"), os.path.join(folder, ".metadata"))
    dist.barrier()
    errors["intact"] = _attempt(load_checkpoint, path, fresh, fresh_opt)  # undamaged again: it loads
    for label in ("empty", "nonexistent", "uncommitted", "plain"):
        errors[label] = _attempt(load_checkpoint, os.path.join(root, label), fresh, fresh_opt)
    errors["save folder"] = _attempt(load_checkpoint, folder, fresh, fresh_opt)
    model_only = os.path.join(root, "model-only")
    errors["model-only into an optimizer"] = _attempt(load_checkpoint, model_only, fresh, fresh_opt)
    real_load = dcp.load
    try:  # DCP's own failure on one rank (its storage): as DCP reports it, a CheckpointException
        dcp.load = _failing_dcp
        errors["dcp failure"] = _attempt(load_checkpoint, path, fresh, fresh_opt)
    finally:
        dcp.load = real_load
    errors["unwritable"] = _attempt(save_checkpoint, os.path.join(root, "a-file", "ckpt"), model, opt)
    scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda step: 1.0)
    errors["extra_state absent"] = _attempt(load_checkpoint, path, fresh, fresh_opt, extra_state={"lr": scheduler})
    errors["extra_state not stateful"] = _attempt(save_checkpoint, path, model, opt, extra_state={"step": 3})
    return errors
