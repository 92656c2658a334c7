"""What `fsdp2-compile plan` prints: a plan's table (per-rank memory, communication, step time on each profile,
the method) and the search's ranking of the layouts that fit.
"""

from __future__ import annotations

from fsdp2_compile.core.hardware import PROFILES
from fsdp2_compile.debug.sizes import size_text
from fsdp2_compile.planner.candidates import describe
from fsdp2_compile.planner.devices import device_for
from fsdp2_compile.planner.search import SearchResult

__all__ = ["format_plan", "format_search"]


def _col(n: float) -> str:
    return f"{size_text(n):>13}"


def format_plan(plan, seconds: float, rss: int) -> str:
    pr, an = plan.per_rank_bytes, plan.analytical_bytes
    header = f"plan: {plan.params:,} parameters, {plan.layers} blocks, world size {plan.world_size}"
    if plan.pp > 1:
        dims = [("pp", plan.pp), ("replicate", plan.replicate), ("dp", plan.shard_size), ("tp", plan.tp)]
        dims = [(name, n) for name, n in dims if n > 1 or name == "dp"]
        header += f", mesh {' x '.join(str(n) for _, n in dims)} ({' x '.join(name for name, _ in dims)})"
    elif plan.replicate > 1 and plan.tp == 1:
        header += f", mesh {plan.replicate} x {plan.shard_size} (replicate x shard)"
    elif plan.tp > 1:
        header += (
            f", mesh {plan.replicate} x {plan.shard_size} x {plan.tp} (replicate x dp x tp)"
            if plan.replicate > 1
            else f", mesh {plan.shard_size} x {plan.tp} (dp x tp)"
        )
    divisor = "N" if plan.replicate == 1 else "(N/R)"
    if plan.tp > 1:
        divisor = "(dp*tp), /dp untouched by TP"
    if plan.pp > 1:
        divisor = "dp, this pp rank's stages"
    where = "rank 0, the largest shard" if plan.pp == 1 else f"pp rank {plan.pp_rank}: the highest peak"
    out = [header, "", f"per-rank memory ({where})"]
    for key in ("params", "grads", "optimizer"):
        error = (pr[key] - an[key]) / an[key] * 100 if an[key] else 0.0
        out.append(f"  {key:<14}{_col(pr[key])}   analytical numel*bytes/{divisor} {_col(an[key])}  ({error:+.3f}%)")
    if plan.pp > 1:
        out.append(f"  {'gathered_peak':<14}{_col(pr['gathered_peak'])}   its stages, gathered for the whole step")
        out.append(f"  unsharded_grads{_col(pr['unsharded_grads'])[1:]}   gradients accumulated over micro-batches")
    else:
        out.append(f"  {'gathered_peak':<14}{_col(pr['gathered_peak'])}   root bucket + 2 largest block buckets")
    out.append(f"  {'activations':<14}{_col(pr['activations'])}   saved by forward for backward")
    out.append(f"  {'total':<14}{_col(pr['total'])}   sum of the above")
    if "peak" in pr:
        out.append(
            f"  {'peak':<14}{_col(pr['peak'])}   highest allocated point of the simulated step (transients included)"
        )
    out.append("")
    buffers = ", ".join(f"{k} {size_text(v)}" for k, v in sorted(plan.collective_buffer_bytes.items()))
    ring = (
        "(N-1)/N of the buffers"
        if plan.replicate == 1
        else (
            f"(G-1)/G of each buffer, 2(G-1)/G of an all-reduce's; G = its group, "
            f"{plan.shard_size} or {plan.replicate} ranks"
        )
    )
    out.append(
        f"communication per step: {size_text(plan.comm_bytes_per_step)} sent per rank ({ring}: {buffers})"
        + (" (FSDP's, over dp)" if plan.tp > 1 else "")
    )
    if plan.pp > 1:
        out.append(
            f"pipeline parallel {plan.pp}: {plan.pp_schedule}, {plan.microbatches} micro-batches, "
            f"{plan.stages_per_rank} stage(s) per rank, blocks per stage {plan.pp_stage_blocks} (embedding with the "
            "first, head with the last); bubble and stage sends (PP comm) below"
        )
    if plan.float8:
        out.append("float8: the blocks' Linear weights gathered in float8 (1 byte), their matmuls at the float8 peak")
    if plan.kept_gathered:
        from fsdp2_compile.compiler.selective_unshard import KeptGathered

        k = plan.kept_gathered
        decision = KeptGathered(tuple(k["buckets"]), k["bytes"], k["resharded_bytes"], k["budget"])
        out.append(
            f"{decision.summary(size_text)}: {size_text(k['kept_for_backward_bytes'])} of them held from "
            f"forward to backward, {size_text(k['backward_gather_bytes_saved'])} less sent per rank per step"
        )
    if plan.tp > 1:

        def kinds(d: dict) -> str:
            return ", ".join(f"{k} x{n:,}" for k, n in sorted(d.items())) or "none"

        tp_buffers = ", ".join(f"{k} {size_text(v)}" for k, v in sorted(plan.tp_collective_buffer_bytes.items()))
        out.append(f"tensor parallel {plan.tp}: {plan.tp_plan}")
        for graph in ("forward", "backward"):
            out.append(
                f"  {graph:<9} per layer: {kinds(plan.tp_collectives_per_layer.get(graph, {}))}; per step: "
                f"{kinds(plan.tp_collectives_per_step.get(graph, {}))}"
            )
        out.append(
            f"  {size_text(plan.tp_comm_bytes_per_step)} sent per rank per step ((T-1)/T of each buffer, "
            f"2(T-1)/T of an all-reduce's, T = {plan.tp}: {tp_buffers or 'none'}), on the intra-node link, "
            "on the critical path (TP comm below)"
        )
    if plan.assumptions:
        a = plan.assumptions
        out.append(
            f"assumed: {a['attention']} attention, activation checkpointing {a['ac']}, {a['compiler']} "
            f"kernels, params {a['mp']['param_dtype']} / reduce {a['mp']['reduce_dtype']}, "
            f"{a['tokens_per_step_per_rank']:,} tokens per rank per step"
        )
    out.append("")
    out.append(
        f"  {'profile':<20}{'step time':>12}{'exposed comm':>14}{'tokens/s/rank':>15}{'MFU':>7}"
        f"{'reserved peak':>15}"
        + (f"{'TP comm':>12}" if plan.tp_comm_s else "")
        + (f"{'bubble':>12}{'PP comm':>12}" if plan.bubble_s else "")
    )
    for name, t in plan.step_time_s.items():
        tps, mfu = plan.tokens_per_s_per_rank.get(name), plan.mfu.get(name)
        reserved = plan.peak_reserved_bytes.get(name)
        out.append(
            f"  {name:<20}{t * 1e3:>9.1f} ms{plan.exposed_comm_s[name] * 1e3:>11.1f} ms"
            + (f"{tps:>15,.0f}" if tps is not None and tps >= 100 else f"{tps:>15.3g}" if tps is not None else "")
            + (f"{mfu * 100:>6.1f}%{size_text(reserved):>15}" if mfu is not None else "")
            + (f"{plan.tp_comm_s[name] * 1e3:>9.1f} ms" if name in plan.tp_comm_s else "")
            + (
                f"{plan.bubble_s[name] * 1e3:>9.1f} ms{plan.pp_comm_s[name] * 1e3:>9.1f} ms"
                if name in plan.bubble_s
                else ""
            )
        )
    out.append("")
    out.append("profiles (cost model: alpha, link, FLOP/s, memory; source)")
    for name in plan.step_time_s:
        p = PROFILES[name]
        out.append(
            f"  {name}: {p.alpha_s * 1e6:.0f} us, {1 / p.beta_s_per_byte / 1e9:.3g} GB/s, "
            f"{p.flops_per_s / 1e12:.3g} TFLOP/s, {p.mem_bytes_per_s / 1e9:.3g} GB/s; {p.source}"
        )
        d = device_for(name)
        eff = ", ".join(f"{k} {v:.2f}" for k, v in d.efficiency.items())
        out.append(
            f"    planner: peak {d.peak_flops / 1e12:.4g} TFLOP/s, memory {d.mem_bytes_per_s / 1e9:.4g} GB/s, "
            f"efficiency {eff}"
            + (
                f", intra-node link {d.intra_node_bytes_per_s / 1e9:.3g} GB/s {d.intra_node_alpha_s * 1e6:.0f} us (TP)"
                if plan.tp > 1
                else ""
            )
            + "; sources in --json (profiles.<name>.device.sources)"
        )
    out.append("")
    out.append(f"method: {plan.method}")
    out.append(f"planner: {seconds:.1f} s wall, peak RSS {rss / 2**20:.0f} MiB")
    return "\n".join(out) + "\n"


def _secs(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def format_search(result: SearchResult) -> str:
    pruned = ", ".join(f"{rule} {n:,}" for rule, n in result.pruned.items()) or "none"
    out = [
        f"search: {result.world_size:,} ranks, global batch {result.global_batch:,}, {result.profile}, device memory "
        f"{size_text(result.device_memory)}",
        f"  {result.enumerated:,} enumerated, {sum(result.pruned.values()):,} pruned ({pruned}), "
        f"{result.evaluated:,} planned, {result.fitting:,} fit; "
        + ", ".join(f"{n} {what}" for what, n in result.stages.items())
        + f"; {result.wall_s:.1f} s",
        "",
        f"  {'#':<3}{'tokens/s/GPU':>13}{'step':>10}{'compute':>10}{'exp. comm':>10}{'bubble':>10}"
        f"{'reserved / device':>24}{'MFU':>7}  {'binds':<8} layout",
    ]
    for i, s in enumerate(result.top, 1):
        out.append(
            f"  {i:<3}{s.tokens_per_s:>13,.0f}{_secs(s.step_s):>10}{_secs(s.compute_s):>10}{_secs(s.exposed_s):>10}"
            f"{_secs(s.bubble_s):>10}{size_text(s.reserved) + ' / ' + size_text(s.device_memory):>24}"
            f"{s.plan.mfu[s.profile] * 100:>6.1f}%  {s.binds:<8} {describe(s.candidate)}"
        )
    return "\n".join(out) + "\n"
