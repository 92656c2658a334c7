"""Per-rank training jobs run by the distributed tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import gc
import operator
import os

import torch
import torch.distributed as dist
from models import batch, local_slice, loss_fn, make_model, make_optimizer
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp2_compile as fc
from fsdp2_compile.compiler.compile_cache import cache_events
from fsdp2_compile.compiler.graph_records import clear_compiled_graphs, collectives, compiled_graphs

_funcol = torch.ops._c10d_functional


def _mesh(spec: dict):
    """A 1-D mesh over all ranks, or with spec["hsdp"] a 2-D (replicate=2, shard=world/2) one."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if spec.get("hsdp"):
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _shard(model, name: str, spec: dict) -> None:
    options = dict(reshard_after_forward=spec.get("reshard", True), mesh=_mesh(spec))
    if spec.get("param_dtype") is not None:
        options["mp_policy"] = fc.MixedPrecisionPolicy(param_dtype=spec["param_dtype"], reduce_dtype=torch.float32)
    if name == "mlp":
        options["ignored_params"] = [model.scale]
    else:
        for block in model.blocks:  # FSDP2's pattern: blocks first, then the root
            fc.shard(block, **options)
    if spec["mode"] == "compiled":
        fc.shard_compile(model, compile_config=fc.CompileConfig(**spec.get("config", {})), **options)
    else:
        fc.shard(model, **options)


def _saved_gathered_params(fw: torch.fx.GraphModule) -> list[str]:
    """Forward outputs (saved for backward) that are a gathered parameter, possibly through views/casts and through
    the subgraph of a block traced once (an output of its `invoke_subgraph` call that is one of its inputs)."""
    passthrough = {
        torch.ops.aten.t.default,
        torch.ops.aten.view.default,
        torch.ops.aten.slice.Tensor,
        torch.ops.aten.permute.default,
        torch.ops.aten.transpose.int,
        torch.ops.prims.convert_element_type.default,
        torch.ops.aten._to_copy.default,
        torch.ops.aten.alias.default,
        torch.ops.aten.clone.default,
    }
    split = {torch.ops.aten.split_with_sizes_copy.default, torch.ops.aten.split_with_sizes.default}

    def origin(node):
        while isinstance(node, torch.fx.Node) and node.op == "call_function":
            if node.target in passthrough:
                node = node.args[0]
            elif node.target is operator.getitem and node.args[0].target in split:  # a bucket's copy-out
                node = node.args[0].args[0]
            elif node.target is operator.getitem and node.args[0].target is torch.ops.higher_order.invoke_subgraph:
                call, index = node.args
                body = getattr(fw, call.args[0].target)
                inner = origin(body.graph.output_node().args[0][index])
                if inner.op != "placeholder":
                    return inner
                node = call.args[2 + list(body.graph.find_nodes(op="placeholder")).index(inner)]
            else:
                break
        return node

    found = []
    for out in fw.graph.output_node().args[0]:
        node = origin(out)
        if isinstance(node, torch.fx.Node) and node.target is _funcol.wait_tensor.default:
            if node.args[0].target is _funcol.all_gather_into_tensor.default:
                found.append(out.name)
    return found


def _live_unsharded(model, opt) -> list[tuple[int, ...]]:
    """Shapes of live tensors shaped like a sharded parameter's full shape that are not a shard, gradient,
    optimizer state or unmanaged parameter/buffer: gathered parameters (also those autograd saved for backward)."""
    params = dict(model.named_parameters())
    gc.collect()
    full_shapes = {tuple(p.shape) for p in params.values() if isinstance(p, DTensor) and p.to_local().shape != p.shape}
    opt_state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    shards = [*params.values(), *(p.grad for p in params.values()), *opt_state]
    shard_ptrs = {t.to_local().data_ptr() for t in shards if isinstance(t, DTensor)}
    shard_ptrs |= {
        t.data_ptr() for t in [*params.values(), *model.buffers()] if not isinstance(t, DTensor)
    }  # unmanaged
    live = [
        o
        for o in gc.get_objects()
        if type(o) in (torch.Tensor, torch.nn.Parameter)
        and tuple(o.shape) in full_shapes
        and o.data_ptr() not in shard_ptrs
    ]
    return sorted({tuple(o.shape) for o in live})


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def train(rank: int, world_size: int, name: str, spec: dict) -> dict:
    """Train `spec["steps"]` AdamW steps; return global losses and, on rank 0, everything the tests check."""
    clear_compiled_graphs()
    model = make_model(name)
    _shard(model, name, spec)
    opt = make_optimizer(model, foreach=spec.get("foreach"))
    losses = []
    for step in range(spec["steps"]):
        x, y = batch(name, step)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        micro = spec.get("accumulate", 1)
        step_loss = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            if spec.get("no_sync"):  # FSDP2's accumulation: reduce only on the last micro-batch
                model.set_requires_gradient_sync(i == micro - 1)
            loss = loss_fn(name, model(xm), ym) / micro
            loss.backward()
            step_loss += loss.detach()
        if spec.get("clip") is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"], foreach=spec.get("foreach"))
        opt.step()
        opt.zero_grad(set_to_none=spec.get("set_to_none", True))
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world_size)

    # one more forward: what is alive before its backward; then the backward, without zero_grad, so grads exist
    x, y = batch(name, 0)
    loss = loss_fn(name, model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
    live_after_forward = _live_unsharded(model, opt)
    loss.backward()
    del loss
    live_unsharded = _live_unsharded(model, opt)
    params = dict(model.named_parameters())
    opt_state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    full = {k: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for k, p in params.items()}
    result = dict(
        losses=losses,
        full=full,
        live_unsharded=live_unsharded,
        live_after_forward=live_after_forward,
        param_types={
            k: (type(p).__name__, tuple(p.placements) if isinstance(p, DTensor) else None) for k, p in params.items()
        },
        grad_placements={k: tuple(p.grad.placements) for k, p in params.items() if isinstance(p.grad, DTensor)},
        plain_grads=[k for k, p in params.items() if p.grad is not None and not isinstance(p.grad, DTensor)],
        opt_state_all_sharded=all(
            isinstance(v, DTensor) and v.placements == ((Replicate(), Shard(0)) if spec.get("hsdp") else (Shard(0),))
            for v in opt_state
        ),
        local_bytes=dict(
            params=_local_bytes(params.values()),
            grads=_local_bytes(p.grad for p in params.values() if p.grad is not None),
            optimizer=_local_bytes(opt_state),
        ),
        state_dict_types={k: type(v).__name__ for k, v in model.state_dict().items()},
        graphs=[
            dict(
                kind=r.kind,
                collectives=collectives(r.gm),
                saved_gathered=_saved_gathered_params(r.gm) if r.kind == "forward" else [],
            )
            for r in compiled_graphs()
        ],
    )
    result["collective_order"] = [
        (g["kind"], [(c.kind, c.params, c.nbytes) for c in g["collectives"]]) for g in result["graphs"]
    ]
    return result if rank == 0 else dict(losses=losses, collective_order=result["collective_order"])


def mismatched_configs(rank: int, world_size: int) -> str:
    """Rank 1 buckets differently from rank 0: compiling must fail on every rank with a clear error, not hang."""
    model = make_model("gpt")
    for block in model.blocks:
        fc.shard(block)
    fc.shard_compile(model, compile_config=fc.CompileConfig(buckets="shard_calls" if rank == 0 else "none"))
    x, _ = batch("gpt", 0)
    try:
        model(local_slice(x, rank, world_size))
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return str(e)
    return "no error"


def _gpt_for_checkpoint(rank: int, world_size: int, hsdp: bool = False):
    model = make_model("gpt")
    mesh = _mesh(dict(hsdp=hsdp))
    for block in model.blocks:
        fc.shard(block, mesh)
    fc.shard_compile(model, mesh)
    opt = make_optimizer(model)
    return model, opt, lambda i: _gpt_steps(model, opt, rank, world_size, [i])[0]


def _gpt_steps(model, opt, rank: int, world_size: int, steps) -> list[float]:
    """Train the GPT on the global batches of `steps`; return each step's loss averaged over ranks."""
    losses = []
    for i in steps:
        x, y = batch("gpt", i)
        loss = loss_fn("gpt", model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses


def _full_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    return dict(
        params={k: full(v) for k, v in msd.items()},
        optim={f"{k}.{s}": full(v) for k, st in osd["state"].items() for s, v in st.items()},
    )


def checkpoint_save(rank: int, world_size: int, path: str, hsdp: bool = False) -> dict:
    """3 steps, save model + optimizer with DCP, then 2 more steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, step = _gpt_for_checkpoint(rank, world_size, hsdp)
    for i in range(3):
        step(i)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = _full_state(model, opt)
    return dict(saved=saved, losses=[step(i) for i in range(3, 5)])


def checkpoint_load(rank: int, world_size: int, path: str, hsdp: bool = False) -> dict:
    """A fresh model at (maybe) another world size: one step to create optimizer state, load, then steps 3 and 4."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt, step = _gpt_for_checkpoint(rank, world_size, hsdp)
    step(0)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full_state(model, opt)
    return dict(loaded=loaded, losses=[step(i) for i in range(3, 5)])


def _gpt_fsdp2_eager(rank: int, world_size: int, hsdp: bool = False):
    """The same GPT under PyTorch's own FSDP2 (fully_shard per block, then the root): the interop reference."""
    from torch.distributed.fsdp import fully_shard

    model = make_model("gpt")
    mesh = _mesh(dict(hsdp=hsdp))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, make_optimizer(model)


def checkpoint_interop(rank: int, world_size: int, path: str, saver: str, hsdp: bool = False) -> dict:
    """Save with one system (`saver`: "fsdp2" eager or "ours") after 3 steps, load into the other, step 3 and 4."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def train(model, opt, steps):
        return _gpt_steps(model, opt, rank, world_size, steps)

    def build(system):
        if system == "fsdp2":
            return _gpt_fsdp2_eager(rank, world_size, hsdp)
        model, opt, _ = _gpt_for_checkpoint(rank, world_size, hsdp)
        return model, opt

    saver_model, saver_opt = build(saver)
    train(saver_model, saver_opt, range(3))
    msd, osd = get_state_dict(saver_model, saver_opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    continued = train(saver_model, saver_opt, range(3, 5))

    loader_model, loader_opt = build("ours" if saver == "fsdp2" else "fsdp2")
    train(loader_model, loader_opt, range(1))  # creates optimizer state to load into
    msd, osd = get_state_dict(loader_model, loader_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(loader_model, loader_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return dict(continued=continued, loaded=train(loader_model, loader_opt, range(3, 5)))


def full_state_dict_roundtrip(rank: int, world_size: int) -> dict:
    """Export an unsharded state dict on rank 0; load a plain single-device state dict into a sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    model, _, step = _gpt_for_checkpoint(rank, world_size)
    step(0)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    plain = make_model("gpt").state_dict()  # a single-device model's state dict, untrained
    fresh, _, _ = _gpt_for_checkpoint(rank, world_size)
    set_model_state_dict(fresh, plain, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    reloaded = {k: v.full_tensor() for k, v in fresh.state_dict().items()}
    return dict(full=full, reloaded=reloaded)


def meta_init(rank: int, world_size: int) -> dict:
    """Build the GPT on the meta device, shard it, materialise only the shards, initialise them, then train."""
    from models import GPT, GPT_CFG

    with torch.device("meta"):
        model = GPT(GPT_CFG)
    for block in model.blocks:
        fc.shard(block)
    fc.shard_compile(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with fc.sharded_parameters():
        model.init_weights()
    params = dict(model.named_parameters())
    local = {k: (tuple(p.to_local().shape), p.to_local().device.type) for k, p in params.items()}
    full = {k: p.full_tensor() for k, p in params.items()}
    opt = make_optimizer(model)
    x, y = batch("gpt", 0)
    losses = []
    for _ in range(3):
        loss = loss_fn("gpt", model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(local=local, full=full, losses=losses, types={k: type(p).__name__ for k, p in params.items()})


def docs_tp_snippet(rank: int, world_size: int, tp_block: str) -> dict:
    """docs/parallelisms.md's TP block, run as written on examples/llama.py's Llama (dp 2 x tp 2): its gradients
    after one step on the same batch everywhere, compared by the caller with one process's, and each parameter's
    mesh."""
    import copy

    from llama import LLAMA_TINY, Llama, next_token_loss

    torch.manual_seed(0)
    model = Llama(LLAMA_TINY)
    reference = copy.deepcopy(model)
    exec(tp_block, dict(fc=fc, torch=torch, model=model, dp=2, tp=2))
    tokens = torch.randint(0, LLAMA_TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    next_token_loss(model(tokens)).backward()
    next_token_loss(reference(tokens)).backward()
    tp_grad_error = max(
        (p.grad.full_tensor() - reference.get_parameter(k).grad).abs().max().item() for k, p in model.named_parameters()
    )
    tp_meshes = {k: p.device_mesh.mesh_dim_names for k, p in model.named_parameters()}
    return dict(tp_grad_error=tp_grad_error, tp_meshes=tp_meshes)


def other_backend(rank: int, world_size: int, backend: str) -> dict:
    """The GPT sharded per block, then the root (`shard`, not `shard_compile`), compiled with
    `torch.compile(model, backend=backend)`: 3 AdamW steps' losses and parameters, and the warnings the first
    compile gave."""
    import warnings

    model = make_model("gpt")
    for block in model.blocks:
        fc.shard(block)
    fc.shard(model)
    compiled = torch.compile(model, backend=backend)
    opt = make_optimizer(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _gpt_steps(compiled, opt, rank, world_size, range(3))
    torch._dynamo.reset()
    return dict(
        losses=losses,
        params={k: p.full_tensor() for k, p in model.named_parameters()},
        warnings=[str(w.message) for w in caught if "fsdp2_compile" in str(w.message)],
    )


def checkpoint_helpers(rank: int, world_size: int, path: str) -> dict:
    """save_checkpoint after 2 steps; load_checkpoint into a fresh model and optimizer (bit-identical state); then
    load it into models of other configs, which must fail naming the first mismatching entry."""
    from dataclasses import replace

    from models import GPT, GPT_CFG

    from fsdp2_compile.checkpoint import load_checkpoint, save_checkpoint

    model, opt, step = _gpt_for_checkpoint(rank, world_size)
    step(0), step(1)
    save_checkpoint(path, model, opt)
    fresh, fresh_opt, _ = _gpt_for_checkpoint(rank, world_size)
    load_checkpoint(path, fresh, fresh_opt)
    errors = {}
    for label, cfg in (("wider", replace(GPT_CFG, d_model=48)), ("deeper", replace(GPT_CFG, n_layer=3))):
        other = fc.shard_compile(GPT(cfg))
        try:
            load_checkpoint(path, other, make_optimizer(other))
            errors[label] = "no error"
        except ValueError as e:
            errors[label] = str(e)
    return dict(saved=_full_state(model, opt), loaded=_full_state(fresh, fresh_opt), errors=errors)


def unpublished_schedule(rank: int, world_size: int, recompiling: bool = False) -> str:
    """Only rank 0 compiles a graph (as when a data-dependent branch differs): it must raise, not wait forever.
    `recompiling`: as if rank 0 were recompiling a frame (a guard failed there only, e.g. a parameter frozen on
    rank 0 after the first compilation)."""
    from unittest import mock

    import fsdp2_compile.runtime.rank_agreement as agreement
    from fsdp2_compile.compiler.rank_consistency import check_same_schedule

    message = "no error"
    if recompiling:
        mock.patch.object(agreement, "current_compile_id", return_value=(0, 1)).start()
    if rank == 0:
        try:
            check_same_schedule(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)), "forward", timeout_s=2)
        except RuntimeError as e:
            message = str(e)
    dist.barrier()
    return message


def rank_dependent_lengths(rank: int, world_size: int, lengths: list[list[int]], compile_cache: bool = False) -> dict:
    """GPT steps where each rank's sequence length follows its own list (`lengths[rank]`), so ranks recompile
    for new shapes at different steps. Returns this rank's losses, its forward-graph count, its cache events
    (`CompileConfig.compile_cache`) and, on rank 0, the final parameters."""
    model = make_model("gpt")
    for block in model.blocks:
        fc.shard(block)
    fc.shard_compile(model, compile_config=fc.CompileConfig(compile_cache=compile_cache))
    opt = make_optimizer(model)
    losses = []
    for step, seq in enumerate(lengths[rank]):
        x, y = batch("gpt", step)
        loss = loss_fn(
            "gpt", model(local_slice(x, rank, world_size)[:, :seq]), local_slice(y, rank, world_size)[:, :seq]
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    forwards = sum(r.kind == "forward" for r in compiled_graphs())
    with torch.no_grad():
        full = {k: p.full_tensor() for k, p in model.named_parameters()}  # collective: every rank gathers
    saved = cache_events()
    return dict(losses=losses, forwards=forwards, full=full if rank == 0 else None, saved=saved)


def memory_budget_agreement(rank: int, world_size: int, hsdp: bool) -> tuple:
    """`CompileConfig(memory_budget_fraction=0.5)` resolved as `shard_compile` resolves it (`resolve_memory_budget`)
    when each rank sees a different free memory ((rank + 1) x 1000 bytes here): every rank must get the same
    budget, the smallest."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_compile.runtime import free_memory

    free_memory.free_bytes = lambda device_type: (rank + 1) * 1000
    mesh = init_device_mesh("cpu", (2, world_size // 2) if hsdp else (world_size,))
    config = free_memory.resolve_memory_budget(fc.CompileConfig(memory_budget_fraction=0.5), mesh)
    return config.memory_budget_bytes, config.memory_budget_fraction


def remake_process_group(store, prefix: str, rank: int, world_size: int) -> None:
    """Destroy the default process group and make it again, on `store` under `prefix` (keys of its own)."""
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size)


def two_process_group_rounds(rank: int, world_size: int) -> list[list[float]]:
    """In one process per rank, twice: a new GPT (same seed) sharded per block and `shard_compile`d, trained 3
    steps; between the rounds the default process group is destroyed and made again (on the same store). The
    losses of each round."""
    from fsdp2_compile._torch_private import default_store

    store = default_store()
    rounds = []
    for r in range(2):
        if r:
            remake_process_group(store, f"round{r}", rank, world_size)
        model, opt, step = _gpt_for_checkpoint(rank, world_size)
        rounds.append([step(i) for i in range(3)])
    return rounds


def kept_after_models_and_saves(rank: int, world_size: int, models: int, saves: int, path: str) -> dict:
    """`models` MLPs compiled, run for a step and dropped, then `saves` checkpoints of one more: how many entries
    the rank-agreement and step-watch state hold after each phase."""
    from fsdp2_compile.checkpoint import save_checkpoint
    from fsdp2_compile.compiler import rank_consistency, step_watch
    from fsdp2_compile.runtime import rank_agreement

    def kept() -> dict:
        gc.collect()
        frames = sum(len(f) for f in rank_agreement._FRAMES.values())
        return dict(
            agreed=len(rank_agreement._AGREED),
            frames=frames,
            owners=len(rank_consistency._FRAMES_OF),
            counted=len(step_watch._GROUPS),
        )

    for i in range(models):
        model = fc.shard_compile(make_model("mlp"))
        x, y = batch("mlp", i)
        loss_fn("mlp", model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        del model
        if i == 0:
            after_one = kept()
    after_models = kept()
    model = fc.shard(make_model("mlp"))
    for i in range(saves):
        save_checkpoint(os.path.join(path, str(i % 2)), model)
    return dict(after_one=after_one, after_models=after_models, after_saves=kept())
