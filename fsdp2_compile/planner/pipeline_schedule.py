"""Pipeline parallelism for the planner (`--pp P`): how the blocks split into stages, which stages a rank holds,
how many micro-batches' activations a schedule keeps, the bubble and the stage-to-stage sends.
"""

from __future__ import annotations

__all__ = ["SCHEDULES", "bubble_s", "in_flight", "pp_comm_s", "rank_stages", "stage_blocks"]

SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
"""The schedules planned (torch.distributed.pipelining's names); Interleaved1F1B holds V >= 2 stages per rank."""


# - Split (torchtitan's `_generate_llm_fqn_per_model_part`, input and output weight 1): the S = P x V stages share
#   L + 2 "layers", the embedding and the head counting one each; the first (L + 2) mod S stages get one more; the
#   first stage holds the embedding and one block less, the last the head (and the loss) and one block less.
# - Stages of a rank: rank r runs stages r, r + P, ... (torch's looped schedules; V = 1 for 1F1B and GPipe).
# - Activations in flight on rank r (micro-batches of each of its stages, torch's schedules): GPipe all M; 1F1B
#   min(P - r, M) (the first stage P); Interleaved1F1B the (V - 1) R + 2 (P - 1 - r) warm-up forwards and the next
#   one, at most M V, R = M / max(1, M / P) micro-batches a round, in the schedule's order: R micro-batches through
#   its first stage, then through its second, ... (the last rank: P of its first stage, one of its last; Narayanan
#   et al. 2021, Korthikanti et al. 2022).
# - Time: the slowest rank's M micro-batches plus the bubble, (P - 1) / V of its time for one micro-batch
#   ((P - 1) / M of the step's compute for 1F1B and GPipe); each micro-batch's activation crosses each stage
#   boundary forward and its gradient backward, waited for before the next stage computes: 2 (M V + P - 1) sends
#   on the critical path.
def stage_blocks(layers: int, stages: int) -> list[tuple[int, int]]:
    """(first block, number of blocks) of each of `stages` stages over `layers` blocks, torchtitan's split."""
    if stages > layers:
        raise ValueError(f"{stages} pipeline stages for {layers} blocks: each stage needs a block")
    effective = layers + 2
    per, extra = divmod(effective, stages)
    out, start = [], 0
    for k in range(stages):
        n = per + (k < extra) - (k == 0) - (k == stages - 1)
        out.append((start, n))
        start += n
    return out


def rank_stages(rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages rank `rank` of the pp dimension runs (looped: rank, rank + P, ...)."""
    return [rank + j * pp for j in range(stages_per_rank)]


def in_flight(schedule: str, pp: int, stages_per_rank: int, microbatches: int, rank: int) -> list[int]:
    """Micro-batches whose activations rank `rank` holds at its peak, for each of its stages (`rank_stages`
    order)."""
    if schedule == "GPipe":
        return [microbatches]
    if schedule == "1F1B":
        return [min(pp - rank, microbatches)]
    v = stages_per_rank
    per_round = microbatches // max(1, microbatches // pp)
    chunks = min((v - 1) * per_round + 2 * (pp - 1 - rank) + 1, microbatches * v)
    counts = [0] * v
    for j in range(chunks):
        counts[(j // per_round) % v] += 1
    return counts


def bubble_s(pp: int, stages_per_rank: int, microbatch_s: float) -> float:
    """Idle time of the pipeline's fill and drain: (P - 1) / V of the slowest rank's time for one micro-batch."""
    return (pp - 1) / stages_per_rank * microbatch_s


def pp_comm_s(pp: int, stages_per_rank: int, microbatches: int, send_s: float) -> float:
    """Stage-to-stage sends on the critical path: an activation forward and its gradient backward for each of
    the M V micro-batch slots and the P - 1 steps of fill and drain; `send_s` is one send."""
    if pp == 1:
        return 0.0
    return 2 * (microbatches * stages_per_rank + pp - 1) * send_s
