"""The command line's own checks and conversions: argument types, the checks of the parsed arguments run before
torch is imported, and what the commands build from them (the mixed-precision policy, the mesh in words)."""

from __future__ import annotations

import argparse
import os
import tempfile

from fsdp2_compile.cli.footprint import warn_if_large
from fsdp2_compile.cli.model_loading import UsageError

__all__ = ["PROG", "check_args", "keep_gathered_arg", "mesh_words", "mp_policy", "positive_bytes"]

PROG = "fsdp2-compile"


def keep_gathered_arg(text: str) -> int | float:
    """`--keep-gathered`: a fraction of the gathered parameter bytes ("0.25") or a number of bytes ("16777216")."""
    try:
        value = float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        value = None
    if value is None or (isinstance(value, float) and not 0.0 <= value <= 1.0) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: use a fraction in [0, 1] (e.g. 0.25) or a number of bytes")
    return value


def positive_bytes(text: str) -> int:
    """`--memory-budget`: a positive number of bytes."""
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: use a positive number of bytes (e.g. 268435456)")
    return int(text)


def mp_policy(name: str | None):
    import torch

    from fsdp2_compile.config import MixedPrecisionPolicy

    if name is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def mesh_words(world_size: int, replicate: int, tp: int = 1) -> str:
    """'4 ranks', '4 ranks, mesh 2 x 2 (replicate x shard)' or '4 ranks, mesh 2 x 2 (dp x tp)'."""
    if tp > 1:
        if replicate == 1:
            return f"{world_size} ranks, mesh {world_size // tp} x {tp} (dp x tp)"
        return f"{world_size} ranks, mesh {replicate} x {world_size // (replicate * tp)} x {tp} (replicate x dp x tp)"
    if replicate == 1:
        return f"{world_size} ranks"
    return f"{world_size} ranks, mesh {replicate} x {world_size // replicate} (replicate x shard)"


def check_out_folder(path: str) -> None:
    """Create the --out folder and write a probe file there, so a bad path fails before minutes of compiling."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UsageError(
            f"--out {path!r} is not a folder this process can write to ({e.strerror or e}); "
            "pass --out with a writable folder"
        ) from e


def check_args(ns: argparse.Namespace) -> None:
    """Cheap checks of the parsed arguments, before importing torch or the model (UsageError names the argument)."""
    if ns.world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {ns.world_size}")
    if ns.replicate < 1:
        raise UsageError(f"--replicate must be >= 1, got {ns.replicate}")
    if ns.tp < 1:
        raise UsageError(f"--tp must be >= 1, got {ns.tp}")
    if ns.seq_len is not None and ns.seq_len < 1:
        raise UsageError(f"--seq-len must be >= 1, got {ns.seq_len}")
    if ns.local_batch is not None and ns.local_batch < 1:
        raise UsageError(f"--local-batch must be >= 1, got {ns.local_batch}")
    if ns.tp > 1 and ns.world_size % (ns.replicate * ns.tp):
        raise UsageError(
            f"--world-size {ns.world_size} is not a multiple of --replicate {ns.replicate} x --tp {ns.tp}: the mesh "
            f"is replicate x dp x tp; pass a --world-size that is a multiple of {ns.replicate * ns.tp}"
        )
    pp = getattr(ns, "pp", 1)
    if pp < 1:
        raise UsageError(f"--pp must be >= 1, got {pp}")
    if pp > 1 and ns.world_size % (pp * ns.replicate * ns.tp):
        raise UsageError(
            f"--world-size {ns.world_size} is not a multiple of --pp {pp} x --replicate {ns.replicate} x --tp "
            f"{ns.tp}: the mesh is pp x replicate x dp x tp; pass a --world-size that is a multiple of "
            f"{pp * ns.replicate * ns.tp}"
        )
    if pp == 1 and ns.command == "plan" and not ns.search:
        for flag, value in (("--microbatches", ns.microbatches), ("--stages-per-rank", ns.stages_per_rank)):
            if value is not None:
                raise UsageError(f"{flag} needs --pp P with P > 1 (pipeline parallelism)")
    if getattr(ns, "float8", False):
        from fsdp2_compile.planner.devices import device_for

        if ns.mp != "bf16":
            raise UsageError("--float8 needs --mp bf16: torchao's float8 training keeps the rest in bf16")
        if ns.hardware is not None and not device_for(ns.hardware).float8_flops:
            raise UsageError(
                f"--float8 on --hardware {ns.hardware}: that profile has no float8 matmul; use a profile with "
                "float8 (h100-nvlink, h100-infiniband) or leave --hardware out"
            )
    if ns.world_size % ns.replicate:
        raise UsageError(
            f"--world-size {ns.world_size} is not a multiple of --replicate {ns.replicate}: HSDP needs "
            f"--world-size = --replicate x shard size; pass a --replicate that divides {ns.world_size} or a "
            f"--world-size that is a multiple of {ns.replicate}"
        )
    if ns.hardware is not None:
        from fsdp2_compile.core.hardware import PROFILES

        if ns.hardware not in PROFILES:
            raise UsageError(f"--hardware {ns.hardware!r} is not one of: {', '.join(PROFILES)}")
    if ns.command == "dump":
        check_out_folder(ns.out)
        if os.path.basename(ns.memory_plot) != ns.memory_plot or not ns.memory_plot.endswith((".png", ".svg")):
            raise UsageError(f"--memory-plot {ns.memory_plot!r}: a file name ending in .png or .svg")
    if ns.command == "plan":
        _check_search_args(ns)
    warn_if_large(PROG, ns.world_size)


def _check_search_args(ns: argparse.Namespace) -> None:
    """--search's own flags: --global-batch and --hardware needed, the single-layout knobs refused."""
    search_only = [
        f
        for f, v in (
            ("--global-batch", ns.global_batch),
            ("--emit-config", ns.emit_config),
            ("--device-memory", ns.device_memory),
        )
        if v is not None
    ]
    if not ns.search:
        if search_only:
            raise UsageError(f"{search_only[0]} needs --search")
        return
    if ns.global_batch is None or ns.global_batch < 1:
        raise UsageError("--search needs --global-batch B (samples per step over all ranks, >= 1)")
    if ns.hardware is None:
        raise UsageError("--search needs --hardware PROFILE (the device the layouts are ranked on)")
    given = [
        f
        for f, v in (
            ("--ac", ns.ac != "none"),
            ("--no-reshard", ns.no_reshard),
            ("--float8", ns.float8),
            ("--keep-gathered", ns.keep_gathered is not None),
            ("--memory-budget", ns.memory_budget is not None),
            ("--microbatches", ns.microbatches is not None),
            ("--stages-per-rank", ns.stages_per_rank is not None),
            ("--pp-schedule", ns.pp_schedule != "1F1B"),
            ("--local-batch", ns.local_batch is not None),
        )
        if v
    ]
    if given:
        raise UsageError(f"{given[0]} with --search: the search enumerates it; leave it out")
    if ns.global_batch % (ns.world_size // (ns.pp * ns.tp)) and "tp" in ns.pinned and "pp" in ns.pinned:
        dp = ns.world_size // (ns.pp * ns.tp)
        raise UsageError(
            f"--global-batch {ns.global_batch} is not a multiple of the data-parallel size {dp} (--world-size "
            f"{ns.world_size} / (--pp {ns.pp} x --tp {ns.tp})): each dp rank takes global batch / dp samples; pass "
            f"a multiple of {dp}"
        )
