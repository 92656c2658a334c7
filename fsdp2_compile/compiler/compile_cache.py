"""Saved compiles (`CompileConfig.compile_cache`): Dynamo traces and guards every call as it does without them;
what the backend makes of a captured graph — AOTAutograd's forward and backward after the pass pipeline, compiled
by aot_eager or Inductor — is kept in torch's own AOTAutograd cache, and a later compile of the same key, in this
process or a relaunch, loads it instead of compiling.

The key is torch's AOTAutograd cache key (the captured graph's code and constants, the inputs' metadata, grad
mode, autocast, torch's settings and source; a graph torch cannot key is compiled as usual, nothing saved) joined
with `extra_key`: what the backend reads beyond the graph and its inputs. torch's lookup checks a saved graph's
guards on symbolic sizes as it does for its own compiles. A rank that loads exchanges the saved graphs' schedules
with its peers as a rank that compiles does (`saved_graphs.py`), so ranks that load and ranks that compile check
one another.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp2_compile._torch_private import group_ranks, has_post_accumulate_grad_hooks, tree_leaves
from fsdp2_compile.compiler.rank_consistency import graph_groups
from fsdp2_compile.runtime.param_state import ParamInfo

__all__ = ["cache_events", "extra_key", "note_event", "package_digest", "sync_checked"]

_EVENTS: list[str] = []


def cache_events() -> list[str]:
    """What each compile with `compile_cache` in this process did: "hit" (loaded), "miss" (compiled; "stored"
    follows once saved), or "bypass" (torch cannot key the graph: compiled as usual, nothing saved)."""
    return list(_EVENTS)


def note_event(what: str) -> None:
    _EVENTS.append(what)


@functools.cache
def package_digest() -> str:
    """A digest of this package's installed source and data files: a saved compile is never loaded by other code."""
    import fsdp2_compile.passes

    h = hashlib.sha256()
    for root in sorted({Path(__file__).resolve().parents[1], Path(fsdp2_compile.passes.__file__).resolve().parent}):
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json") and "__pycache__" not in p.parts):
            h.update(f"{path.relative_to(root)}\n".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def extra_key(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], infos: Sequence[ParamInfo | None], config
) -> str:
    """What the backend's output depends on beyond the captured graph and its inputs' metadata: this package's
    code, the config, this rank and the ranks of the graph's process groups, and each parameter's
    whole state (its spec, tensor-parallel layout, float8 cast, kept-state keys) and whether it has
    post-accumulate-grad hooks."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    parts = [
        f"fsdp2_compile {package_digest()}",
        f"config {config!r}",
        f"world {world} rank {rank}",
        *(f"group {g} {group_ranks(g)}" for g in sorted(graph_groups(gm)) if dist.is_initialized()),
        *(
            f"param {i} {info!r} hooks {has_post_accumulate_grad_hooks(value)}"
            for i, (value, info) in enumerate(zip(example_inputs, infos))
            if info is not None
        ),
    ]
    return "fsdp2_compile:" + hashlib.sha256("\n".join(parts).encode()).hexdigest()


def sync_checked(compiled: Callable, infos: dict[str, ParamInfo]) -> Callable:
    """`compiled`, loaded from the cache: its backward reduces as the gradient-sync flags were when its graph was
    traced (Dynamo recompiles a forward run after they changed), so a backward run after they changed since its
    forward raises before it runs (where the graph was compiled, a variant runs: `unsynced_backward.py`)."""
    traced = {fqn: (i.requires_gradient_sync, i.requires_all_reduce) for fqn, i in infos.items()}

    def check(_grad_outputs: Any) -> None:
        now = {fqn: (i.requires_gradient_sync, i.requires_all_reduce) for fqn, i in infos.items()}
        if now != traced:
            changed = sorted(fqn for fqn in now if now[fqn] != traced[fqn])
            raise RuntimeError(
                "fsdp2_compile: set_requires_gradient_sync / set_requires_all_reduce changed between a forward and "
                f"its backward (for {', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}) of a graph "
                "loaded from the compile cache, whose saved backward reduces as the forward's flags said; set them "
                "before the forward, or compile with CompileConfig(compile_cache=False)"
            )

    def run(*args: Any) -> Any:
        out = compiled(*args)
        for node in {
            id(t.grad_fn): t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn
        }.values():
            node.register_prehook(check)
        return out

    return run
