"""Graph passes, one per file, each `(gm, ctx) -> gm`. The order is fixed in `fsdp2_compile.compiler.pass_list.PASSES`."""

from .bucket_collectives import bucket_collectives
from .combine_tied_grads import combine_tied_grads
from .drop_collectives_of_one import drop_collectives_of_one
from .keep_inputs_until_wait import keep_inputs_until_wait
from .lower_reduce_grad import lower_reduce_grad
from .lower_unshard import lower_unshard
from .reduce_scatter_by_all_to_all import reduce_scatter_by_all_to_all
from .reorder_for_overlap import reorder_for_overlap
from .schedule import schedule
from .tag_tp_collectives import tag_tp_collectives

__all__ = [
    "bucket_collectives",
    "combine_tied_grads",
    "drop_collectives_of_one",
    "keep_inputs_until_wait",
    "lower_reduce_grad",
    "lower_unshard",
    "reduce_scatter_by_all_to_all",
    "reorder_for_overlap",
    "schedule",
    "tag_tp_collectives",
]
