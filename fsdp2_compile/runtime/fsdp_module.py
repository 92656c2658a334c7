"""`FSDPModule`: the class every module passed to `shard` gets mixed in, with FSDP2's methods of the same names and
meanings (settings that change the compiled graph are read while Dynamo traces, so a change recompiles). It derives
from torch's `torch.distributed.fsdp.FSDPModule`, so that torch code that recognises FSDP2 modules (the pipeline
schedules of `torch.distributed.pipelining`) drives these the same way."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.distributed import fsdp

from fsdp2_compile._torch_private import gradient_reduction_handle_base, refuse_fsdp_state_reads
from fsdp2_compile.core.ops import all_reduce_hook_key
from fsdp2_compile.runtime.grad_delivery import discard_pending_hooks
from fsdp2_compile.runtime.param_state import SHARDED_MODULES, ParamInfo, is_sharded, state_of
from fsdp2_compile.runtime.pipeline_stages import reduce_kept_grads

__all__ = ["FSDPModule", "GradientReductionHandle", "UnshardHandle", "noting_size_mismatches"]


def _check_bool(method: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{method}({name}={value!r}): use True or False")


class UnshardHandle(fsdp.UnshardHandle):
    """What `FSDPModule.unshard(async_op=True)` returns; `wait()` returns at once (see `unshard`)."""

    def wait(self) -> None:
        return None


class GradientReductionHandle(gradient_reduction_handle_base()):
    """What `FSDPModule.finalize_backward(async_op=True)` returns; `wait()` returns at once (the reduction ran)."""

    def wait(self) -> None:
        return None


class FSDPModule(fsdp.FSDPModule):
    """The class every module passed to `shard` gets mixed in (`isinstance(m, FSDPModule)`, and torch's
    `FSDPModule`), with FSDP2's methods of the same names and meanings. Settings that change the compiled graph
    (resharding after forward) are read while Dynamo traces, so a change after compilation recompiles (Dynamo
    guards on them) and, set alike on every rank, the ranks agree; gradient sync takes effect in the next backward,
    as in FSDP2 (`compiler/unsynced_backward.py`)."""

    def __new__(cls, *args: object, **kwargs: object):
        # torch's FSDPModule.__new__ builds an instance of the class two places down its subclass's MRO, which is
        # not the user's class here (`sharding._sharded_class`); a module class's usual construction instead
        return object.__new__(cls)

    def _param_infos(self, recurse: bool) -> list[ParamInfo]:
        modules = [m for m in self.modules() if is_sharded(m)] if recurse else [self]
        return list({id(i): i for m in modules for i in state_of(m).infos}.values())

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's gradient-accumulation switch, read when backward runs (as FSDP2 reads it, and torch's pipeline
        schedules set it between a micro-batch's forward and its backward). False: backward reduces no gradient;
        each rank keeps the unsharded gradients of this module's parameters (their `.grad` gets zeros), and the
        next backward with sync on adds them before the reduce-scatter, so micro-batches with sync off, then one
        with it on, equal one large batch. `recurse=False`: only the parameters of this module's own `shard`
        call."""
        _check_bool("set_requires_gradient_sync", "requires_gradient_sync", requires_gradient_sync)
        for info in self._param_infos(recurse):
            info.set_requires_gradient_sync(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """True: forward frees each gathered parameter after use and backward gathers it again; False: forward
        keeps it for backward (no second all-gather, more memory). As in FSDP2, a bool only: an int given to
        `shard` is replaced (True gathers from the whole shard group again)."""
        _check_bool("set_reshard_after_forward", "reshard_after_forward", reshard_after_forward)
        for info in self._param_infos(recurse):
            info.reshard_after_forward, info.auto_reshard = reshard_after_forward, False
            info.post_forward_size, info.post_forward_group_name = 0, ""

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: parameters stay gathered after backward and the next forward gathers nothing (gradient
        accumulation: more memory, less communication); True (the default) frees them. Kept parameters are
        dropped before any optimizer step and by `reshard()`; a change recompiles."""
        _check_bool("set_reshard_after_backward", "reshard_after_backward", reshard_after_backward)
        for info in self._param_infos(recurse):
            info.set_reshard_after_backward(reshard_after_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility with FSDP2-equal results: every compiled backward waits for its own
        reductions before it returns, which is what FSDP2 does on the last backward."""
        _check_bool("set_is_last_backward", "is_last_backward", is_last_backward)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP gradient accumulation with reduce-scatter only: False keeps each backward's reduce-scattered
        gradient on this rank (the parameters' `.grad` get zeros), and the next backward with the all-reduce adds
        them before all-reducing over the replicas. No effect on a 1-D mesh."""
        _check_bool("set_requires_all_reduce", "requires_all_reduce", requires_all_reduce)
        for info in self._param_infos(recurse):
            info.requires_all_reduce = requires_all_reduce
            if not requires_all_reduce and not info.partial_key:
                info.partial_key = info.state_key("/partial")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This module's group (not its children's, as in FSDP2): each rank's gradient is multiplied by 1 / factor
        and the results are summed over the data-parallel ranks (reduce-scatter, then the HSDP all-reduce),
        instead of averaged; a factor equal to the shard group's size on a 1-D mesh is the default average."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"{type(self).__name__}.set_gradient_divide_factor({factor!r}): use a positive number")
        for info in self._param_infos(recurse=False):
            default = info.replicate_size == 1 and factor == info.world_size
            info.grad_divide_factor = "" if default else repr(float(factor))

    set_reduce_scatter_divide_factor = set_gradient_divide_factor

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """This module's group, as in FSDP2: the collectives only sum, the average (or the gradient divide factor)
        is a division after them (`ops.divide_factors`, FSDP2's rule); a change recompiles."""
        _check_bool("set_force_sum_reduction_for_comms", "enable", enable)
        for info in self._param_infos(recurse=False):
            info.force_sum_reduction = enable

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Accepted with FSDP2's results: a compiled backward gathers only the parameters its graph uses (an
        embedding's weight is not gathered again), so False changes nothing."""
        _check_bool("set_unshard_in_backward", "unshard_in_backward", unshard_in_backward)

    def set_post_optim_event(self, event: object) -> None:
        """Accepted with FSDP2's results: a compiled forward's all-gathers are issued in the order of the stream
        it runs on, after the optimizer step that came before it, so there is no event to wait for."""

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """False (FSDP2's default) only: a compiled graph reduces the gradients its ranks all compute; ranks that use
        different parameters compile different graphs, which the rank-consistency check refuses, naming both."""
        _check_bool("set_reduce_scatter_unused_params", "reduce_scatter_unused_params", reduce_scatter_unused_params)
        if reduce_scatter_unused_params:
            raise NotImplementedError(
                f"{type(self).__name__}.set_reduce_scatter_unused_params(True) is not supported by fsdp2_compile: "
                "every rank must use the same parameters in a step (make unused branches run with zero weight instead)"
            )

    def _unsupported(self, method: str, why: str) -> None:
        raise NotImplementedError(f"{type(self).__name__}.{method} is not supported by fsdp2_compile: {why}")

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None] | None, *, stream: object = None) -> None:
        """FSDP2's hook on this module's group (not its children's): after each backward's reduce-scatter (and
        HSDP's all-reduce), `hook(reduced)` may change the reduced gradient shards in place before the division
        after the collectives, as in FSDP2 (e.g. an all-reduce over a replica group FSDP does not know:
        torchft's). A compiled backward calls it once per bucket, on the bucket's flat shards; not after
        backwards with gradient sync or HSDP's all-reduce off. `stream` is accepted for FSDP2 compatibility
        (refused with HSDP, as FSDP2 does); the compiled graph orders the hook after its collectives. Setting
        another hook recompiles; None removes it."""
        if hook is not None and not callable(hook):
            raise TypeError(f"{type(self).__name__}.set_all_reduce_hook(hook={hook!r}): give a function hook(tensor)")
        infos = self._param_infos(recurse=False)
        if stream is not None and any(i.replicate_size > 1 for i in infos):
            raise ValueError(f"{type(self).__name__}.set_all_reduce_hook: stream cannot be set with HSDP (as in FSDP2)")
        key = "" if hook is None else all_reduce_hook_key(hook)
        for info in infos:
            info.all_reduce_hook = key

    def set_custom_all_gather(self, comm: object) -> None:
        self._unsupported("set_custom_all_gather", "the compiler inserts and buckets the all-gathers itself")

    def set_custom_reduce_scatter(self, comm: object) -> None:
        self._unsupported("set_custom_reduce_scatter", "the compiler inserts and buckets the reduce-scatters itself")

    def _no_effect(self, *args: object, **kwargs: object) -> None:
        """FSDP2's communication-buffer and stream settings (`set_reduce_scatter_max_input_buffers`,
        `set_allocate_memory_from_process_group_for_comm`, `set_symm_mem_for_comm`,
        `set_separate_reduce_scatter_group`): accepted; they change no result, and the compiled graph's scheduler
        places its collectives and buffers itself."""

    set_reduce_scatter_max_input_buffers = set_allocate_memory_from_process_group_for_comm = _no_effect
    set_symm_mem_for_comm = set_separate_reduce_scatter_group = _no_effect

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """In forward, issue the all-gathers of `modules`' groups right before this module's group is used (the
        scheduler places the others itself; explicit ones take precedence and ignore the memory budget)."""
        targets = self._prefetch_targets("set_modules_to_forward_prefetch", modules)
        for info in self._param_infos(recurse=False):
            info.prefetch_forward = targets

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """In backward, issue the all-gathers of `modules`' groups right before this module's group is used."""
        targets = self._prefetch_targets("set_modules_to_backward_prefetch", modules)
        for info in self._param_infos(recurse=False):
            info.prefetch_backward = targets

    def _prefetch_targets(self, method: str, modules: object) -> tuple[ParamInfo, ...]:
        if not isinstance(modules, (list, tuple)):
            raise TypeError(
                f"{type(self).__name__}.{method}(modules) takes a list of modules, got {type(modules).__name__}"
            )
        for i, m in enumerate(modules):
            if not isinstance(m, FSDPModule):
                raise TypeError(
                    f"{type(self).__name__}.{method}: modules[{i}] ({type(m).__name__}) was not passed to "
                    "fsdp2_compile.shard; only sharded modules have all-gathers to prefetch"
                )
        return tuple(state_of(m).infos[0] for m in modules if state_of(m).infos)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """FSDP2-equal results without a separate gather: reading `module.weight` outside a compiled forward
        always returns the gathered parameter, and compiled graphs gather (prefetched) inside themselves."""
        _check_bool("unshard", "async_op", async_op)
        return UnshardHandle() if async_op else None

    def reset_iter_state(self) -> None:
        """FSDP2's recovery after an exception aborted a forward or backward: call it on the root (the outermost
        sharded module), then run the next iteration. What the failed iteration left is discarded, as FSDP2
        documents it: gradients kept by `set_requires_gradient_sync(False)` micro-batches (restart the
        accumulation), HSDP shards kept without their all-reduce, parameters kept gathered by
        `set_reshard_after_backward(False)`, optimizer-in-backward hooks queued for a backward that did not end.
        Nothing else outlives a step: a compiled graph that raised drops its gathered parameters with its frame."""
        outer = [m for m in list(SHARDED_MODULES) if m is not self and any(s is self for s in m.modules())]
        if outer:
            raise RuntimeError(
                f"{type(self).__name__}.reset_iter_state must be called on the root sharded module, and this one "
                f"is inside {type(outer[0]).__name__}: call it on the outermost module passed to shard"
            )
        for info in self._param_infos(recurse=True):
            info.discard_iteration()
        discard_pending_hooks(self.parameters())

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """As torch 2.15's FSDP2: with it on, the caller ends the step's backwards with `finalize_backward`; the
        backwards before it run with gradient sync off (as torch's pipeline schedules run them), each rank keeping
        its unsharded gradients, and `finalize_backward` reduces them. A backward with sync on reduces at once, as
        without it."""
        _check_bool("set_manual_backward_finalization", "enabled", enabled)
        self.__dict__["_manual_backward_finalization"] = enabled

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """As torch 2.15's FSDP2: reduce what the backwards since the last reduction kept (gradient sync was off)
        for every sharded module under this one, following the current settings (call it with sync turned back
        on), and free what backward kept gathered; `.grad` then holds the reduced shards. It reduces before it
        returns: `async_op=True` returns a handle whose `wait()` returns at once."""
        _check_bool("finalize_backward", "async_op", async_op)
        states = {id(state_of(m)): state_of(m) for m in self.modules() if is_sharded(m)}
        for state in states.values():
            reduce_kept_grads(state)
        return GradientReductionHandle() if async_op else None

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Accepted with FSDP2's results: a compiled graph allocates and frees its gathered parameters itself (under
        Inductor, in its own memory plan), so there is no unsharded storage to keep between steps."""
        _check_bool("set_keep_unsharded_storage", "keep", keep)

    def reshard(self) -> None:
        """Free what `set_reshard_after_backward(False)` kept gathered for this module's group (nothing else
        stays gathered between steps, see `unshard`)."""
        for info in self._param_infos(recurse=False):
            info.drop_kept()


def noting_size_mismatches(load_state_dict: Callable) -> Callable:
    """`load_state_dict` (a module class's), whose size mismatch keeps torch's message and says what it means for
    a sharded model."""

    @functools.wraps(load_state_dict)
    def noted(self, *args, **kwargs):
        try:
            return load_state_dict(self, *args, **kwargs)
        except RuntimeError as e:
            if "size mismatch" in str(e):
                e.add_note(
                    "fsdp2_compile: a sharded model's state_dict holds each parameter at its full (global) shape, "
                    "whatever the world size: a size mismatch means the checkpoint is of a model with other sizes. "
                    "Build the model with the configuration it was saved from (fsdp2_compile.load_checkpoint "
                    "loads across world sizes, not across model sizes)"
                )
            raise

    return noted


def _no_fsdp_state(module: FSDPModule) -> RuntimeError:
    """What torch's FSDP2 functions that read `fully_shard`'s state get from a module of `shard`: which function to
    use instead."""
    return RuntimeError(
        f"{type(module).__name__} was sharded by fsdp2_compile.shard, which keeps none of fully_shard's state, so "
        "torch's FSDP2 functions that read it (torch.distributed.fsdp.register_fsdp_forward_method) cannot drive "
        "it: use fsdp2_compile.register_fsdp_forward_method(module, method_name) instead"
    )


refuse_fsdp_state_reads(FSDPModule, _no_fsdp_state)
