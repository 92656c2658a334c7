"""A training step as it runs, for the planner: compute time per op, the FSDP schedule of collectives beside it,
the optimizer step, and the memory an allocator sees over the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp2_compile.planner.devices import DeviceFigures
from fsdp2_compile.planner.trace import StepTrace

__all__ = [
    "FLOAT8_MATMULS",
    "PhaseTimes",
    "StepComm",
    "forward_backward_time",
    "memory_peak",
    "op_seconds",
    "optimizer_time",
    "part_times",
    "phase_times",
]


# - Op time: max(FLOPs / (peak x efficiency of its class), bytes / (bandwidth x memory efficiency)) + launch; under
#   Inductor fused intermediates move no bytes and fused ops launch nothing (`StepTrace.materialized`).
# - Schedule (FSDP2's, and the pipeline's): the root bucket is gathered first; each block's all-gather is issued
#   `prefetch` blocks ahead of its use, on one communication lane in issue order; in backward each block is
#   re-gathered ahead of use and its gradients reduce-scattered (then all-reduced over HSDP replicas) after its
#   backward. Where communication does not progress beside compute (`comm_overlaps_compute` False) the times add.
# - Float8 (torchao): the blocks' Linear matmuls at the float8 peak, plus an amax pass and a cast pass over each
#   operand that is not a parameter; an operand tensor parallelism all-gathered (`StepTrace.gathered`) is cast once,
#   on the shard before the gather (torchao's `PrepareFloat8ModuleInput`, which torchtitan's float8 TP plan uses).
# - Optimizer: AdamW reads parameters, gradients and both states and writes parameters and states, memory bound
#   (at the device's measured optimizer rate where it has one).
# - Memory: sharded state + gathered buckets + live activations (the trace's liveness, transients included) +, in
#   backward, the unsharded gradients and reduce-scatter buffers of the buckets in flight and the sharded gradients
#   produced so far; the optimizer step holds one temporary per state element. Reserved = allocated x the
#   allocator factor + the runtime's own memory.
@dataclass
class PhaseTimes:
    forward: float
    backward: float


FLOAT8_MATMULS = frozenset({"mm", "addmm", "linear"})
"""The 2-D matmuls nn.Linear runs (attention runs as bmm or its fused kernel): inside a block, float8 training runs
them in float8 (torchao converts the blocks' Linear layers; torchtitan leaves the output head in bf16)."""


def op_seconds(trace: StepTrace, dev: DeviceFigures, fused: bool | str, float8: bool = False) -> list[float]:
    """Seconds of each traced op (a view: 0)."""
    keep = trace.materialized(fused)
    moved = trace.moved_bytes(fused)
    bandwidth = dev.mem_bytes_per_s * dev.efficiency["memory"]
    seconds, cast = [], set()
    for op, nbytes in zip(trace.ops, moved):
        if op.kind == "view":
            seconds.append(0.0)
            continue
        if fused and op.kind == "fusible" and op.creates and not any(sid in keep for sid, _ in op.creates):
            launch = 0.0  # inside a fused kernel
        else:
            launch = dev.launch_s
        peak, casts = dev.peak_flops, 0.0
        if float8 and op.in_block and op.name in FLOAT8_MATMULS:
            peak = dev.float8_flops
            casts = _float8_cast_s(op, trace, bandwidth, dev.launch_s, cast)
        flop_s = peak * dev.efficiency.get(op.kind, 1.0)
        seconds.append(max(op.flops / flop_s, nbytes / bandwidth) + launch + casts)
    return seconds


def _float8_cast_s(op, trace: StepTrace, bandwidth: float, launch_s: float, cast: set[int]) -> float:
    """torchao's dynamic tensorwise scaling of a float8 matmul's operands that are not parameters (activations and
    gradients; the weights arrive in float8 from the all-gather): an amax reduction reads the operand, then the
    scaled cast reads it again and writes it in float8 (half its bf16 bytes); the cast needs the amax first, so
    the two are separate passes, each a kernel. An all-gathered activation arrives in float8: its shard was cast
    once before the gather (`cast` holds those already counted)."""
    seconds = 0.0
    for sid, nb in op.reads:
        if sid in trace.excluded or sid in cast:
            continue
        if sid in trace.gathered:
            cast.add(sid)
            nb = trace.gathered[sid]
        seconds += 2.5 * nb / bandwidth + 2 * launch_s
    return seconds


def phase_times(trace: StepTrace, dev: DeviceFigures, fused: bool | str, float8: bool = False) -> PhaseTimes:
    times = {"forward": 0.0, "backward": 0.0}
    for op, seconds in zip(trace.ops, op_seconds(trace, dev, fused, float8)):
        times[op.phase] += seconds
    return PhaseTimes(times["forward"], times["backward"])


def part_times(trace: StepTrace, dev: DeviceFigures, fused: bool | str, float8: bool = False) -> dict:
    """Seconds by (phase, pipeline part) ("block", "first", "last": `OpRecord.part`)."""
    times: dict[tuple[str, str], float] = {}
    for op, seconds in zip(trace.ops, op_seconds(trace, dev, fused, float8)):
        times[op.phase, op.part] = times.get((op.phase, op.part), 0.0) + seconds
    return times


def optimizer_time(params: int, grads: int, states: int, dev: DeviceFigures) -> float:
    """AdamW: read params, grads, states; write params and states, at the device's optimizer efficiency of its
    bandwidth (the elementwise "memory" one where none was measured)."""
    efficiency = dev.efficiency.get("optimizer", dev.efficiency["memory"])
    return (2 * params + grads + 2 * states) / (dev.mem_bytes_per_s * efficiency) + 20 * dev.launch_s


@dataclass
class StepComm:
    root_gather_s: float
    root_reduce_s: float
    gather_s: list[float]
    """Per block, in forward order."""
    reduce_s: list[float]
    """Per block: reduce-scatter (+ all-reduce over replicas)."""
    root_regather_s: float = 0.0
    """Backward's all-gathers of what goes with the root (the blocks of a model planned whole), at backward's start."""


def forward_backward_time(
    fw_block: float,
    fw_rest: float,
    bw_block: float,
    bw_rest: float,
    comm: StepComm,
    overlap: bool,
    prefetch: int = 2,
    reshard: bool = True,
    kept: set[int] = frozenset(),
) -> tuple[float, float]:
    """(step seconds without the optimizer, exposed communication seconds) of forward then backward; backward
    gathers the blocks again when `reshard`, except those in `kept` (selective unsharding)."""
    n = len(comm.gather_s)
    compute = n * (fw_block + bw_block) + fw_rest + bw_rest
    regathered = {j for j in range(n) if reshard and j not in kept}
    comm_total = (
        comm.root_gather_s
        + comm.root_regather_s
        + comm.root_reduce_s
        + sum(comm.gather_s)
        + sum(comm.gather_s[j] for j in regathered)
        + sum(comm.reduce_s)
    )
    if not overlap:
        return compute + comm_total, comm_total
    lane = 0.0  # when the communication lane is free

    def issue(at: float, duration: float) -> float:
        nonlocal lane
        lane = max(lane, at) + duration
        return lane

    now = 0.0
    root = issue(0.0, comm.root_gather_s)
    done = {i: issue(0.0, comm.gather_s[i]) for i in range(min(prefetch, n))}
    now = root
    for i in range(n):
        if i + prefetch < n:
            done[i + prefetch] = issue(now, comm.gather_s[i + prefetch])
        now = max(now, done[i]) + fw_block
    now += fw_rest
    if comm.root_regather_s:
        now = issue(now, comm.root_regather_s)  # backward's first op needs what it gathers
    now += bw_rest
    order, done = list(range(n - 1, -1, -1)), {j: 0.0 for j in range(n)}

    def gather_again(j: int, at: float) -> None:
        if j in regathered:
            done[j] = issue(at, comm.gather_s[j])

    for j in order[:prefetch]:
        gather_again(j, now - bw_rest)
    for k, j in enumerate(order):
        if k + prefetch < n:
            gather_again(order[k + prefetch], now)
        now = max(now, done[j]) + bw_block
        issue(now, comm.reduce_s[j])
    issue(now, comm.root_reduce_s)
    end = max(now, lane)
    return end, end - compute


def memory_peak(
    trace: StepTrace,
    fused: bool | str,
    *,
    static: int,
    grads: int,
    gathered_forward: int,
    gathered_backward: int,
    grad_buffers: int,
) -> int:
    """Highest allocated bytes over the traced step: `static` (sharded params + optimizer states) + gathered
    buckets + live activations + in backward the gradient buffers and the share of sharded gradients produced."""
    live = trace.liveness(fused)
    n_bw = sum(1 for phase, _ in live if phase == "backward") or 1
    peak, k = 0, 0
    for phase, nbytes in live:
        if phase == "forward":
            extra = gathered_forward
        else:
            k += 1
            extra = gathered_backward + grad_buffers + grads * k // n_bw
        peak = max(peak, static + nbytes + extra)
    return peak
