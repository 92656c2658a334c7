"""Saving and loading a sharded model (and its optimizer) with torch.distributed.checkpoint: atomic and checked.

A checkpoint at `path` is a folder:

    path/committed.json   the commit record: which save folder is the checkpoint, and each of its files' size and sha256
    path/save-000007/     a plain DCP checkpoint (`.metadata`, `__<rank>_<n>.distcp`); `dcp.load` reads it as it is

`save_checkpoint` has DCP write into a new save folder (numbered one past the highest there: rank 0 picks the name and
broadcasts it), checksums what DCP wrote once every rank has finished (each rank reads a share of the files), then
rank 0 commits: it replaces `committed.json` with `os.replace` (atomic) and deletes the other save folders. A save
killed at any point leaves the previous record, hence the previous checkpoint, in force; the next save deletes the
half-written folder. `load_checkpoint` reads the record, verifies every file against it (again a share per rank),
compares the checkpoint's entries with the model's and the optimizer's (a checkpoint of another architecture or another
optimizer fails naming the first few entries missing or unexpected, or a shape), then loads. Checkpoints reshard on load: any world size, 1-D or HSDP mesh,
`fully_shard` or `shard_compile`.

Every failure is an ordinary exception raised on every rank with the same message: FileNotFoundError when there is
no committed checkpoint, TypeError for arguments of the wrong type, ValueError for another architecture or
optimizer, CheckpointError otherwise (a corrupt, truncated, missing or mixed-in file, named with the rank that wrote
it; an unwritable path; DCP's own CheckpointException, which derives from BaseException, with the first failing rank's
cause). Assumes every rank sees the same files at `path`
(a shared file system, as DCP's FileSystemWriter does) and one save at a time per path.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]

RECORD = "committed.json"
_SAVE_FOLDER = re.compile(r"save-(\d+)")
_DCP_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp")  # DCP names a data file __<rank that wrote it>_<n>.distcp


class CheckpointError(RuntimeError):
    """A checkpoint that could not be saved, or that `load_checkpoint` does not trust. Raised on every rank alike."""


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    model_sd, optim_sd = get_state_dict(model, [optimizer] if optimizer is not None else [])
    return {"model": model_sd, "optim": optim_sd} if optimizer is not None else {"model": model_sd}


def _rank_and_size() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _on_rank0(fn: Callable, *args: Any) -> Any:
    """`fn(*args)` run on rank 0; its result, or the exception it raised, on every rank."""
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
        dist.broadcast_object_list(box, src=0)
    result, error = box[0]
    if error is not None:
        raise error
    return result


def _digests(folder: str, names: list[str]) -> dict[str, dict]:
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
        dist.all_gather_object(shares, mine)
    return {name: digest for share in shares for name, digest in share.items()}


def _dcp(fn: Callable, state: dict, folder: str, what: str) -> None:
    """`dcp.save` / `dcp.load`, with its CheckpointException (a BaseException) turned into a CheckpointError."""
    try:
        fn(state, checkpoint_id=folder)
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


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Save `model`'s (and `optimizer`'s) sharded state as the checkpoint in the folder `path`, replacing the one
    there only once the new one is complete and checksummed. Collective: every rank calls it."""
    path = _check_arguments("save_checkpoint", path, model, optimizer)
    folder = _on_rank0(_new_save_folder, path)
    _dcp(dcp.save, _state(model, optimizer), folder, "save to")  # returns once every rank's files are written
    files = _digests(folder, _on_rank0(lambda: sorted(os.listdir(folder))))
    _on_rank0(_commit, path, folder, files)


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


def check_compatible(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Raise ValueError naming the entries where the DCP checkpoint folder `path` and `model` (and `optimizer`)
    differ: the first few the checkpoint lacks, then those only it has, then shapes, in the model's order; then the
    optimizer's entries it lacks (another optimizer, or none saved)."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {
        key.removeprefix("model."): tuple(meta.size)
        for key, meta in metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    expected = {k: tuple(v.shape) for k, v in get_state_dict(model, [])[0].items() if isinstance(v, torch.Tensor)}
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


def _check_arguments(what: str, path: object, model: object, optimizer: object) -> str:
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
    return os.fspath(path)


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load the checkpoint `save_checkpoint` committed at `path` (saved at any world size or mesh) into `model` (and
    `optimizer`), in place, after checking every file against the commit record and the model's entries against the
    checkpoint's. Collective."""
    path = _check_arguments("load_checkpoint", path, model, optimizer)
    folder, files = _on_rank0(_read_record, path)
    _verify(path, folder, files)
    check_compatible(folder, model, optimizer)
    state = _state(model, optimizer)
    _dcp(dcp.load, state, folder, "load from")
    set_state_dict(
        model,
        [optimizer] if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )
