"""Every private torch API the project uses, wrapped in one place: the project's boundary to torch's internals."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

__all__ = [
    "all_gather_single",
    "ALLOW_UNSUPPORTED_TORCH",
    "aot_module_simplified",
    "as_boxed",
    "autograd_cache_counts",
    "boxed_call",
    "check_torch_version",
    "check_torchao_version",
    "checkpoint_wrapped_module",
    "checkpoint_wrapper",
    "CheckpointPolicy",
    "CheckpointWrapper",
    "clear_dtensor_caches",
    "compile_times",
    "concatenate_meshes",
    "current_compile_context",
    "current_compile_id",
    "default_reduce_dtype",
    "default_store",
    "detect_fake_mode",
    "disable_torch_function_subclass",
    "dtensor_layout",
    "dtensor_of",
    "dynamo_input_name",
    "efficient_attention",
    "fake_output_by_meta_kernel",
    "fake_process_group",
    "FakeScriptObject",
    "flash_attention",
    "float8_weight_cast",
    "float8_weight_data",
    "forget_compiled_code",
    "FullyShardStateView",
    "functional_collectives",
    "gradient_reduction_handle_base",
    "group_ranks",
    "group_size",
    "group_timeout",
    "has_post_accumulate_grad_hooks",
    "in_compile_context",
    "inductor_compile",
    "inductor_decompositions",
    "log_softmax_backward",
    "mark_boxed",
    "min_cut_partition",
    "module_call_impl",
    "nested_regions_take_blocks",
    "one_thread_gloo_backend",
    "op_name",
    "op_schema",
    "OpOverload",
    "own_buffers",
    "own_parameters",
    "post_accumulate_grad_hooks",
    "queue_at_backward_end",
    "register_value_type",
    "resolve_group",
    "root_mesh_groups",
    "saved_compile_settings",
    "serializable_graph",
    "serializable_inductor_graph",
    "set_compiled_call_impl",
    "set_fully_shard_state",
    "storage_id",
    "store_keys_under",
    "strided_shard",
    "subgraph_schemas_reused",
    "SUPPORTED_TORCH",
    "SUPPORTED_TORCH_SPEC",
    "SUPPORTED_TORCHAO",
    "SUPPORTED_TORCHAO_SPEC",
    "grads_summed_in_reduce_dtype",
    "to_copy",
    "TorchDispatchMode",
    "trace_graph_artifact",
    "traced_frame_of",
    "tracing_backend",
    "tree_leaves",
    "unsafe_view",
    "UnsupportedTorchError",
    "view_base",
]

SUPPORTED_TORCH = ((2, 13), (2, 16))
"""The torch releases this project supports: (major, minor) from the first, up to and excluding the second."""
SUPPORTED_TORCH_SPEC = ">={}.{},<{}.{}".format(*SUPPORTED_TORCH[0], *SUPPORTED_TORCH[1])
ALLOW_UNSUPPORTED_TORCH = "FSDP2_COMPILE_ALLOW_UNSUPPORTED_TORCH"
"""Set to 1 to run on a torch outside `SUPPORTED_TORCH` with a warning instead of an error."""


# Outside this module the project uses public torch only; tests/test_torch_boundary.py scans the source for any dotted
# path under `torch` with a `_`-prefixed component (`torch._dynamo`, `torch.ops._c10d_functional`,
# `torch.ops.aten._to_copy`) and for private attributes of objects (a tensor's `_post_accumulate_grad_hooks`,
# AOTAutograd's `_boxed_call`, torchao's float8 weights' `_tensor`): those go through the functions here as well. If a
# torch (or torchao) upgrade moves one, this is the only file to change; where supported releases differ, the branch
# is chosen by what the installed torch has (`hasattr`), not by its version string, wherever a feature test exists.
#
# Private APIs change between torch releases without notice, in meaning as well as in name, so a torch outside
# `SUPPORTED_TORCH` (the range pyproject.toml pins) is an error at import: pip enforces the pin, so such a torch was put
# there on purpose (a nightly, `--no-deps`), and FSDP2_COMPILE_ALLOW_UNSUPPORTED_TORCH=1 turns the error into a warning
# for trying one. Every private symbol is resolved by `_resolve`: at import where its module is loaded by then, else at
# first use (Inductor's compiler loads only when compiling with it); a missing one raises `UnsupportedTorchError`
# naming it and the supported range. There are no silent fallbacks. torchao, whose float8 weights' private attributes
# are read here too, is checked against `SUPPORTED_TORCHAO` when a float8 weight is first sharded.
class UnsupportedTorchError(ImportError):
    """The installed torch is outside the supported range, or lacks a private API this project uses."""


def _install_hint() -> str:
    spec = SUPPORTED_TORCH_SPEC
    return f"fsdp2_compile supports torch{spec}: install one (pip install 'torch{spec}')"


def check_torch_version(version: str) -> None:
    """Raise `UnsupportedTorchError` for a torch `version` outside `SUPPORTED_TORCH` (a warning instead with
    FSDP2_COMPILE_ALLOW_UNSUPPORTED_TORCH=1); pre-releases count as their release."""
    _check_release("torch", version, SUPPORTED_TORCH, f"is not supported; {_install_hint()}")


def _check_release(package: str, version: str, supported: tuple, problem: str) -> None:
    """`version` of `package` within `supported` ((major, minor) from, to excluded), else `UnsupportedTorchError`
    saying `problem` (a warning with FSDP2_COMPILE_ALLOW_UNSUPPORTED_TORCH=1)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    low, high = supported
    if match is not None and low <= (int(match[1]), int(match[2])) < high:
        return
    message = f"{package} {version} {problem}"
    if os.environ.get(ALLOW_UNSUPPORTED_TORCH) != "1":
        raise UnsupportedTorchError(f"{message}, or set {ALLOW_UNSUPPORTED_TORCH}=1 to try this one anyway")
    warnings.warn(f"fsdp2_compile: {message} ({ALLOW_UNSUPPORTED_TORCH}=1: trying this one anyway)", stacklevel=3)


def _missing(path: str, cause: BaseException) -> UnsupportedTorchError:
    return UnsupportedTorchError(
        f"fsdp2_compile uses torch's private `{path}`, which torch {torch.__version__} does not provide "
        f"({type(cause).__name__}: {cause}); {_install_hint()}"
    )


def _resolve(path: str) -> Any:
    """The object at `path`, "module:attribute.attribute" (or a module alone), the module imported if it is not
    yet; `UnsupportedTorchError` naming it if there is none."""
    module, _, attributes = path.partition(":")
    try:
        obj = importlib.import_module(module)
        for name in filter(None, attributes.split(".")):
            obj = getattr(obj, name)
    except (ImportError, AttributeError) as e:
        raise _missing(path.replace(":", "."), e) from e
    return obj


def _attribute(obj: Any, name: str) -> Any:
    """`obj.name` for a private attribute that torch sets on instances; `UnsupportedTorchError` if there is none."""
    try:
        return getattr(obj, name)
    except AttributeError as e:
        raise _missing(f"{type(obj).__module__}.{type(obj).__qualname__}.{name}", e) from e


check_torch_version(torch.__version__)
_TORCH_RELEASE = tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
"""(major, minor) of the installed torch: where an older torch (FSDP2_COMPILE_ALLOW_UNSUPPORTED_TORCH=1) needs
another path, the branch for it is gated on this; the supported path is unchanged."""

nested_regions_take_blocks = _TORCH_RELEASE >= (2, 13)
"""Whether `shard` may make identical blocks one nested compile region (`runtime/traced_blocks.py`). Before torch
2.13 Dynamo cannot trace a nested region inside a graph with DTensor inputs (`_collect_fake_inputs`: "Expected
FakeTensor, got DTensor"): each block is traced inline instead, as blocks with tensor parallelism are."""

# Resolved at import (their modules are loaded by these imports, or by `import torch`).
_functorch_config = _resolve("torch._functorch.config")
aot_module_simplified = _resolve("torch._functorch.aot_autograd:aot_module_simplified")
_min_cut_rematerialization_partition = _resolve("torch._functorch.partitioners:min_cut_rematerialization_partition")
detect_fake_mode = _resolve("torch._guards:detect_fake_mode")
is_namedtuple = _resolve("torch.nn.parallel.scatter_gather:_is_namedtuple")
"""Whether an object is a namedtuple, whose class takes its fields as arguments (`fully_shard`'s input casts ask)."""
FakeScriptObject = _resolve("torch._library.fake_class_registry:FakeScriptObject")

OpOverload = _resolve("torch._ops:OpOverload")
"""The type of one overload of an operator (`torch.ops.aten.mm.default`): what an fx `call_function` op node calls."""
TorchDispatchMode = _resolve("torch.utils._python_dispatch:TorchDispatchMode")
"""Base class of a mode that sees every op call below autograd (`__torch_dispatch__`)."""
tree_leaves = _resolve("torch.utils._pytree:tree_leaves")
"""The leaves of a nested structure of lists, tuples and dicts, in order."""
disable_torch_function_subclass = _resolve("torch._C:DisableTorchFunctionSubclass")
"""Context manager: while active, tensor subclasses' `__torch_function__` is not called."""
CheckpointWrapper = _resolve("torch.distributed.algorithms._checkpoint.checkpoint_wrapper:CheckpointWrapper")
"""The module `checkpoint_wrapper` wraps a module in (activation checkpointing of its forward)."""
checkpoint_wrapper = _resolve("torch.distributed.algorithms._checkpoint.checkpoint_wrapper:checkpoint_wrapper")
"""Wrap a module so that its forward is activation-checkpointed (a `CheckpointWrapper`)."""

_FUNCTIONAL_COLLECTIVES = (
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_to_all_single",
    "wait_tensor",
)
functional_collectives = types.SimpleNamespace(
    **{op: _resolve(f"torch.ops:_c10d_functional.{op}") for op in _FUNCTIONAL_COLLECTIVES}
)
"""The functional collective ops (`_c10d_functional::...`) the project issues and finds in traced graphs: each
returns its result at once and `wait_tensor` waits for it."""
to_copy = _resolve("torch.ops:aten._to_copy")
"""aten's out-of-place copy to another device or dtype (what `Tensor.to` becomes in a traced graph)."""
unsafe_view = _resolve("torch.ops:aten._unsafe_view")
"""aten's view that a traced `reshape` of a fresh tensor becomes."""
efficient_attention = _resolve("torch.ops:aten._scaled_dot_product_efficient_attention")
"""The memory-efficient kernel of `scaled_dot_product_attention`."""
flash_attention = _resolve("torch.ops:aten._scaled_dot_product_flash_attention")
"""The flash kernel of `scaled_dot_product_attention`."""
log_softmax_backward = _resolve("torch.ops:aten._log_softmax_backward_data")
"""The backward of `log_softmax`."""
all_gather_single = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
"""`torch.distributed.all_gather_single(output, input, group=)`: public, but new in torch 2.13, which deprecates its
former name `all_gather_into_tensor` (what an older torch gets)."""
compile_times = _resolve("torch._dynamo.utils:compile_times")
"""Dynamo's and AOTAutograd's compile-time breakdown so far (`compile_times(repr="str")`: a table)."""

# Checked at import: read or patched at use, so that use sees them as they are then.
for _path in (
    "torch:Tensor._post_accumulate_grad_hooks",
    "torch:Tensor._base",
    "torch.nn:Module._call_impl",
    "torch.nn:Module._compiled_call_impl",
    "torch.ops:aten.mm.default._schema",
    "torch._ops:OpOverload._opname",
    "torch.autograd:Variable._execution_engine",
    "torch._dynamo.guards:profile_guard_manager",
    "torch._higher_order_ops.invoke_subgraph:InvokeSubgraphHOP.gen_schema",
    "torch.distributed:ProcessGroup._device_types",
    "torch.distributed:ProcessGroup._get_backend",
    "torch.distributed:ProcessGroupGloo._Options",
    "torch._C._distributed_c10d:Backend.Options._timeout",
    "torch.distributed.device_mesh:DeviceMesh._get_root_mesh",
    "torch.distributed.tensor:DTensor._spec",
    "torch.distributed.tensor:DTensor._op_dispatcher",
):
    _resolve(_path)
for _name in ("_parameters", "_buffers"):  # set on every module by `nn.Module.__init__`
    _attribute(torch.nn.Module(), _name)


grads_summed_in_reduce_dtype = _TORCH_RELEASE >= (2, 15)
"""FSDP2 gives the gathered parameter the reduce dtype as its gradient dtype (torch 2.15 on): a parameter computed
in its own dtype and reduced in a narrower one gets each gradient cast before it is summed with another (a tied
parameter's uses, the micro-batches of an accumulation without sync); before, sums in its own dtype were rounded."""


def default_reduce_dtype(param_dtype: torch.dtype | None, param: torch.Tensor) -> torch.dtype:
    """The dtype the installed torch's `fully_shard` reduces a parameter's gradients in when its policy's
    `reduce_dtype` is None: from torch 2.15 the parameter's own dtype, before it `param_dtype` (else its own)."""
    return param.dtype if _TORCH_RELEASE >= (2, 15) else (param_dtype or param.dtype)


def gradient_reduction_handle_base() -> type:
    """torch's `torch.distributed.fsdp.GradientReductionHandle` (torch 2.15 on: what `FSDPModule.finalize_backward(
    async_op=True)` returns), else `object`."""
    return getattr(torch.distributed.fsdp, "GradientReductionHandle", object)


def op_schema(op: Any) -> torch.FunctionSchema | None:
    """The schema of an operator overload (`torch.ops.aten.mm.default`); None for any other callable."""
    return op._schema if isinstance(op, OpOverload) else None


def op_name(op: OpOverload) -> str:
    """An operator overload's name without namespace and overload (`torch.ops.fsdp2.unshard.default`: "unshard")."""
    return op._opname


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor `tensor` is a view of; None if it is not a view."""
    return tensor._base


def own_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    """`module`'s own parameters by name (not its submodules'): the dict itself, so that assigning an entry replaces a
    parameter without `register_parameter` and its checks (as FSDP2 puts its DTensors in)."""
    return module._parameters


def own_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """`module`'s own buffers by name (not its submodules'): the dict itself, as `own_parameters`."""
    return module._buffers


def module_call_impl(module: torch.nn.Module) -> Callable:
    """What calling `module` runs (hooks, then `forward`) when it is not compiled: what `nn.Module.compile` compiles."""
    return module._call_impl


def set_compiled_call_impl(module: torch.nn.Module, call: Callable) -> None:
    """Make calling `module` run `call` instead of `module_call_impl(module)`, as `nn.Module.compile` does."""
    module._compiled_call_impl = call


def checkpoint_wrapped_module(wrapper: torch.nn.Module) -> torch.nn.Module:
    """The module a `CheckpointWrapper` wraps."""
    return _attribute(wrapper, "_checkpoint_wrapped_module")


def dynamo_input_name(node: fx.Node) -> str | None:
    """The name of the value a Dynamo graph's placeholder `node` stands for (e.g. `L['self'].layers[0].weight`), from
    the `GraphArg` Dynamo records on it; None where there is none (a graph Dynamo did not trace)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    return source.name if source is not None else None


def min_cut_partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's min-cut partitioner without its common-subexpression pass: that pass imports Inductor's pattern
    matcher and lowering (~20 MiB per rank) and leaves our graphs as they were (`lower_unshard` folds repeated
    gathers itself; the GPT's and MLP's graphs came out identical but for one node's name)."""
    with _functorch_config.patch(cse=False):
        return _min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


_FakeTensor = _resolve("torch._subclasses.fake_tensor:FakeTensor")
_in_kernel_invocation_manager = _resolve("torch._subclasses.fake_tensor:in_kernel_invocation_manager")


def fake_output_by_meta_kernel(fn: Callable[..., torch.Tensor], args: tuple, kwargs: dict):
    """`fn(*args, **kwargs)` (an op, or a function of a few ops) on fake inputs, computed as FakeTensorMode
    computes a fake output: by its meta kernels on the inputs seen as meta tensors (a view shares their fake
    storage), then wrapped as their mode's fake tensor, without the mode's per-call dispatch (a fifth of the
    time). None (call the op under the mode instead) where that is not simply so: symbolic sizes, or inputs that
    are not all fake tensors of one mode on one device, or `fn` returns None."""
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    fake_mode = getattr(tensors[0], "fake_mode", None) if tensors else None
    if fake_mode is None or any(
        not isinstance(t, _FakeTensor)
        or t.fake_mode is not fake_mode
        or t.device != tensors[0].device
        or not all(isinstance(d, int) for d in (*t.shape, *t.stride()))
        for t in tensors
    ):
        return None
    with _in_kernel_invocation_manager(fake_mode):
        out = fn(*args, **kwargs)
    if out is None:  # `fn` declined
        return None
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, out, tensors[0].device)


_dynamo_tls = _resolve("torch._dynamo.symbolic_convert:tls")
_innermost_backend = _resolve("torch._dynamo.eval_frame:innermost_backend")


def tracing_backend() -> Callable | None:
    """While Dynamo traces a frame: the backend it will hand the graph to, unwrapped from Dynamo's and
    torch.compile's wrappers (a function, or the `functools.partial` `make_backend` returns); None otherwise."""
    tx = getattr(_dynamo_tls, "current_tx", None)  # set while Dynamo traces a frame, absent otherwise
    if tx is None or tx.output.compiler_fn is None:
        return None
    fn = _innermost_backend(tx.output.compiler_fn)
    return _innermost_backend(getattr(fn, "compiler_fn", fn))  # torch.compile's wrapper holds the backend there


def register_value_type(cls: type) -> type:
    """Register `cls` (hashable, compared by value, with `__fx_repr__`) as an opaque constant type: a custom op may
    take it as an argument, and Dynamo bakes it into the graph as a constant guarded by equality (Note [Opaque
    Objects] in `torch/_library/opaque_object.py`). torch 2.14 renamed the registration (`register_custom_class`,
    `typ="constant"`) and warns at the old names; 2.13 has only those."""
    opaque = _resolve("torch._library.opaque_object")
    if hasattr(opaque, "register_custom_class"):
        opaque.register_custom_class(cls, typ="constant")
    else:
        opaque.register_opaque_type(cls, typ="value")
    return cls


_StorageWeakRef = _resolve("torch.multiprocessing.reductions:StorageWeakRef")


def storage_id(tensor: torch.Tensor) -> int:
    """An id of `tensor`'s storage, shared by its views, unique among live storages (meta tensors' too, whose data
    pointers are all 0)."""
    return _StorageWeakRef(tensor.untyped_storage()).cdata


def has_post_accumulate_grad_hooks(tensor: torch.Tensor) -> bool:
    """Whether `tensor.register_post_accumulate_grad_hook` registered any hook still in place."""
    return bool(tensor._post_accumulate_grad_hooks)


def post_accumulate_grad_hooks(tensor: torch.Tensor) -> list:
    """The hooks `tensor.register_post_accumulate_grad_hook` registered, in order (FSDP2's `foreach_reduce` reads
    the same attribute to run them after its reduce-scatter)."""
    return list((tensor._post_accumulate_grad_hooks or {}).values())


def queue_at_backward_end(callback) -> None:
    """Run `callback` when the running backward pass ends (autograd's engine; FSDP2 queues its own the same way)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def refuse_fsdp_state_reads(cls: type, refusal: Callable[[Any], Exception]) -> None:
    """Make torch's FSDP2 functions that read `fully_shard`'s state from a module of `cls` (through
    `FSDPModule._get_fsdp_state`: `register_fsdp_forward_method`, the FSDP2 memory tracker) raise `refusal(module)`
    instead of torch's `No FSDP state found`."""

    def _get_fsdp_state(self: Any) -> Any:
        raise refusal(self)

    cls._get_fsdp_state = _get_fsdp_state


def fake_process_group(rank: int, world_size: int) -> None:
    """Initialise the default process group with the in-process fake backend (any world size, no peers)."""
    FakeStore = _resolve("torch.testing._internal.distributed.fake_pg:FakeStore")
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


_get_default_store = _resolve("torch.distributed.distributed_c10d:_get_default_store")
_get_default_group = _resolve("torch.distributed.distributed_c10d:_get_default_group")
_get_default_timeout = _resolve("torch.distributed.distributed_c10d:_get_default_timeout")
_resolve_process_group = _resolve("torch.distributed.distributed_c10d:_resolve_process_group")


def default_store():
    """The key-value store of the default process group."""
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
    pg = _get_default_group() if group_name is None else resolve_group(group_name)
    found = []
    for device in pg._device_types:
        try:
            options = pg._get_backend(device).options
        except (AttributeError, RuntimeError):  # a backend without options (e.g. a wrapper): use the default
            continue
        found.append(options._timeout.total_seconds())
    return min(found) if found else _get_default_timeout(torch.distributed.get_backend(pg)).total_seconds()


_CompileContext = _resolve("torch._guards:CompileContext")


def current_compile_id() -> tuple[int, int] | None:
    """(frame, attempt) of the Dynamo compilation in progress: a graph break's continuation is a new frame, a
    recompile (guards failed, e.g. a new input shape) a new attempt of the same frame. None outside Dynamo."""
    cid = _CompileContext.current_compile_id()
    if cid is None or cid.frame_id is None:
        return None
    return cid.frame_id, cid.frame_compile_id


_BackendCompilerFailed = _resolve("torch._dynamo.exc:BackendCompilerFailed")


def traced_frame_of(error: BaseException) -> int | None:
    """The Dynamo frame whose tracing raised `error` (Dynamo sets the compile id on an error of a compilation);
    None for an error of the backend's compiler or raised outside a compilation."""
    cid = getattr(error, "compile_id", None)
    if isinstance(error, _BackendCompilerFailed) or getattr(cid, "frame_id", None) is None:
        return None
    return cid.frame_id


maybe_mark_dynamic = _resolve("torch._dynamo:maybe_mark_dynamic")
"""Dynamo compiles the next graph for this tensor with the dimension symbolic (unless it must specialise it)."""
_TracingContext = _resolve("torch._guards:TracingContext")


def donate_no_saved_tensors() -> None:
    """Called in a forward graph's compiler: its backward frees none of the tensors the forward saved as it runs
    (AOTAutograd's donated buffers), so its graph can be run again (`backward(retain_graph=True)`). torch.compile
    decides this when its backward compiles, at the first backward; a backward compiled with its forward, ahead of
    time, cannot know that run."""
    context = _TracingContext.try_get()
    donated = context.fw_metadata.bw_donated_idxs if context and context.fw_metadata else None
    if donated:
        donated.clear()  # the list the runtime's metadata shares


_compile_context = _resolve("torch._guards:compile_context")


def current_compile_context() -> Any:
    """The Dynamo compilation in progress (what `current_compile_id` reads), or None: to compile more of it later
    under the same id (`in_compile_context`)."""
    return _CompileContext.try_get()


def in_compile_context(context: Any) -> contextlib.AbstractContextManager:
    """Run as part of the compilation `context` (from `current_compile_context`): `current_compile_id` gives its id."""
    return _compile_context(context)


_BoxedCodeGen = _resolve("torch.fx.graph:_BoxedCodeGen")


def boxed_call(gm: fx.GraphModule):
    """`gm` as AOTAutograd's boxed callable, as torch's aot_eager makes it: the generated code takes the list of
    inputs and clears it, so each input (a backward graph's saved activations above all) is freed after its last use
    in the graph instead of living until the graph returns. Changes `gm`'s code in place (`gm.forward` then takes one
    list); `invariants.check_collectives_safe` has already made every collective's inputs outlive its wait."""
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    forward = gm.forward

    def run(args: list):
        return forward(args)

    return mark_boxed(run)


def mark_boxed(fn: Callable[[list], Any]) -> Callable[[list], Any]:
    """Declare `fn` (which takes one list of inputs and clears it) boxed: AOTAutograd then calls it with that list
    (its `_boxed_call` protocol)."""
    fn._boxed_call = True
    return fn


def as_boxed(compiled: Callable) -> Callable[[list], Any]:
    """`compiled` called as AOTAutograd calls a boxed function: with the list of inputs, which it clears (what
    Inductor returns already is; a plain callable is wrapped)."""
    if getattr(compiled, "_boxed_call", False):
        return compiled

    def run(args: list):
        inputs = list(args)
        args.clear()
        return compiled(*inputs)

    return mark_boxed(run)


def inductor_compile(gm, example_inputs, *, is_backward: bool, is_inference: bool):
    """Compile an AOT forward/backward graph with Inductor, without Inductor's own reordering and with the
    collectives pinned in the order the fsdp2 scheduler chose."""
    config = _resolve("torch._inductor.config")
    compile_fx_inner = _resolve("torch._inductor.compile_fx:compile_fx_inner")
    gm = _pin_communication_order(gm)
    with config.patch(reorder_for_peak_memory=False, reorder_for_compute_comm_overlap=False):
        return compile_fx_inner(gm, example_inputs, is_backward=is_backward, is_inference=is_inference)


def _pin_communication_order(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` whose collective starts and waits are each chained to the one before (Inductor's
    `control_deps`), so that fusion cannot move a collective past a wait the scheduler put after it (e.g. a
    reduce-scatter whose input kernel fuses with a later one). `gm` itself stays as the report shows it. Before
    torch 2.13 `control_deps` has no autograd kernel, which Inductor's fake-tensor propagation dispatches to ("could
    not find kernel for HigherOrderOperator control_deps at dispatch key AutogradCPU"): `gm` is returned unpinned,
    and fusion may then move a collective (the same way on every rank: one graph, one deterministic compiler)."""
    if _TORCH_RELEASE < (2, 13):
        return gm
    preserve_node_ordering = _resolve("torch._inductor.fx_passes.control_dependencies:preserve_node_ordering")
    OrderedSet = _resolve("torch.utils._ordered_set:OrderedSet")
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    pinned = fx.GraphModule(gm, graph)
    comm = [
        n for n in graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", "") == "_c10d_functional"
    ]
    preserve_node_ordering(graph, {later: OrderedSet([earlier]) for earlier, later in zip(comm, comm[1:])})
    pinned.recompile()
    return pinned


def inductor_decompositions() -> dict:
    """The decompositions AOTAutograd must apply to graphs meant for Inductor."""
    return _resolve("torch._inductor.decomposition:select_decomp_table")()


def resolve_group(group_name: str):
    """The process group registered under `group_name` (what functional collectives take)."""
    return _resolve_process_group(group_name)


_ONE_THREAD_GLOO = "fsdp2_gloo_one_thread"
_KEY_PREFIX: list[str] = [""]
"""The store-key prefix of the next group `one_thread_gloo_backend` makes (`store_keys_under`)."""


def one_thread_gloo_backend() -> str:
    """The name of a registered backend that is gloo with one worker thread (`init_process_group` and
    `new_group` ignore gloo's `pg_options`, so its thread count can only be set by constructing it)."""
    from torch.distributed import Backend, PrefixStore, ProcessGroupGloo

    if not hasattr(Backend, _ONE_THREAD_GLOO.upper()):

        def create(store, rank, size, timeout):
            options = ProcessGroupGloo._Options()
            options._threads = 1
            options._timeout = timeout
            options._devices = [ProcessGroupGloo.create_default_device()]
            if _KEY_PREFIX[0]:
                store = PrefixStore(_KEY_PREFIX[0], store)
            return ProcessGroupGloo(store, rank, size, options)

        Backend.register_backend(_ONE_THREAD_GLOO, create, devices=["cpu"])
    return _ONE_THREAD_GLOO


@contextlib.contextmanager
def store_keys_under(prefix: str) -> Iterator[None]:
    """Groups of `one_thread_gloo_backend` made in this block publish their addresses in the store under `prefix`
    (gloo's own keys are a function of the group's name alone, which a restarted attempt reuses: in a store that
    outlived the previous attempt, a rank would read its dead peer's address)."""
    _KEY_PREFIX[0] = prefix
    try:
        yield
    finally:
        _KEY_PREFIX[0] = ""


_trace_structured_artifact = _resolve("torch._logging._internal:trace_structured_artifact")


def trace_graph_artifact(name: str, gm) -> None:
    """Emit `gm`'s code as a structured-trace artifact named `name` (seen by `TORCH_TRACE=dir` + tlparse beside
    Dynamo's and AOTAutograd's graphs); free when tracing is off (the payload is built lazily)."""
    _trace_structured_artifact(name, "string", payload_fn=lambda: gm.print_readable(print_output=False))


def root_mesh_groups(mesh) -> list[str]:
    """The process groups of every dim of the mesh `mesh` was sliced from (e.g. dp and tp of a (dp, tp) mesh); []
    for a mesh that is its own root and 1-D."""
    root = mesh._get_root_mesh()
    if root.ndim == 1:
        return []
    return [root.get_group(i).group_name for i in range(root.ndim)]


_composable_state_key = _resolve("torch.distributed._composable.contract:STATE_KEY")


class FullyShardStateView:
    """What torch's pipeline schedules read of an FSDP2 stage module's state after a step's last backward
    (`_PipelineStageBase.perform_reduce_grad`): `_state_ctx.all_states` (`all_states()`: the views of every state
    under the stage module), each state's `_fsdp_param_groups` and their `post_backward()` (`post_backward`), then
    `_root_post_backward_final_callback()` (nothing: `post_backward` reduced synchronously)."""

    def __init__(self, post_backward: Callable[[], None], all_states: Callable[[], list[FullyShardStateView]]):
        self.post_backward = post_backward
        self._all_states = all_states
        self._fsdp_param_groups = (self,)

    @property
    def _state_ctx(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(all_states=self._all_states())

    def _root_post_backward_final_callback(self) -> None:
        pass


def set_fully_shard_state(module: torch.nn.Module, state: FullyShardStateView) -> None:
    """Make `fully_shard.state(module)` return `state`: what torch's pipeline schedules read of an FSDP2 stage
    module. Not a `fully_shard` registration: the composable-API registry is left as it is."""
    key = torch.distributed.fsdp.fully_shard.__wrapped__  # the function `contract` keys its states by
    module.__dict__.setdefault(_composable_state_key, {})[key] = state


_concatenate_meshes = _resolve("torch.distributed.device_mesh:DeviceMesh._concatenate")


def concatenate_meshes(meshes: list) -> torch.distributed.device_mesh.DeviceMesh:
    """One mesh of the dims of `meshes` (slices of one root mesh, e.g. mesh["dp"] and mesh["tp"]), in that order:
    what a parameter sharded over dp on top of tensor parallelism lives on (FSDP2 builds the same). Raises
    RuntimeError for meshes of different roots or overlapping dims."""
    return _concatenate_meshes(meshes)


_StridedShard = _resolve("torch.distributed.tensor.placement_types:_StridedShard")


def strided_shard(dim: int, split_factor: int):
    """DTensor's `_StridedShard`: dim-0 sharding over dp of a tensor that tensor parallelism already shards on the
    same dim (how FSDP2 + TP places it, so state dicts and DCP agree with fully_shard)."""
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


_clear_native_sharding_cache = _resolve("torch._C:_clear_DTensor_sharding_propagator_cache")


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding propagation: its entries hold the device meshes they were computed on
    (meshes compare equal by layout, not by process group), so after a process group is destroyed and another made
    in this process, a cached entry would hand out a mesh whose groups no longer exist ("Could not resolve the
    process group registered under the name ..."). Planning several meshes in one process needs this."""
    from torch.distributed.tensor import DTensor

    _clear_native_sharding_cache()  # the C++ dispatch fast path's cache
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    _attribute(propagator, "_propagate_tensor_meta_cached").cache_clear()


_InvokeSubgraphHOP = _resolve("torch._higher_order_ops.invoke_subgraph:InvokeSubgraphHOP")
_FunctionalizeCtxWrapper = _resolve("torch._higher_order_ops.utils:FunctionalizeCtxWrapper")


@contextlib.contextmanager
def subgraph_schemas_reused() -> Iterator[None]:
    """While active, `invoke_subgraph`'s schema (which AOTAutograd asks for at every call of a block traced once,
    to refuse input mutation under autograd) is derived once per subgraph and operand metadata instead of at every
    call: torch 2.13 traces the whole subgraph again each time, which made AOTAutograd's joint trace grow with the
    number of blocks. The schema depends on the subgraph's graph and the operands' types alone."""
    derive = _InvokeSubgraphHOP.gen_schema
    schemas: dict[tuple, tuple[weakref.ref, Any]] = {}

    def size(n: Any) -> Any:  # a symbolic size by its expression: one shape environment per compile
        return n if type(n) is int else str(n)

    def operand_key(o: Any) -> tuple | None:
        if isinstance(o, torch.Tensor):
            return (tuple(map(size, o.shape)), tuple(map(size, o.stride())), o.dtype, o.device, o.requires_grad)
        return (size(o),) if isinstance(o, (int, torch.SymInt)) else None

    def reused(self, subgraph, identifier, *operands):
        gm = subgraph.subgraph if isinstance(subgraph, _FunctionalizeCtxWrapper) else subgraph
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

    _InvokeSubgraphHOP.gen_schema = reused
    try:
        yield
    finally:
        _InvokeSubgraphHOP.gen_schema = derive


def _no_node_meta(key: str) -> bool:
    """No node metadata is stored with a saved graph: running it needs none, and some (module stacks naming the
    generated sharded classes, opaque values holding process groups) cannot be pickled."""
    return False


def serializable_graph(gm: fx.GraphModule, wrap: Callable[[Callable], Callable]) -> Callable:
    """`gm` (its code already boxed, `boxed_call`) as an Inductor output code that AOTAutograd's bundled cache entry
    can hold, so torch's AOTAutograd cache can save and load it: `RegionalOutputCode`, pickled by
    `GraphPickler` with every op allowed (ours included) and no node metadata. It runs as `wrap(run)`, here and
    where it is loaded (`wrap` is pickled with it), or here as its `run_here` if one is set."""
    return _wrapped_output_code()(gm, wrap)


def serializable_inductor_graph(compiled: Any, wrap: Callable[[Callable], Callable]) -> Callable:
    """Inductor's `compiled` (a `CompiledFxGraph`), saved and loaded as torch's AOTAutograd cache does, run as
    `serializable_graph`'s are: as `wrap(run)`, or here as its `run_here` if one is set."""
    compiled.__class__ = _wrapped_inductor_code()
    compiled._set_wrap(wrap)
    return compiled


class _RunsWrapped:
    """An output code that runs as `wrap(run)` (`wrap` pickled with it), or in the process that compiled it as
    `run_here` if one is set (not saved)."""

    run_here: Callable | None = None

    def _set_wrap(self, wrap: Callable[[Callable], Callable]) -> None:
        self._wrap = wrap
        self._run = wrap(super().__call__)
        if self._time_taken_ns is None:  # Inductor sets it; torch 2.15's cache lookup reads it from every entry
            self._time_taken_ns = 0

    def __call__(self, inputs: list[Any]) -> Any:
        return (self.run_here or self._run)(inputs)

    def run_saved(self, inputs: list[Any]) -> Any:
        return self._run(inputs)

    def post_compile(self, *args: Any, **kwargs: Any) -> None:
        super().post_compile(*args, **kwargs)
        if self._run is None:
            self._run = self._wrap(super().__call__)

    def prepare_for_serialization(self) -> None:
        super().prepare_for_serialization()
        self._run = self.run_here = None


@functools.cache
def _wrapped_output_code() -> type:
    class WrappedOutputCode(_RunsWrapped, _resolve("torch._inductor.output_code:RegionalOutputCode")):
        def __init__(self, gm: fx.GraphModule, wrap: Callable[[Callable], Callable]):
            super().__init__(gm, ops_filter=None, node_metadata_key_filter=_no_node_meta)
            self._set_wrap(wrap)

    WrappedOutputCode.__module__, WrappedOutputCode.__qualname__ = __name__, "WrappedOutputCode"
    return WrappedOutputCode


@functools.cache
def _wrapped_inductor_code() -> type:
    class WrappedInductorCode(_RunsWrapped, _resolve("torch._inductor.output_code:CompiledFxGraph")):
        pass

    WrappedInductorCode.__module__, WrappedInductorCode.__qualname__ = __name__, "WrappedInductorCode"
    return WrappedInductorCode


def __getattr__(name: str) -> Any:
    if name == "WrappedOutputCode":  # what a saved graph is unpickled as
        return _wrapped_output_code()
    if name == "WrappedInductorCode":
        return _wrapped_inductor_code()
    raise AttributeError(name)


@contextlib.contextmanager
def saved_compile_settings(extra_key: str, functions: Sequence[Callable]) -> Iterator[None]:
    """Inside, `aot_module_simplified` goes through torch's AOTAutograd cache, bundled (the compiled graphs
    themselves are stored, not references to Inductor's cache) and with the backward compiled with the forward: a
    hit loads what a compile of the same key stored; a miss compiles and stores it, if the compiled graphs can be
    saved. `functions` (what the graph may call besides ops and torch's functions) are marked cacheable as torch
    lets a user mark them, each with `extra_key` as its version: the marks are in torch's key, so `extra_key` (what
    the compile depends on beyond the captured graph and its inputs) is too."""
    inductor = _resolve("torch._inductor.config")
    marked = {f"{f.__module__}.{f.__name__}": extra_key for f in functions}
    with inductor.patch(unsafe_marked_cacheable_functions={**inductor.unsafe_marked_cacheable_functions, **marked}):
        with _resolve("torch._functorch.config").patch(
            enable_autograd_cache=True,
            force_autograd_cache=True,
            bundled_autograd_cache=True,
            force_non_lazy_backward_lowering=True,
            strict_autograd_cache=False,
            bypass_autograd_cache_key=False,
        ):
            yield


def autograd_cache_counts() -> dict[str, int]:
    """torch's counts of AOTAutograd cache lookups in this process: "autograd_cache_hit", "autograd_cache_miss",
    "autograd_cache_bypass", "autograd_cache_saved"."""
    return dict(_resolve("torch._dynamo.utils:counters")["aot_autograd"])


_reset_code = _resolve("torch._C._dynamo.eval_frame:reset_code")


def forget_compiled_code(code: Any) -> None:
    """Drop what Dynamo compiled for the code object `code` (its cache entries, with their guards and graphs), as
    `torch._dynamo.reset` does for every code object."""
    _reset_code(code)


def stop_dcp_checkpoint_process() -> None:
    """End DCP's background checkpoint process (`dcp.async_save`'s PROCESS mode), if one runs: it keeps the process
    group of the world it was started in, so a process group initialised again needs a new one (DCP starts it at
    its next PROCESS save). Dropping DCP's reference asks it to exit and joins it (its `__del__`)."""
    executor = _resolve("torch.distributed.checkpoint._async_process_executor")
    if _attribute(executor, "_CHECKPOINT_PROCESS") is not None:
        executor._CHECKPOINT_PROCESS = None


SUPPORTED_TORCHAO = ((0, 18), (0, 19))
"""The torchao releases whose float8 training weights this project gathers: (major, minor) from the first, up to
and excluding the second."""
SUPPORTED_TORCHAO_SPEC = ">={}.{},<{}.{}".format(*SUPPORTED_TORCHAO[0], *SUPPORTED_TORCHAO[1])


def check_torchao_version(version: str) -> None:
    """Raise `UnsupportedTorchError` for a torchao `version` outside `SUPPORTED_TORCHAO` (a warning instead with
    FSDP2_COMPILE_ALLOW_UNSUPPORTED_TORCH=1): float8 gathers read private attributes of torchao's weights."""
    spec = SUPPORTED_TORCHAO_SPEC
    problem = f"is not supported for float8 training; fsdp2_compile supports torchao{spec}: install one "
    _check_release("torchao", version, SUPPORTED_TORCHAO, problem + f"(pip install 'torchao{spec}')")


def _torchao_attribute(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError as e:
        raise UnsupportedTorchError(
            f"fsdp2_compile reads torchao's private `{type(obj).__qualname__}.{name}`, which this torchao does not "
            f"provide ({e}); install torchao{SUPPORTED_TORCHAO_SPEC}"
        ) from e


def float8_weight_cast(weight: torch.Tensor) -> tuple[torch.dtype, Any]:
    """A torchao float8 training weight's (`WeightWithDynamicFloat8CastTensor`) float8 dtype and its layer's matmul
    config: what its `fsdp_pre_all_gather` casts with."""
    return _torchao_attribute(weight, "_dtype"), _torchao_attribute(weight, "_linear_mm_config")


def float8_weight_data(weight: torch.Tensor) -> torch.Tensor:
    """The high-precision tensor a torchao float8 training weight wraps."""
    return _torchao_attribute(weight, "_tensor")
