"""Graph passes, one per file, each `(gm, ctx) -> gm`. The order is fixed in `fsdp2_compile.pipeline.PASSES`."""

from .combine_tied_grads import combine_tied_grads
from .lower_reduce_grad import lower_reduce_grad
from .lower_unshard import lower_unshard

__all__ = ["combine_tied_grads", "lower_reduce_grad", "lower_unshard"]
