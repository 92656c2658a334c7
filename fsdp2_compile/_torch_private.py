"""Every private torch API the project uses, wrapped in one place.

If a torch upgrade moves one of these, this is the only file to change.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx
from torch._functorch import config as functorch_config
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import detect_fake_mode
from torch._library.fake_class_registry import FakeScriptObject
from torch.utils.checkpoint import CheckpointPolicy

__all__ = [
    "CheckpointPolicy",
    "FakeScriptObject",
    "aot_module_simplified",
    "boxed_call",
    "current_compile_id",
    "default_store",
    "detect_fake_mode",
    "dtensor_layout",
    "dtensor_of",
    "fake_output_by_meta_kernel",
    "fake_process_group",
    "group_ranks",
    "group_size",
    "group_timeout",
    "has_post_accumulate_grad_hooks",
    "inductor_compile",
    "inductor_decompositions",
    "min_cut_partition",
    "on_every_compile",
    "one_thread_gloo_backend",
    "post_accumulate_grad_hooks",
    "queue_at_backward_end",
    "register_value_type",
    "resolve_group",
    "skip_guard_latency_probe",
    "subgraph_schemas_reused",
    "tracing_backend",
    "trace_graph_artifact",
]


def min_cut_partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's min-cut partitioner without its common-subexpression pass: that pass imports Inductor's pattern
    matcher and lowering (~20 MiB per rank) and leaves our graphs as they were (`lower_unshard` folds repeated
    gathers itself; the GPT's and MLP's graphs came out identical but for one node's name)."""
    with functorch_config.patch(cse=False):
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def fake_output_by_meta_kernel(fn: Callable[..., torch.Tensor], args: tuple, kwargs: dict):
    """`fn(*args, **kwargs)` (an op, or a function of a few ops) on fake inputs, computed as FakeTensorMode
    computes a fake output: by its meta kernels on the inputs seen as meta tensors (a view shares their fake
    storage), then wrapped as their mode's fake tensor, without the mode's per-call dispatch (a fifth of the
    time). None (call the op under the mode instead) where that is not simply so: symbolic sizes, or inputs that
    are not all fake tensors of one mode on one device, or `fn` returns None."""
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    fake_mode = getattr(tensors[0], "fake_mode", None) if tensors else None
    if fake_mode is None or any(
        not isinstance(t, FakeTensor) or t.fake_mode is not fake_mode or t.device != tensors[0].device
        or not all(isinstance(d, int) for d in (*t.shape, *t.stride()))
        for t in tensors
    ):
        return None
    with in_kernel_invocation_manager(fake_mode):
        out = fn(*args, **kwargs)
    if out is None:  # `fn` declined
        return None
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, out, tensors[0].device)


def tracing_backend() -> Callable | None:
    """While Dynamo traces a frame: the backend it will hand the graph to, unwrapped from Dynamo's and
    torch.compile's wrappers (a function, or the `functools.partial` `make_backend` returns); None otherwise."""
    from torch._dynamo import symbolic_convert
    from torch._dynamo.eval_frame import innermost_backend

    tx = getattr(symbolic_convert.tls, "current_tx", None)
    if tx is None or getattr(tx.output, "compiler_fn", None) is None:
        return None
    fn = innermost_backend(tx.output.compiler_fn)
    return innermost_backend(getattr(fn, "compiler_fn", fn))  # torch.compile's wrapper holds the backend there


def register_value_type(cls: type) -> type:
    """Register `cls` (hashable, compared by value, with `__fx_repr__`) as an opaque value type: a custom op may take
    it as an argument, and Dynamo bakes it into the graph as a constant guarded by equality (Note [Opaque Objects]
    in `torch/_library/opaque_object.py`)."""
    from torch._library.opaque_object import register_opaque_type

    register_opaque_type(cls, typ="value")
    return cls


def has_post_accumulate_grad_hooks(tensor: torch.Tensor) -> bool:
    """Whether `tensor.register_post_accumulate_grad_hook` registered any hook still in place."""
    return bool(getattr(tensor, "_post_accumulate_grad_hooks", None))


def post_accumulate_grad_hooks(tensor: torch.Tensor) -> list:
    """The hooks `tensor.register_post_accumulate_grad_hook` registered, in order (FSDP2's `foreach_reduce` reads
    the same attribute to run them after its reduce-scatter)."""
    return list((getattr(tensor, "_post_accumulate_grad_hooks", None) or {}).values())


def queue_at_backward_end(callback) -> None:
    """Run `callback` when the running backward pass ends (autograd's engine; FSDP2 queues its own the same way)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def fake_process_group(rank: int, world_size: int) -> None:
    """Initialise the default process group with the in-process fake backend (any world size, no peers)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)



def default_store():
    """The key-value store of the default process group."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()



def group_size(group_name: str) -> int:
    """Ranks in the process group registered under `group_name` (what functional collectives take)."""
    return resolve_group(group_name).size()


def group_ranks(group_name: str) -> list[int]:
    """Global ranks of the process group registered under `group_name`."""
    return torch.distributed.get_process_group_ranks(resolve_group(group_name))


def group_timeout(group_name: str | None = None) -> float:
    """Seconds the process group registered under `group_name` (None: the default group) waits in a collective
    before failing: the shortest of its backends' timeouts (set by `init_process_group` / `new_group(timeout=)`),
    else the backend's default."""
    from torch.distributed import distributed_c10d as c10d

    pg = c10d._get_default_group() if group_name is None else resolve_group(group_name)
    found = []
    for device in pg._device_types:
        try:
            found.append(pg._get_backend(device).options._timeout.total_seconds())
        except (AttributeError, RuntimeError):  # a backend without options (e.g. a wrapper): use the default
            pass
    return min(found) if found else c10d._get_default_timeout(torch.distributed.get_backend(pg)).total_seconds()


def current_compile_id() -> tuple[int, int] | None:
    """(frame, attempt) of the Dynamo compilation in progress: a graph break's continuation is a new frame, a
    recompile (guards failed, e.g. a new input shape) a new attempt of the same frame. None outside Dynamo."""
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    if cid is None or cid.frame_id is None:
        return None
    return cid.frame_id, cid.frame_compile_id


def on_every_compile(start: Callable[[], None], end: Callable[[], None]) -> None:
    """Run `start` when torch begins compiling — Dynamo tracing a frame, with its backend, or AOTAutograd compiling
    a backward lazily — and `end` when it is done (raising or not); once per outermost compile
    (`torch._dynamo.callback`'s handler counts nested ones)."""
    from torch._dynamo.callback import callback_handler

    callback_handler.register_start_callback(lambda _args: start())
    callback_handler.register_end_callback(lambda _args: end())


def skip_guard_latency_probe(skip: Callable[[], bool]) -> None:
    """After building a frame's guards, Dynamo times them once (`torch._dynamo.guards.profile_guard_manager`, for
    a debug log and the `guard_latency_us` compile metric), flushing the CPU cache first by writing a 32 MiB
    buffer. Where `skip()` is true, that timing is not run and reports 0; the guards are still checked."""
    from torch._dynamo import guards

    probe = guards.profile_guard_manager

    def probe_unless_skipped(*args: Any, **kwargs: Any) -> float:
        return 0.0 if skip() else probe(*args, **kwargs)

    guards.profile_guard_manager = probe_unless_skipped


def boxed_call(gm: fx.GraphModule):
    """`gm` as AOTAutograd's boxed callable, as torch's aot_eager makes it: the generated code takes the list of
    inputs and clears it, so each input (a backward graph's saved activations above all) is freed after its last use
    in the graph instead of living until the graph returns. Changes `gm`'s code in place (`gm.forward` then takes one
    list); `invariants.check_collectives_safe` has already made every collective's inputs outlive its wait."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    forward = gm.forward

    def run(args: list):
        return forward(args)

    run._boxed_call = True
    return run


def inductor_compile(gm, example_inputs, *, is_backward: bool, is_inference: bool):
    """Compile an AOT forward/backward graph with Inductor, without Inductor's own reordering and with the
    collectives pinned in the order the fsdp2 scheduler chose."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner

    gm = _pin_communication_order(gm)
    with config.patch(reorder_for_peak_memory=False, reorder_for_compute_comm_overlap=False):
        return compile_fx_inner(gm, example_inputs, is_backward=is_backward, is_inference=is_inference)


def _pin_communication_order(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` whose collective starts and waits are each chained to the one before (Inductor's
    `control_deps`), so that fusion cannot move a collective past a wait the scheduler put after it (e.g. a
    reduce-scatter whose input kernel fuses with a later one). `gm` itself stays as the report shows it."""
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    pinned = fx.GraphModule(gm, graph)
    comm = [n for n in graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", "") == "_c10d_functional"]
    preserve_node_ordering(graph, {later: OrderedSet([earlier]) for earlier, later in zip(comm, comm[1:])})
    pinned.recompile()
    return pinned


def inductor_decompositions() -> dict:
    """The decompositions AOTAutograd must apply to graphs meant for Inductor."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def resolve_group(group_name: str):
    """The process group registered under `group_name` (what functional collectives take)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


_ONE_THREAD_GLOO = "fsdp2_gloo_one_thread"


def one_thread_gloo_backend() -> str:
    """The name of a registered backend that is gloo with one worker thread (`init_process_group` and
    `new_group` ignore gloo's `pg_options`, so its thread count can only be set by constructing it)."""
    from torch.distributed import Backend, ProcessGroupGloo

    if not hasattr(Backend, _ONE_THREAD_GLOO.upper()):

        def create(store, rank, size, timeout):
            options = ProcessGroupGloo._Options()
            options._threads = 1
            options._timeout = timeout
            options._devices = [ProcessGroupGloo.create_default_device()]
            return ProcessGroupGloo(store, rank, size, options)

        Backend.register_backend(_ONE_THREAD_GLOO, create, devices=["cpu"])
    return _ONE_THREAD_GLOO


def trace_graph_artifact(name: str, gm) -> None:
    """Emit `gm`'s code as a structured-trace artifact named `name` (seen by `TORCH_TRACE=dir` + tlparse beside
    Dynamo's and AOTAutograd's graphs); free when tracing is off (the payload is built lazily)."""
    from torch._logging._internal import trace_structured_artifact

    trace_structured_artifact(name, "string", payload_fn=lambda: gm.print_readable(print_output=False))


def root_mesh_groups(mesh) -> list[str]:
    """The process groups of every dim of the mesh `mesh` was sliced from (e.g. dp and tp of a (dp, tp) mesh); []
    for a mesh that is its own root and 1-D."""
    root = mesh._get_root_mesh()
    if root.ndim == 1:
        return []
    return [root.get_group(i).group_name for i in range(root.ndim)]


def concatenate_meshes(meshes: list) -> "torch.distributed.device_mesh.DeviceMesh":
    """One mesh of the dims of `meshes` (slices of one root mesh, e.g. mesh["dp"] and mesh["tp"]), in that order:
    what a parameter sharded over dp on top of tensor parallelism lives on (FSDP2 builds the same). Raises
    RuntimeError for meshes of different roots or overlapping dims."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(meshes)


def strided_shard(dim: int, split_factor: int):
    """DTensor's `_StridedShard`: dim-0 sharding over dp of a tensor that tensor parallelism already shards on the
    same dim (how FSDP2 + TP places it, so state dicts and DCP agree with fully_shard)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def dtensor_layout(dtensor: torch.Tensor) -> Any:
    """A DTensor's layout (mesh, placements, global shape and stride: its `DTensorSpec`)."""
    return dtensor._spec


def dtensor_of(local: torch.Tensor, layout: Any) -> torch.Tensor:
    """A DTensor of `local` with `layout` (`dtensor_layout`), no autograd, as `DTensor.to_local`'s backward makes a
    parameter's gradient, without `DTensor.from_local`'s autograd function and checks (a block's backward makes
    ten or more of these while AOTAutograd traces it)."""
    import copy

    from torch.distributed.tensor import DTensor

    return DTensor(local, copy.copy(layout), requires_grad=False)


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding propagation: its entries hold the device meshes they were computed on
    (meshes compare equal by layout, not by process group), so after a process group is destroyed and another made
    in this process, a cached entry would hand out a mesh whose groups no longer exist ("Could not resolve the
    process group registered under the name ..."). Planning several meshes in one process needs this."""
    import torch
    from torch.distributed.tensor import DTensor

    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:  # the C++ dispatch fast path's cache
        clear_native()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    cached = getattr(propagator, "_propagate_tensor_meta_cached", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()


@contextlib.contextmanager
def subgraph_schemas_reused() -> Iterator[None]:
    """While active, `invoke_subgraph`'s schema (which AOTAutograd asks for at every call of a block traced once,
    to refuse input mutation under autograd) is derived once per subgraph and operand metadata instead of at every
    call: torch 2.13 traces the whole subgraph again each time, which made AOTAutograd's joint trace grow with the
    number of blocks. The schema depends on the subgraph's graph and the operands' types alone."""
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP
    from torch._higher_order_ops.utils import FunctionalizeCtxWrapper

    derive = InvokeSubgraphHOP.gen_schema
    schemas: dict[tuple, tuple[weakref.ref, Any]] = {}

    def size(n: Any) -> Any:  # a symbolic size by its expression: one shape environment per compile
        return n if type(n) is int else str(n)

    def operand_key(o: Any) -> tuple | None:
        if isinstance(o, torch.Tensor):
            return (tuple(map(size, o.shape)), tuple(map(size, o.stride())), o.dtype, o.device, o.requires_grad)
        return (size(o),) if isinstance(o, (int, torch.SymInt)) else None

    def reused(self, subgraph, identifier, *operands):
        gm = subgraph.subgraph if isinstance(subgraph, FunctionalizeCtxWrapper) else subgraph
        keys = [operand_key(o) for o in operands]
        if not isinstance(gm, fx.GraphModule) or None in keys:
            return derive(self, subgraph, identifier, *operands)
        key = (id(gm), type(subgraph), identifier, tuple(keys))
        hit = schemas.get(key)
        if hit is not None and hit[0]() is gm:
            return hit[1]
        schema = derive(self, subgraph, identifier, *operands)
        schemas[key] = (weakref.ref(gm), schema)
        return schema

    InvokeSubgraphHOP.gen_schema = reused
    try:
        yield
    finally:
        InvokeSubgraphHOP.gen_schema = derive
