"""One training step (forward, loss, backward) of a model played op by op on the meta device, for the planner."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import flop_registry

from fsdp2_compile._torch_private import TorchDispatchMode, storage_id, tree_leaves
from fsdp2_compile.core.fx_edit import VIEW_OPS
from fsdp2_compile.planner.attention import AttentionMode, is_attention, is_causal

__all__ = ["OpRecord", "StepTrace", "tp_gather", "trace_step"]

MATMULS = {"mm", "bmm", "addmm", "baddbmm", "convolution", "convolution_backward", "_scaled_mm", "linear"}
VIEWS = VIEW_OPS | {
    "_reshape_alias",
    "view_as_real",
    "view_as_complex",
    "unflatten",
    "flatten",
    "lift_fresh",
    "empty",
    "empty_like",
    "zeros",
    "ones",
    "zeros_like",
    "ones_like",
    "arange",
    "full",
    "scalar_tensor",
    "new_empty",
    "new_zeros",
}
"""No compute: views (shared storage) and allocations (counted by liveness, not as traffic)."""


# Every aten op that runs is recorded with its FLOPs (torch's flop counter; fused attention halved when causal),
# the storages it reads and the storages it creates. From that:
# - `liveness`: bytes of activations alive after each op (a storage lives from the op that creates it to its last
#   reader, so what forward saves lives until backward reads it; parameters and their gradients are left out: the
#   planner counts them as gathered buckets and gradient buffers);
# - `saved_bytes`: what forward leaves alive for backward;
# - fusion (`fused` True: Inductor on the whole model; "blocks": Inductor on each block only, the rest eager, as
#   torchtitan's `apply_compile` does): the output of a pointwise or reduction op read only by such ops of the same
#   phase (and, for "blocks", inside a block) is never written to memory, so it costs neither bytes nor memory.
# Attention and activation checkpointing run as the planner was asked (`attention.py`, `activation_checkpointing.py`).
# A TP-local copy's stand-in for tensor parallelism's all-gather of an activation (`tp_gather`) is recorded as such
# (`StepTrace.gathered`).
@dataclass
class OpRecord:
    name: str
    phase: str
    """"forward" or "backward" (recomputation under checkpointing runs in backward)."""
    kind: str
    """"matmul", "attention", "view" or "fusible" (pointwise, reductions and the rest: Inductor fuses them)."""
    flops: float
    reads: list[tuple[int, int]]
    """(storage id, bytes read) of each tensor input."""
    creates: list[tuple[int, int]]
    """(storage id, bytes) of each storage this op allocates."""
    in_block: bool = False
    """Ran inside a block of the block list (its forward, recomputation or backward)."""
    part: str = "first"
    """Which pipeline stage runs it: "block" (inside a block), "first" (outside the blocks, before them in forward,
    after them in backward: the embedding) or "last" (after the blocks in forward, before them in backward: the
    head and the loss)."""


@dataclass
class StepTrace:
    ops: list[OpRecord] = field(default_factory=list)
    excluded: set[int] = field(default_factory=set)
    """Storages of parameters and their gradients."""
    attention: str = "fused"
    ac: str = "none"
    boundary_bytes: int = 0
    """Bytes of a block's output: what one pipeline stage sends the next."""
    gathered: dict[int, int] = field(default_factory=dict)
    """Storages that tensor parallelism's all-gather of an activation creates (`tp_gather`), with the bytes of the
    shard each rank gave."""

    def forward_flops(self) -> float:
        return sum(op.flops for op in self.ops if op.phase == "forward")

    def materialized(self, fused: bool | str) -> set[int]:
        """Storages written to memory: all of them, or (fused) all but fusible-to-fusible intermediates (fused
        "blocks": only those inside a block)."""
        born, users = {}, {}
        for i, op in enumerate(self.ops):
            for sid, _ in op.creates:
                born.setdefault(sid, i)
            for sid, _ in op.reads:
                users.setdefault(sid, []).append(i)
        if not fused:
            return set(born)
        keep = set()
        for sid, i in born.items():
            op = self.ops[i]
            readers = [self.ops[j] for j in users.get(sid, [])]
            outside = fused == "blocks" and not (op.in_block and all(r.in_block for r in readers))
            if (
                outside
                or op.kind != "fusible"
                or not readers
                or any(r.kind != "fusible" or r.phase != op.phase for r in readers)
            ):
                keep.add(sid)
        return keep

    def liveness(self, fused: bool = False) -> list[tuple[str, int]]:
        """(phase, live activation bytes while each op runs)."""
        keep = self.materialized(fused) - self.excluded
        size, born, last = {}, {}, {}
        for i, op in enumerate(self.ops):
            for sid, nb in op.creates:
                if sid in keep and sid not in born:
                    born[sid], size[sid], last[sid] = i, nb, i
            for sid, _ in op.reads:
                if sid in born:
                    last[sid] = i
        delta = [0] * (len(self.ops) + 1)
        for sid, i in born.items():
            delta[i] += size[sid]
            delta[last[sid] + 1] -= size[sid]
        out, live = [], 0
        for i, op in enumerate(self.ops):
            live += delta[i]
            out.append((op.phase, live))
        return out

    def saved_bytes(self, fused: bool = False, part: str | None = None) -> int:
        """Bytes created in forward and read in backward: what forward leaves alive for backward (`part`: only what
        the ops of that part created)."""
        keep = self.materialized(fused) - self.excluded
        size, born_fw, read_bw = {}, set(), set()
        for op in self.ops:
            for sid, nb in op.creates:
                if op.phase == "forward" and sid in keep and part in (None, op.part):
                    born_fw.add(sid)
                    size[sid] = nb
            if op.phase == "backward":
                read_bw.update(sid for sid, _ in op.reads)
        return sum(size[s] for s in born_fw & read_bw)

    def moved_bytes(self, fused: bool = False) -> list[int]:
        """Bytes each op reads and writes (fused: only storages that are materialized)."""
        keep = self.materialized(fused) if fused else None
        return [sum(nb for sid, nb in op.reads + op.creates if keep is None or sid in keep) for op in self.ops]


_GATHERED: ContextVar[dict[int, int] | None] = ContextVar("tp_gathered", default=None)
"""The playing trace's `gathered` while `trace_step` runs."""


def tp_gather(x: torch.Tensor, tp: int, dim: int) -> torch.Tensor:
    """What one rank holds after tensor parallelism's all-gather of its shard `x` along `dim` (tp copies
    concatenated: the gathered buffer's size and traffic), recorded in the playing trace's `gathered`."""
    out = torch.cat([x] * tp, dim=dim)
    gathered = _GATHERED.get()
    if gathered is not None:
        gathered[storage_id(out)] = _nbytes(x)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: StepTrace):
        super().__init__()
        self.trace, self.phase, self.seen, self.keep = trace, "forward", set(), []
        self.depth = 0
        self.blocks_ran = {"forward": False, "backward": False}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        # a storage id must not be reused by a later tensor: hold the storages, not the tensors (a held tensor
        # would make AccumulateGrad copy each gradient instead of taking it, as no real step does)
        self.keep.extend(t.untyped_storage() for t in outs)
        creates = []
        for t in outs:
            sid = storage_id(t)
            if sid not in self.seen:
                self.seen.add(sid)
                creates.append((sid, t.untyped_storage().nbytes()))
        flops = 0.0
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            try:
                flops = float(formula(*args, out_val=out, **kwargs))
            except Exception:  # a formula that does not fit this overload: bytes only
                flops = 0.0
        if is_attention(func):
            kind = "attention"
            flops *= 0.5 if is_causal(func, args, kwargs) else 1.0
        elif name in MATMULS:
            kind = "matmul"
        elif name in VIEWS:
            kind = "view"
        else:
            kind = "fusible"
        reads = [(storage_id(t), _nbytes(t)) for t in ins]
        if kind == "view":
            reads = []
        if self.depth > 0:
            self.blocks_ran[self.phase] = True
            part = "block"
        else:
            part = "last" if self.blocks_ran[self.phase] == (self.phase == "forward") else "first"
        self.trace.ops.append(OpRecord(name, self.phase, kind, flops, reads, creates, self.depth > 0, part))
        return out


def _mark_blocks(model: nn.Module, recorder: _Recorder) -> None:
    """Count the recorder's depth up while a block of the block list runs forward or backward."""
    from fsdp2_compile.planner.reduced_depth import block_list

    def enter(*_):
        recorder.depth += 1

    def leave(*_):
        recorder.depth -= 1

    def leave_forward(_module, _args, output):
        leave()
        if recorder.phase == "forward":
            first = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor)), None)
            if first is not None:
                recorder.trace.boundary_bytes = max(recorder.trace.boundary_bytes, _nbytes(first))

    _, blocks = block_list(model)
    for block in blocks if blocks is not None else ():
        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave_forward)
        block.register_full_backward_pre_hook(enter)
        block.register_full_backward_hook(leave)


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta")
    if isinstance(x, (tuple, list)):
        return type(x)(_to_meta(a) for a in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x


def trace_step(
    model: nn.Module,
    args: tuple,
    loss_fn,
    *,
    attention: str = "fused",
    ac: str = "none",
    param_dtype: torch.dtype | None = None,
) -> StepTrace:
    """Play one step of `model` (moved to the meta device; parameters cast to `param_dtype`, as FSDP's mixed
    precision gathers them) with `ac` applied to its blocks ("as given": leave the model's own checkpointing)."""
    from fsdp2_compile.planner.activation_checkpointing import apply_ac

    model = model.to("meta")
    for p in model.parameters():
        if param_dtype is not None and p.is_floating_point():
            p.data = p.data.to(param_dtype)
    apply_ac(model, ac, recompute_context=lambda: AttentionMode(attention))
    trace = StepTrace(attention=attention, ac=ac)
    params = list(model.parameters())
    trace.excluded = {storage_id(p) for p in params}
    recorder = _Recorder(trace)
    _mark_blocks(model, recorder)
    # early_stop=False: a recomputation runs to the block's end, so it reads every output selective checkpointing
    # cached (those outputs are held until then)
    token = _GATHERED.set(trace.gathered)
    try:
        with AttentionMode(attention), recorder, set_checkpoint_early_stop(False):
            loss = loss_fn(model(*_to_meta(args)))
            recorder.phase = "backward"
            loss.backward()
    finally:
        _GATHERED.reset(token)
    trace.excluded |= {storage_id(p.grad) for p in params if p.grad is not None}
    return trace
