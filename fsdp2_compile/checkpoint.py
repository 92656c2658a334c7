"""Saving and loading a sharded model (and its optimizer) with torch.distributed.checkpoint, in one call each.

Plain DCP (`get_state_dict` → `dcp.save` / `dcp.load` → `set_state_dict`) works on sharded modules as it does on
FSDP2 ones; these helpers do just that, and before loading compare the checkpoint's model entries with the model's
so that a checkpoint of another architecture fails with the first mismatching name and both shapes. Checkpoints
reshard on load: any world size, 1-D or HSDP mesh, `fully_shard` or `shard_compile`.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["load_checkpoint", "save_checkpoint"]


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    model_sd, optim_sd = get_state_dict(model, [optimizer] if optimizer is not None else [])
    return {"model": model_sd, "optim": optim_sd} if optimizer is not None else {"model": model_sd}


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Save `model`'s (and `optimizer`'s) sharded state to the directory `path`. Collective: every rank calls it."""
    dcp.save(_state(model, optimizer), checkpoint_id=path)


def check_compatible(path: str, model: nn.Module) -> None:
    """Raise ValueError naming the first entry where the checkpoint at `path` and `model` differ (a name only one
    of them has, or a shape), in the model's order."""
    saved = {
        key.removeprefix("model."): tuple(meta.size)
        for key, meta in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    expected = {k: tuple(v.shape) for k, v in get_state_dict(model, [])[0].items() if isinstance(v, torch.Tensor)}
    hint = "was it saved from another architecture or model config?"
    for key, shape in expected.items():
        if key not in saved:
            raise ValueError(f"checkpoint {path} has no entry for model parameter/buffer '{key}'; {hint}")
        if saved[key] != shape:
            raise ValueError(
                f"checkpoint {path}: '{key}' has shape {saved[key]} in the checkpoint but {shape} in the model; {hint}"
            )
    extra = [k for k in saved if k not in expected]
    if extra:
        raise ValueError(f"checkpoint {path} has '{extra[0]}', which the model does not have; {hint}")


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load what `save_checkpoint` saved (at any world size or mesh) into `model` (and `optimizer`), in place.
    Collective. Raises ValueError before reading any data when the checkpoint is of another architecture."""
    check_compatible(path, model)
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model,
        [optimizer] if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )
