"""fsdp2_compile: FSDP2 semantics (per-parameter dim-0 sharding as DTensors) delivered by a graph compiler.

The public names are imported on first use (PEP 562), so `fsdp2-compile --help` starts without importing torch.
"""

import importlib
import sys
import types

_EXPORTS = {  # public name -> the module that defines it
    "CompileConfig": "config",
    "FSDPModule": "shard",
    "MixedPrecisionPolicy": "config",
    "fsdp2_backend": "backend",
    "is_sharded": "shard",
    "shard": "shard",
    "shard_compile": "api",
    "sharded_parameters": "shard",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # importing a submodule sets it on the package: `fsdp2_compile.shard` stays the function, not `shard.py`
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
