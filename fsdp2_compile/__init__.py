"""fsdp2_compile: FSDP2 semantics (per-parameter dim-0 sharding as DTensors) delivered by a graph compiler.

The public names are imported on first use (PEP 562), so `fsdp2-compile --help` starts without importing torch.
"""

import importlib

_EXPORTS = {  # public name -> the module that defines it
    "CPUOffloadPolicy": "fsdp2_compile.config",
    "CompileConfig": "fsdp2_compile.config",
    "FSDPModule": "fsdp2_compile.runtime.fsdp_module",
    "MixedPrecisionPolicy": "fsdp2_compile.config",
    "OffloadPolicy": "fsdp2_compile.config",
    "fsdp2_backend": "fsdp2_compile.api",
    "is_sharded": "fsdp2_compile.runtime.param_state",
    "register_fsdp_forward_method": "fsdp2_compile.runtime.forward_hooks",
    "shard": "fsdp2_compile.runtime.sharding",
    "shard_compile": "fsdp2_compile.api",
    "sharded_parameters": "fsdp2_compile.runtime.param_state",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
