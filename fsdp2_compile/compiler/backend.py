"""The torch.compile backend "fsdp2": Dynamo graph → AOTAutograd joint graph → partition → pass pipeline.

The partitioner is torch's min-cut partitioner, after tagging each `fsdp2::unshard` node MUST_RECOMPUTE
(`reshard_after_forward=True`: no gathered parameter is saved for backward, backward gathers again what it needs)
or MUST_SAVE (`False`: gathered once, kept until backward).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import operator
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.tensor import DTensor

from fsdp2_compile._torch_private import (
    CheckpointPolicy,
    FakeScriptObject,
    aot_module_simplified,
    as_boxed,
    autograd_cache_counts,
    boxed_call,
    current_compile_id,
    donate_no_saved_tensors,
    dynamo_input_name,
    has_post_accumulate_grad_hooks,
    inductor_compile,
    inductor_decompositions,
    mark_boxed,
    min_cut_partition,
    saved_compile_settings,
    serializable_graph,
    serializable_inductor_graph,
    subgraph_schemas_reused,
)
from fsdp2_compile.compiler import compile_cache
from fsdp2_compile.compiler.block_gathers import (
    gather_again_in_backward,
    gather_outside_blocks,
    saved_inputs_from_callers,
)
from fsdp2_compile.compiler.compile_gc import full_collections_deferred
from fsdp2_compile.compiler.graph_records import (
    GraphRecord,
    collectives,
    dump_requested,
    record_graph,
    record_owner,
)
from fsdp2_compile.compiler.group_split import split_reduce_groups, split_unshard_groups
from fsdp2_compile.compiler.pass_list import PassContext, run_pipeline
from fsdp2_compile.compiler.post_forward import gather_backward_from_post_forward_shards
from fsdp2_compile.compiler.rank_consistency import compile_frame, graph_groups, rank_check, schedule_record
from fsdp2_compile.compiler.saved_graphs import SavedGraph
from fsdp2_compile.compiler.selective_unshard import KEPT_META, KeptGathered, buckets_to_keep
from fsdp2_compile.compiler.step_watch import watched
from fsdp2_compile.compiler.unsharded_after_backward import keep_unsharded_after_backward
from fsdp2_compile.compiler.unsynced_backward import BackwardBySync
from fsdp2_compile.config import CompileConfig, compiler_for
from fsdp2_compile.core.fx_edit import nodes_calling
from fsdp2_compile.core.grouped_unshard import gather_group
from fsdp2_compile.core.hardware import PROFILES, HardwareProfile
from fsdp2_compile.core.ir import REDUCE_GRAD, UNSHARD, ReduceGradArgs, UnshardArgs
from fsdp2_compile.runtime.grad_delivery import one_unshard_per_delivered_param
from fsdp2_compile.runtime.link_profile import measured_profile
from fsdp2_compile.runtime.param_state import ParamInfo, infos_of_values
from fsdp2_compile.runtime.sharding import is_known_param
from fsdp2_compile.runtime.validation import default_device_type

__all__ = ["check_input_devices", "compile_sharded"]

log = logging.getLogger("fsdp2_compile")


def _check_sharded(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Refuse graphs that read parameters `shard` does not manage (the module was never sharded)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, nn.Parameter) and not isinstance(value, DTensor) and not is_known_param(value):
            name = dynamo_input_name(node) or node.name
            raise RuntimeError(
                f"torch.compile(backend='fsdp2'): parameter {name} (shape {tuple(value.shape)}) is not sharded; "
                "call fsdp2_compile.shard(model, mesh) (or use fsdp2_compile.shard_compile) before compiling"
            )


def _check_hooks_delivered(example_inputs: Sequence[Any]) -> None:
    """Refuse what would be silently wrong: a parameter with post-accumulate-grad hooks (FSDP2's optimizer in
    backward) compiled without delivering its gradient itself — `torch.compile(model, backend="fsdp2")` does not
    look for hooks, `shard_compile` does — while its gradient is not reduced (sync off, or HSDP's all-reduce off):
    autograd would run the hooks with a zero gradient, where FSDP2 runs none."""
    for value, info in zip(example_inputs, infos_of_values(example_inputs)):
        if info is None or info.grad_key or not value.requires_grad or not has_post_accumulate_grad_hooks(value):
            continue
        if not info.requires_gradient_sync or (info.replicate_size > 1 and not info.requires_all_reduce):
            raise RuntimeError(
                f"fsdp2_compile: parameter '{info.fqn}' has post-accumulate-grad hooks (optimizer in backward) and "
                "its gradient is not reduced in this backward (set_requires_gradient_sync(False) or "
                "set_requires_all_reduce(False)); torch.compile(model, backend='fsdp2') does not see hooks, so "
                "autograd would run them with a zero gradient, where FSDP2 runs none. Compile with "
                "fsdp2_compile.shard_compile(model), which runs them only after a reduction, as FSDP2 does"
            )


def check_input_devices(inputs: Iterable[tuple[str, Any]], param_device: torch.device | None) -> None:
    """Refuse input tensors the sharded parameters cannot compute with: on the meta device (no data) while the
    parameters hold data, or off the CPU while the parameters (and the mesh) are on the CPU. `inputs` are
    (name, value) pairs; values that are not tensors, and parameters, are skipped."""
    if param_device is None:
        return
    for name, value in inputs:
        if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter):
            continue
        device = value.device
        if device.type == param_device.type:
            continue
        if device.type == "meta" or param_device.type == "cpu":
            raise ValueError(
                f"fsdp2_compile: input {name} (shape {tuple(value.shape)}, {value.dtype}) is on device '{device}' "
                f"but the sharded parameters are on '{param_device}'; move it there before calling the model, "
                f"e.g. {name}.to('{param_device.type}')"
                + (" (a meta tensor has no data: create it on that device)" if device.type == "meta" else "")
            )


def _param_device(example_inputs: Sequence[Any]) -> torch.device | None:
    for value in example_inputs:
        if isinstance(value, nn.Parameter):
            return value.device
    return None


def _check_graph_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Meta tensors among a graph's non-parameter inputs, when its parameters hold data, are always a mistake."""
    device = _param_device(example_inputs)
    if device is None or device.type == "meta":
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    named = []
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            named.append((dynamo_input_name(node) or node.name, value))
    check_input_devices(named, device)


def _tag_unshards(joint: fx.GraphModule, config: CompileConfig) -> KeptGathered | None:
    """Gathered parameters are recomputed in backward (resharded after forward) unless their module says not to
    or selective unsharding keeps their bucket; returns selective unsharding's decision."""
    decision = buckets_to_keep(joint.graph, config)
    kept = decision.buckets if decision is not None else ()
    for node in nodes_calling(joint.graph, UNSHARD):
        call = UnshardArgs.of(node)
        reshard = call.reshard_after_forward and call.bucket not in kept
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE if reshard else CheckpointPolicy.MUST_SAVE
        if reshard:  # nor is an alias of it saved (a float8 weight's bytes viewed as float8 and detached)
            for alias in _aliases_of(node):
                alias.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return decision


_ALIAS_OPS = {torch.ops.aten.view.dtype, torch.ops.aten.detach.default, torch.ops.aten.alias.default}


def _aliases_of(node: fx.Node) -> list[fx.Node]:
    """The nodes that alias `node`'s output by a chain of dtype views and detaches."""
    found, todo = [], [node]
    while todo:
        users = [u for u in todo.pop().users if u.op == "call_function" and u.target in _ALIAS_OPS]
        found += users
        todo += users
    return found


def _is_opaque(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), FakeScriptObject)


def _rng_states_before_opaques(fw: fx.GraphModule, bw: fx.GraphModule) -> None:
    """Work around torch 2.13 with activation checkpointing: the partitioner saves the RNG state of recomputed
    seeded ops (CPU SDPA is one) after the saved opaque objects (DTensor's DeviceMesh), where AOTAutograd's runtime
    expects only non-tensors ("expected all tensors_saved_with_vc_check to be Tensors"). Move those states before
    the first opaque object, among the forward's outputs and the backward's inputs alike."""
    output = fw.graph.output_node()
    [outs] = output.args
    outs = list(outs)

    def is_rng_state(o: Any) -> bool:  # getitem(run_and_save_rng_state(...), 0)
        if not (isinstance(o, fx.Node) and o.target is operator.getitem):
            return False
        source, index = o.args
        return index == 0 and source.target is torch.ops.higher_order.run_and_save_rng_state

    rng = [o for o in outs if is_rng_state(o)]
    if not rng or not any(_is_opaque(o) for o in outs):
        return
    rest = [o for o in outs if not any(o is r for r in rng)]
    at = next(i for i, o in enumerate(rest) if _is_opaque(o))
    output.args = (tuple(rest[:at] + rng + rest[at:]),)
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    first_opaque = next(p for p in placeholders if _is_opaque(p))
    for p in placeholders:
        if p.name.startswith("rng_state_output"):
            first_opaque.prepend(p)
    fw.recompile()
    bw.recompile()


def _partition(joint: fx.GraphModule, joint_inputs: Any, *, config: CompileConfig, **kwargs: Any):
    split_unshard_groups(joint)
    gather_again_in_backward(joint)
    saved_inputs_from_callers(joint)
    decision = _tag_unshards(joint, config)
    fw, bw = min_cut_partition(joint, joint_inputs, **kwargs)
    split_reduce_groups(bw)
    if decision is not None:
        fw.meta[KEPT_META] = bw.meta[KEPT_META] = decision
    _rng_states_before_opaques(fw, bw)
    gather_backward_from_post_forward_shards(fw, bw, kwargs["num_fwd_outputs"])
    keep_unsharded_after_backward(fw, bw)
    return fw, bw


def resolve_profile(config: CompileConfig, gm: fx.GraphModule) -> HardwareProfile:
    """The named profile, or the one measured on the graph's process group at a `shard_compile`d module's first
    call (not with `compile_cache`, whose keys need the same figures in every launch); else (`torch.compile(
    backend=...)` directly) the named profile of the device: h100-nvlink with an accelerator, cpu-gloo-loopback
    without."""
    if config.hardware is not None:
        if config.hardware not in PROFILES:
            raise ValueError(f"CompileConfig.hardware={config.hardware!r} is not one of {sorted(PROFILES)}")
        return PROFILES[config.hardware]
    op = next((n for n in gm.graph.nodes if n.target in (UNSHARD, REDUCE_GRAD)), None)
    measured = None
    if op is not None and not config.compile_cache:
        measured = measured_profile((UnshardArgs if op.target is UNSHARD else ReduceGradArgs).of(op).group_name)
    return measured or PROFILES["cpu-gloo-loopback" if default_device_type() == "cpu" else "h100-nvlink"]


def _sync_off_note(fqns: list[str]) -> str:
    shown = ", ".join(f"'{f}'" for f in fqns[:3]) + (f" and {len(fqns) - 3} more" if len(fqns) > 3 else "")
    return (
        f"fsdp2_compile: gradient sync was off on this rank for {shown} (set_requires_gradient_sync(False)) while this "
        "backward compiled; ranks with it on run another backward: set it alike on every rank"
    )


def _compiler(
    kind: str,
    config: CompileConfig,
    on_record: Callable[[GraphRecord], None] | None,
    infos: dict[str, ParamInfo] | None = None,
    saving: bool = False,
) -> Callable[[fx.GraphModule, Any], Callable]:
    """AOTAutograd's compiler of `kind` graphs. A backward's honours the gradient-sync flags of `infos` (the
    graph's parameters by fqn) as they are when it runs (`BackwardBySync`). `saving`: for the compile cache, it
    returns graphs torch can save (`saved_graphs.SavedGraph`)."""
    owner = record_owner()  # a backward compiled at its first run is still its module's
    on_cpu = default_device_type() == "cpu"  # gloo: the host waits in the collectives

    def compile_graph(gm: fx.GraphModule, example_inputs: Any) -> Callable:
        def compile_one(graph: fx.GraphModule) -> Callable:
            groups = graph_groups(graph)
            try:
                with full_collections_deferred(config.defer_full_gc):  # a backward's is compiled at its first run
                    compiled = as_boxed(_compile_graph(graph, example_inputs, groups))
            except Exception as e:
                if unsynced := sorted(fqn for fqn, info in (infos or {}).items() if not info.requires_gradient_sync):
                    e.add_note(_sync_off_note(unsynced))
                raise
            if saving:  # saved: watched as it runs, here and where it is loaded (`saved_graphs.py`)
                if kind == "forward":
                    donate_no_saved_tensors()  # its backward is compiled before any backward runs
                return compiled
            return watched(compiled, kind, groups, owner, check=config.check_rank_consistency and on_cpu)

        if kind == "backward" and infos and saving:  # saved: the traced flags
            saved = []

            def compile_saved(graph: fx.GraphModule) -> Callable:
                saved.append(compile_one(graph))
                return saved[0].run_saved

            # here, the variant of any flags (`unsynced_backward.py`)
            saved[0].run_here = BackwardBySync(gm, compile_one, infos, compile_saved)
            return saved[0]
        if kind == "backward" and infos and not saving:
            return mark_boxed(BackwardBySync(gm, compile_one, infos))
        return compile_one(gm)

    def _compile_graph(gm: fx.GraphModule, example_inputs: Any, groups: set[str]) -> Callable:
        start = time.perf_counter()
        log.info("compiling %s graph: %d nodes", kind, len(gm.graph.nodes))
        # a failure in here is published to the graph's peers, which then stop naming it instead of waiting
        with rank_check(gm, kind, config) as check_same_schedule:
            split_unshard_groups(gm)  # an inference graph (the others were split before partitioning)
            order = {fqn: info.serial for fqn, info in (infos or {}).items()}
            ctx = PassContext(kind=kind, config=config, profile=resolve_profile(config, gm), param_order=order)
            log.info("%s graph: cost-model profile %s (%s)", kind, ctx.profile.name, ctx.profile.source)
            gm = run_pipeline(gm, ctx, recompile=config.compiler == "inductor")  # else `boxed_call` generates it
            check_same_schedule(gm)
        record = GraphRecord(
            kind,
            gm,
            ctx.snapshots,
            ctx.timeline,
            current_compile_id(),
            ctx.profile,
            gm.meta.get(KEPT_META),
            owner,
            compile_frame(),
        )
        record_graph(record)
        if on_record is not None:
            on_record(record)
        saved = None
        if saving:
            record = json.dumps(schedule_record(gm, config))
            saved = SavedGraph(kind, frozenset(groups), config.check_rank_consistency, record)
        if config.compiler == "inductor":
            compiled = inductor_compile(
                gm, example_inputs, is_backward=kind == "backward", is_inference=kind == "inference"
            )
            compiled = serializable_inductor_graph(compiled, saved) if saved is not None else compiled
        elif saved is not None:
            boxed_call(gm)
            compiled = serializable_graph(gm, saved)
        else:
            compiled = boxed_call(gm)
        counts = Counter(c.kind for c in collectives(gm))
        log.info(
            "compiled %s graph in %.1f s: %d nodes, %d all_gather, %d reduce_scatter, %d all_reduce (%s)",
            kind,
            time.perf_counter() - start,
            len(gm.graph.nodes),
            counts["all_gather"],
            counts["reduce_scatter"],
            counts["all_reduce"],
            config.compiler,
        )
        return compiled

    return compile_graph


def compile_sharded(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: CompileConfig | None = None,
    on_record: Callable[[GraphRecord], None] | None = None,
):
    """What the fsdp2 backend does (`api.fsdp2_backend`): lowers the fsdp2 ops of a captured graph of a sharded
    module into collectives. `on_record` is called with each compiled graph's record (the debug dump)."""
    config = config or CompileConfig()
    if config.memory_budget_fraction is not None:
        raise ValueError(
            "CompileConfig.memory_budget_fraction is measured and agreed over the ranks by "
            "fsdp2_compile.shard_compile; with torch.compile(model, backend=...) use CompileConfig.memory_budget_bytes"
        )
    config = dataclasses.replace(config, compiler=compiler_for(config, default_device_type()))
    with full_collections_deferred(config.defer_full_gc):
        return _compile(gm, example_inputs, config, on_record)


def _compile(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: CompileConfig,
    on_record: Callable[[GraphRecord], None] | None,
):
    _check_sharded(gm, example_inputs)
    _check_graph_inputs(gm, example_inputs)
    _check_hooks_delivered(example_inputs)
    gather_outside_blocks(gm, example_inputs)
    one_unshard_per_delivered_param(gm)
    values = infos_of_values(example_inputs)
    infos = {info.fqn: info for info in values if info is not None}

    def compile_all(saving: bool = False) -> Callable:
        with subgraph_schemas_reused():
            return aot_module_simplified(
                gm,
                example_inputs,
                fw_compiler=_compiler("forward", config, on_record, saving=saving),
                bw_compiler=_compiler("backward", config, on_record, infos, saving),
                inference_compiler=_compiler("inference", config, on_record, saving=saving),
                partition_fn=functools.partial(_partition, config=config),
                decompositions=inductor_decompositions() if config.compiler == "inductor" else None,
            )

    if not config.compile_cache or config.keep_snapshots or dump_requested():  # a hit records no graph to dump
        return compile_all()
    before = autograd_cache_counts()
    key = compile_cache.extra_key(gm, example_inputs, values, config)
    with saved_compile_settings(key, [gather_group]):
        compiled = compile_all(saving=True)
    counts = {k: v - before.get(k, 0) for k, v in autograd_cache_counts().items()}
    if counts.get("autograd_cache_hit"):
        compile_cache.note_event("hit")
        log.info("loaded the compiled graphs from torch's AOTAutograd cache")
        return compile_cache.sync_checked(compiled, infos)
    compile_cache.note_event("miss" if counts.get("autograd_cache_miss") else "bypass")
    if counts.get("autograd_cache_saved"):
        compile_cache.note_event("stored")
    return compiled
