"""fsdp2_compile: FSDP2 semantics (per-parameter dim-0 sharding as DTensors) delivered by a graph compiler."""

from .api import shard_compile
from .backend import fsdp2_backend
from .config import CompileConfig, MixedPrecisionPolicy
from .shard import is_sharded, shard, sharded_parameters

__all__ = ["CompileConfig", "MixedPrecisionPolicy", "fsdp2_backend", "is_sharded", "shard", "shard_compile", "sharded_parameters"]
