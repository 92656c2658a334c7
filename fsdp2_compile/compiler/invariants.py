"""Invariants of an executable graph that the pipeline checks before anything runs it.

`check_collectives_safe(gm)`: every collective's result is read only by its `wait_tensor` (and by reads of its
sizes, which a dynamic shape adds: metadata, set when the collective is issued), and every tensor input
of a collective is still used at or after that wait, so the code generated from the graph cannot free the input
while the collective may still read it (a use-after-free that corrupts the heap or silently sends garbage).
"""

from __future__ import annotations

import torch
from torch import fx

from fsdp2_compile.core.ir import WAIT, collective_kind

__all__ = ["UnsafeGraphError", "check_collectives_safe"]

_aten = torch.ops.aten
METADATA_READS = frozenset(
    {_aten.sym_size.int, _aten.sym_stride.int, _aten.sym_numel.default, _aten.sym_storage_offset.default}
)
"""Ops that read a tensor's sizes, not its data: safe on a collective's result before its wait (e.g. the size of
a variable-split all-to-all's output, read to save it for backward)."""


class UnsafeGraphError(RuntimeError):
    """A graph whose collectives' buffers could be freed or read before the collective is done."""


def check_collectives_safe(gm: fx.GraphModule) -> None:
    """Raise UnsafeGraphError naming the first collective whose result is read before its wait, that is never
    waited for, or whose input's last use comes before its wait."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last_use = {n: max((order[u] for u in n.users), default=order[n]) for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        if collective_kind(node) is None:
            continue
        waits = [u for u in node.users if u.target is WAIT]
        others = [u.name for u in node.users if u.target is not WAIT and u.target not in METADATA_READS]
        if len(waits) != 1 or others:
            raise UnsafeGraphError(
                f"{gm.__class__.__name__}: collective {node.name} must have exactly one wait_tensor and no other "
                f"user; it has {len(waits)} wait(s) and users {others}"
            )
        for inp in node.all_input_nodes:
            if isinstance(inp.meta.get("val"), torch.Tensor) and last_use[inp] < order[waits[0]]:
                raise UnsafeGraphError(
                    f"{gm.__class__.__name__}: input {inp.name} of collective {node.name} is last used before its "
                    f"wait {waits[0].name}, so it could be freed while the collective still reads it; run the "
                    "keep_inputs_until_wait pass last"
                )
