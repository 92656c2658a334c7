"""Saving and loading a sharded model (and its optimizer) with torch.distributed.checkpoint: atomic and checked."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful

from fsdp2_compile._torch_private import resolve_group, stop_dcp_checkpoint_process
from fsdp2_compile.core.group_caches import dropped_with_groups, forget_destroyed_groups
from fsdp2_compile.runtime.param_state import sharded_parameters
from fsdp2_compile.runtime.process_groups import serial_gloo_group
from fsdp2_compile.runtime.rank_agreement import agree_to_call

__all__ = ["AsyncSave", "CheckpointError", "load_checkpoint", "save_checkpoint", "wait_for_saves"]

RECORD = "committed.json"
_SAVE_FOLDER = re.compile(r"save-(\d+)")
_DCP_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp")  # DCP names a data file __<rank that wrote it>_<n>.distcp


# A checkpoint at `path` is a folder:
#
#     path/committed.json   the commit record: which save folder is the checkpoint, and each of its files' size and sha256
#     path/save-000007/     a plain DCP checkpoint (`.metadata`, `__<rank>_<n>.distcp`); `dcp.load` reads it as it is
#
# `save_checkpoint` has DCP write into a new save folder (numbered one past the highest there: rank 0 picks the name and
# broadcasts it), checksums what DCP wrote once every rank has finished (each rank reads a share of the files), then
# rank 0 commits: it replaces `committed.json` with `os.replace` (atomic) and deletes the other save folders. A save
# killed at any point leaves the previous record, hence the previous checkpoint, in force; the next save deletes the
# half-written folder. With `async_save=True` it returns an `AsyncSave` once the state is copied, and a background
# thread does the rest (DCP's write, checksums, commit) over a process group of its own, the write by DCP's
# background process with `AsyncCheckpointerType.PROCESS`; the next save or load waits for it. `load_checkpoint`
# reads the record, verifies every file against it (again a share per rank), compares the checkpoint's entries with
# the model's and the optimizer's (a checkpoint of another architecture or another optimizer fails naming the first
# few entries missing or unexpected, or a shape), then loads. Checkpoints reshard on
# load: any world size, 1-D or HSDP mesh, `fully_shard` or `shard_compile`.
#
# Every failure is an ordinary exception raised on every rank with the same message: FileNotFoundError when there is
# no committed checkpoint, TypeError for arguments of the wrong type, ValueError for another architecture or
# optimizer, CheckpointError otherwise (a corrupt, truncated, missing or mixed-in file, named with the rank that wrote
# it; an unwritable path; DCP's own CheckpointException, which derives from BaseException, with the first failing
# rank's cause). Assumes every rank sees the same files at `path` (a shared file system, as DCP's FileSystemWriter
# does) and one save at a time per path.
class CheckpointError(RuntimeError):
    """A checkpoint that could not be saved, or that `load_checkpoint` does not trust. Raised on every rank alike."""


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, extra_state: dict | None = None) -> dict:
    with sharded_parameters():  # DCP reads each parameter by attribute: the shard, not a gather of it
        model_sd, optim_sd = get_state_dict(model, [optimizer] if optimizer is not None else [])
    state = {"model": model_sd, "optim": optim_sd} if optimizer is not None else {"model": model_sd}
    if extra_state:
        state["extra"] = {name: obj.state_dict() for name, obj in extra_state.items()}
    return state


def _rank_and_size() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _on_rank0(fn: Callable, *args: Any, group: dist.ProcessGroup | None = None) -> Any:
    """`fn(*args)` run on rank 0; its result, or the exception it raised, on every rank (of `group`, all ranks)."""
    rank, world = _rank_and_size()
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = (fn(*args), None)
        except (CheckpointError, FileNotFoundError) as e:
            box[0] = (None, e)
        except Exception as e:  # anything else still reaches every rank, as a CheckpointError
            box[0] = (None, CheckpointError(f"{type(e).__name__}: {e}"))
    if world > 1:
        dist.broadcast_object_list(box, src=0, group=group)
    result, error = box[0]
    if error is not None:
        raise error
    return result


def _digests(folder: str, names: list[str], group: dist.ProcessGroup | None = None) -> dict[str, dict]:
    """{name: {"bytes", "sha256"} or {"error"}} of the files `names` in `folder`; each rank reads a share."""
    rank, world = _rank_and_size()
    mine = {}
    for name in names[rank::world]:
        try:
            digest, size = hashlib.sha256(), 0
            with open(os.path.join(folder, name), "rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                    size += len(chunk)
            mine[name] = {"sha256": digest.hexdigest(), "bytes": size}
        except OSError as e:
            mine[name] = {"error": f"{type(e).__name__}: {e.strerror or e}"}
    shares = [mine] * world
    if world > 1:
        dist.all_gather_object(shares, mine, group=group)
    return {name: digest for share in shares for name, digest in share.items()}


def _dcp(fn: Callable, state: dict, folder: str, what: str, group: dist.ProcessGroup | None = None) -> None:
    """`dcp.save` / `dcp.load`, with its CheckpointException (a BaseException) turned into a CheckpointError."""
    try:
        fn(state, checkpoint_id=folder, process_group=group)
    except CheckpointException as e:
        rank, failure = min(e.failures.items())
        cause = failure[0] if isinstance(failure, tuple) else failure
        raise CheckpointError(f"DCP could not {what} {folder}: on rank {rank}: {type(cause).__name__}: {cause}") from e


def _new_save_folder(path: str) -> str:
    try:
        os.makedirs(path, exist_ok=True)
        taken = [int(m.group(1)) for d in os.listdir(path) if (m := _SAVE_FOLDER.fullmatch(d))]
        folder = os.path.join(path, f"save-{max(taken, default=0) + 1:06d}")
        os.mkdir(folder)
        return folder
    except OSError as e:
        raise CheckpointError(f"cannot save a checkpoint to {path}: {e}; pass a path in a writable folder") from e


def _commit(path: str, folder: str, files: dict[str, dict]) -> None:
    """Atomically make `folder` the checkpoint at `path`, then delete every other save folder there."""
    failed = [(name, d["error"]) for name, d in files.items() if "error" in d]
    if failed:
        raise CheckpointError(f"cannot read back {os.path.join(folder, failed[0][0])} to checksum it: {failed[0][1]}")
    tmp = os.path.join(path, RECORD + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump({"folder": os.path.basename(folder), "files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, RECORD))
        fd = os.open(path, os.O_RDONLY)  # the rename itself survives a crash once the directory is synced
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise CheckpointError(f"cannot commit the checkpoint at {path}: {e}") from e
    for d in os.listdir(path):
        if _SAVE_FOLDER.fullmatch(d) and d != os.path.basename(folder):
            shutil.rmtree(os.path.join(path, d), ignore_errors=True)


class AsyncSave:
    """A `save_checkpoint(..., async_save=True)` in flight: a background thread writes the staged state, checksums it
    and commits it, over a process group of its own. `wait()` returns once it is committed, or raises (on every rank
    alike) what made it fail; the next `save_checkpoint` or `load_checkpoint` waits for it first."""

    def __init__(self, path: str, work: Callable[[], None]) -> None:
        self.path = path
        self._result: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"save_checkpoint {path}")
        _PENDING.append(self)
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            _yield_cpu_to_training()
            work()
            self._result.set_result(None)
        except BaseException as e:  # kept for wait(), which raises it in the caller's thread
            self._result.set_exception(e)

    def done(self) -> bool:
        """Whether the save has ended (committed or failed); does not block."""
        return self._result.done()

    def wait(self) -> None:
        """Block until the save is committed; raise its failure (a CheckpointError) if it failed."""
        self._thread.join()
        if self in _PENDING:
            _PENDING.remove(self)
        self._result.result()


def _yield_cpu_to_training() -> None:
    """Give the calling thread (a background save's) the lowest CPU priority, so that on a busy host it runs on
    what training leaves idle. Linux only, where a thread's nice value is its own; nothing elsewhere, or where the
    system refuses it (the save runs as it is)."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass


_PENDING: list[AsyncSave] = []
"""The async saves not yet waited for, oldest first."""

_SAVE_GROUPS: dict[str, dist.ProcessGroup] = dropped_with_groups({})
"""The default group's name -> the group of all ranks the background saves run their collectives on."""


def _save_group() -> dist.ProcessGroup | None:
    """All ranks in a group of their own, made once (a collective call): a background save's collectives on it never
    interleave with training's on the others."""
    if not dist.is_initialized():
        return None
    forget_destroyed_groups()
    world = dist.group.WORLD.group_name
    if world not in _SAVE_GROUPS:
        desc = "fsdp2_compile background checkpoint saves"
        if dist.get_backend() == "gloo":  # its gloo keys drawn afresh, as the groups `shard` makes
            _SAVE_GROUPS[world] = resolve_group(serial_gloo_group(world, list(range(dist.get_world_size())), desc))
        else:
            _SAVE_GROUPS[world] = dist.new_group(backend="gloo", group_desc=desc)
    return _SAVE_GROUPS[world]


def _staged(value: Any) -> Any:
    """A copy of the state dict `value` whose tensors (DTensors: their local shards) own their memory, so training
    may change the originals while the copy is written."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _staged(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_staged(v) for v in value)
    return copy.deepcopy(value)


class _AsStaged(AsyncStager):
    """Hands DCP the state as it is: `save_checkpoint` staged it already."""

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict) -> dict:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


_PROCESS_WORLDS: set[str] = dropped_with_groups(set())
"""The default group's name once DCP's checkpoint process was started (or stopped) under it."""


def _stop_process_of_old_groups() -> None:
    """Stop DCP's checkpoint process if an earlier default process group started it: it keeps that group's world.
    DCP starts a new one at the next PROCESS save."""
    forget_destroyed_groups()
    world = dist.group.WORLD.group_name
    if world not in _PROCESS_WORLDS:
        stop_dcp_checkpoint_process()
        _PROCESS_WORLDS.add(world)


def _save_in_process(state: dict, checkpoint_id: str, process_group: dist.ProcessGroup | None) -> None:
    """`dcp.save` run by DCP's background checkpoint process (started at the first call, in the calling thread's
    priority), not in this one: its serialisation does not hold this process's GIL."""
    dcp.async_save(
        state,
        checkpoint_id=checkpoint_id,
        process_group=process_group,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        async_stager=_AsStaged(),
    ).result()


def _write_and_commit(
    path: str, folder: str, state: dict, group: dist.ProcessGroup | None, save: Callable = dcp.save
) -> None:
    _dcp(save, state, folder, "save to", group)  # returns once every rank wrote its files
    files = _digests(folder, _on_rank0(lambda: sorted(os.listdir(folder)), group=group), group)
    _on_rank0(_commit, path, folder, files, group=group)


def wait_for_saves() -> None:
    """Block until every async save of this process is committed; raise the first failure."""
    while _PENDING:
        _PENDING[0].wait()


def save_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra_state: dict[str, Stateful] | None = None,
    async_save: bool = False,
    async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
) -> AsyncSave | None:
    """Save `model`'s (and `optimizer`'s) sharded state as the checkpoint in the folder `path`, replacing the one
    there only once the new one is complete and checksummed. `extra_state` names further objects with
    `state_dict()` / `load_state_dict()` (an LR scheduler, the step, a data loader's position), saved in the same
    commit. Collective: every rank calls it. Waits for an async save still in flight first (raising its failure).

    `async_save=True` returns an `AsyncSave` as soon as the state is copied in memory; writing, checksumming and
    committing go on in a background thread. Call its `wait()` (or save again) before `destroy_process_group`.
    `async_checkpointer_type=AsyncCheckpointerType.PROCESS` has DCP's background process serialise and write the
    state (the thread then checksums and commits): no contention for this process's GIL with training."""
    path = _check_arguments("save_checkpoint", path, model, optimizer, extra_state)
    process = _check_checkpointer_type(async_save, async_checkpointer_type)
    wait_for_saves()
    agree_to_call("save_checkpoint")  # a rank that does not call it is named, not waited for in a collective
    folder = _on_rank0(_new_save_folder, path)
    state = _state(model, optimizer, extra_state)
    if not async_save:
        _write_and_commit(path, folder, state, None)
        return None
    state, group = _staged(state), _save_group()
    if process:
        _stop_process_of_old_groups()
    save = _save_in_process if process else dcp.save
    return AsyncSave(path, lambda: _write_and_commit(path, folder, state, group, save))


def _check_checkpointer_type(async_save: bool, checkpointer_type: object) -> bool:
    """Whether the async save writes in DCP's background process; rank-local."""
    if not isinstance(checkpointer_type, AsyncCheckpointerType):
        raise TypeError(
            "save_checkpoint: async_checkpointer_type must be a "
            "torch.distributed.checkpoint.state_dict_saver.AsyncCheckpointerType (THREAD or PROCESS), got "
            f"{checkpointer_type!r}"
        )
    if checkpointer_type is not AsyncCheckpointerType.PROCESS:
        return False
    if not async_save:
        raise ValueError(
            "save_checkpoint: async_checkpointer_type=PROCESS applies to async saves: pass async_save=True too"
        )
    if not dist.is_initialized():
        raise ValueError(
            "save_checkpoint: async_checkpointer_type=PROCESS needs the default process group (DCP's process joins "
            "its ranks in one of its own): call init_process_group first, or leave the default THREAD"
        )
    return True


def _read_record(path: str) -> tuple[str, dict[str, dict]]:
    record_file = os.path.join(path, RECORD)
    try:
        with open(record_file) as f:
            record = json.load(f)
        return os.path.join(path, record["folder"]), record["files"]
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot read the commit record {record_file}: {type(e).__name__}: {e}") from e
    if not os.path.isdir(path):
        why = "the folder does not exist"
    elif _SAVE_FOLDER.fullmatch(os.path.basename(os.path.normpath(path))):
        why = f"it is a save folder of save_checkpoint; pass the folder above it, whose {RECORD} names the one to load"
    elif os.path.exists(os.path.join(path, ".metadata")):
        why = f"it holds DCP files but no {RECORD} (written by dcp.save?); if you trust them, use dcp.load"
    elif uncommitted := sorted(d for d in os.listdir(path) if _SAVE_FOLDER.fullmatch(d)):
        why = f"it holds only {', '.join(uncommitted)}, which no save_checkpoint committed (the save did not finish)"
    else:
        why = f"it has no {RECORD}"
    raise FileNotFoundError(f"no committed checkpoint at {path}: {why}; check the path, or save_checkpoint there first")


def _verify(path: str, folder: str, files: dict[str, dict]) -> None:
    """Raise a CheckpointError naming the first file of `folder` that differs from what was committed."""
    found = _digests(folder, sorted(files))
    for name, saved in sorted(files.items()):
        now = found[name]
        if "error" in now:
            problem = f"cannot be read ({now['error']})"
        elif now["bytes"] != saved["bytes"]:
            problem = f"has {now['bytes']} bytes but had {saved['bytes']} when saved (truncated or replaced)"
        elif now["sha256"] != saved["sha256"]:
            problem = f"fails its checksum: sha256 {now['sha256'][:16]}… but {saved['sha256'][:16]}… when saved"
        else:
            continue
        writer = f" (written by rank {m.group(1)})" if (m := _DCP_DATA_FILE.fullmatch(name)) else ""
        raise CheckpointError(
            f"checkpoint {path} is damaged: {os.path.join(folder, name)}{writer} {problem}; it changed since the"
            " save committed, so it is not loaded: restore the file or load another checkpoint"
        )


def _flat_keys(value: Any, prefix: str) -> list[str]:
    """The keys DCP stores a nested state dict under (`model.head.weight`, `optim.param_groups.0.lr`)."""
    if isinstance(value, dict):
        return [k for key, v in value.items() for k in _flat_keys(v, f"{prefix}.{key}")]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [k for i, v in enumerate(value) for k in _flat_keys(v, f"{prefix}.{i}")]
    return [prefix]


def _first(keys: list[str], strip: str) -> str:
    names = ", ".join(f"'{k.removeprefix(strip)}'" for k in keys[:3])
    return names + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def check_compatible(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra_state: dict[str, Stateful] | None = None,
) -> None:
    """Raise ValueError naming the entries where the DCP checkpoint folder `path` and `model` (and `optimizer`)
    differ: the first few the checkpoint lacks, then those only it has, then shapes, in the model's order; then the
    optimizer's entries it lacks (another optimizer, or none saved); then the `extra_state` names it lacks."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {
        key.removeprefix("model."): tuple(meta.size)
        for key, meta in metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    with sharded_parameters():
        model_sd = get_state_dict(model, [])[0]
    expected = {k: tuple(v.shape) for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    hint = "was it saved from another architecture or model config? Load it into the model it was saved from"
    missing = [k for k in expected if k not in saved]
    if missing:
        extra = [k for k in saved if k not in expected]
        also = f"; it has {_first(extra, '')}, which the model does not" if extra else ""
        raise ValueError(
            f"checkpoint {path} has no entry for model parameter/buffer {_first(missing, '')}{also}; {hint}"
        )
    extra = [k for k in saved if k not in expected]
    if extra:
        raise ValueError(f"checkpoint {path} has {_first(extra, '')}, which the model does not have; {hint}")
    for key, shape in expected.items():
        if saved[key] != shape:
            raise ValueError(
                f"checkpoint {path}: '{key}' has shape {saved[key]} in the checkpoint but {shape} in the model; {hint}"
            )
    absent = [name for name in extra_state or {} if not any(k.startswith(f"extra.{name}.") for k in metadata)]
    if absent:
        raise ValueError(
            f"checkpoint {path} holds no extra_state {_first(absent, '')} (saved without it): load it without that "
            "name and start that object afresh"
        )
    if optimizer is None:
        return
    if not any(key.startswith("optim.") for key in metadata):
        raise ValueError(
            f"checkpoint {path} holds no optimizer state (saved without an optimizer): load it with optimizer=None "
            "and start the optimizer afresh"
        )
    lacking = [k for k in _flat_keys(_state(model, optimizer)["optim"], "optim") if k not in metadata]
    if lacking:
        raise ValueError(
            f"checkpoint {path} has no optimizer entries {_first(lacking, 'optim.')} that "
            f"{type(optimizer).__name__} has: was it saved with another optimizer or other optimizer settings? Load "
            "it with the optimizer it was saved with, or with optimizer=None to start the optimizer afresh"
        )


def _check_arguments(what: str, path: object, model: object, optimizer: object, extra_state: object) -> str:
    """`path` as a str, after refusing arguments of the wrong type (swapped ones named as such); rank-local."""
    order = f"{what}(path, model, optimizer=None)"
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what}: path must be a folder path (str), got {type(path).__name__}; the order is {order}")
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{what}: model must be an nn.Module, got {type(model).__name__}; the order is {order}"
            + (" (pass the module itself, not its state_dict())" if isinstance(model, dict) else "")
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{what}: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}; the order is "
            f"{order}"
        )
    if extra_state is not None and not isinstance(extra_state, dict):
        raise TypeError(
            f"{what}: extra_state must be a dict of name -> object with state_dict(), got {type(extra_state).__name__}"
        )
    for name, obj in (extra_state or {}).items():
        if not isinstance(name, str) or not isinstance(obj, Stateful):
            raise TypeError(
                f"{what}: extra_state[{name!r}] is a {type(obj).__name__}, which has no state_dict() and "
                "load_state_dict(); pass objects that have both (an LR scheduler, or a small class holding the step)"
            )
    return os.fspath(path)


def load_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra_state: dict[str, Stateful] | None = None,
) -> None:
    """Load the checkpoint `save_checkpoint` committed at `path` (saved at any world size or mesh) into `model` (and
    `optimizer`, and each object of `extra_state` by its `load_state_dict`), in place, after checking every file
    against the commit record and the model's entries against the checkpoint's. Collective."""
    path = _check_arguments("load_checkpoint", path, model, optimizer, extra_state)
    wait_for_saves()
    agree_to_call("load_checkpoint")
    folder, files = _on_rank0(_read_record, path)
    _verify(path, folder, files)
    check_compatible(folder, model, optimizer, extra_state)
    state = _state(model, optimizer, extra_state)
    _dcp(dcp.load, state, folder, "load from")
    for name, obj in (extra_state or {}).items():
        obj.load_state_dict(state["extra"][name])
    with sharded_parameters():
        set_state_dict(
            model,
            [optimizer] if optimizer is not None else [],
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}),
        )
