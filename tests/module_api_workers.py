"""Per-rank jobs for tests/test_module_api.py: FSDP2's module API used the same way on `shard_compile` and on
`fully_shard`, on the GPT of examples/gpt.py; each job returns the losses (averaged over ranks) of both."""

from __future__ import annotations

import torch
import torch.distributed as dist
from models import batch, local_slice, loss_fn, make_model, make_optimizer
from workers import _gpt_steps

import fsdp2_compile as fc
from fsdp2_compile.compiler.graph_records import clear_compiled_graphs, collectives, compiled_graphs
from fsdp2_compile.core.ir import PARAMS, CollectiveArgs, fsdp_collective_kind, nbytes, val

STEPS = 4


def _build(system: str, group_head: bool, **shard_kwargs):
    """The GPT sharded per block (with `shard_kwargs`) then the root; with `group_head`, `[tok_emb, ln_f, lm_head]`
    is one more group (the embedding and the head share their weight: fully_shard wants tied modules in one group)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = make_model("gpt")
    shard = fully_shard if system == "fsdp2" else fc.shard
    for block in model.blocks:
        shard(block, **shard_kwargs)
    if group_head:
        shard([model.tok_emb, model.ln_f, model.lm_head])
    if system == "fsdp2":
        fully_shard(model)
    else:
        fc.shard_compile(model)
    assert isinstance(model, FSDPModule if system == "fsdp2" else fc.FSDPModule)
    return model


def module_api(rank: int, world_size: int, feature: str) -> dict:
    """`feature`: "list_group" ([tok_emb, ln_f, lm_head] sharded as one group); "reshard_setter"
    (set_reshard_after_forward(False) on the root after the first step); "unshard_calls" (explicit prefetch lists
    between the blocks, then unshard(async_op=True) / wait / reshard and set_is_last_backward around every
    step)."""
    out = {}
    for system in ("fsdp2", "ours"):
        clear_compiled_graphs()
        model = _build(system, group_head=feature == "list_group")
        opt = make_optimizer(model)
        if feature == "unshard_calls":
            model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
            model.blocks[1].set_modules_to_backward_prefetch([model.blocks[0]])
        losses = []
        for i in range(STEPS):
            if feature == "reshard_setter" and i == 1:
                model.set_reshard_after_forward(False)
            if feature == "unshard_calls":
                model.set_is_last_backward(True)
                handle = model.unshard(async_op=True)
                handle.wait()
            losses += _gpt_steps(model, opt, dist.get_rank(), dist.get_world_size(), [i])
            if feature == "unshard_calls":
                model.reshard()
        out[system] = losses
        if system == "ours":
            out["graphs"] = [
                (r.kind, [(c.kind, tuple(sorted({p.split(".")[0] for p in c.params}))) for c in collectives(r.gm)])
                for r in compiled_graphs()
            ]
    return out


def reshard_to_smaller_group(rank: int, world_size: int, size: int) -> dict:
    """`reshard_after_forward=size` on the blocks (an int: reshard to groups of `size` ranks after forward):
    both systems' losses, and our compiled graphs' collectives with their group sizes and the bytes forward
    saves for backward."""
    out = {}
    for system in ("fsdp2", "ours"):
        clear_compiled_graphs()
        model = _build(system, group_head=False, reshard_after_forward=size)
        out[system] = _gpt_steps(model, make_optimizer(model), rank, world_size, range(STEPS))
    records = compiled_graphs()
    out["graphs"] = [(r.kind, _collectives_with_group_sizes(r.gm)) for r in records]
    backward = next(r.gm for r in records if r.kind == "backward")
    out["saved_rows_bytes"] = sum(
        nbytes(val(n)) for n in backward.graph.find_nodes(op="placeholder") if n.name.startswith("post_forward")
    )
    regathered = {
        p
        for n in backward.graph.nodes
        if fsdp_collective_kind(n) == "all_gather" and CollectiveArgs.of(n).ranks() == size
        for p in n.meta[PARAMS]
    }
    out["regathered_bytes"] = sum(p.numel() * p.element_size() for k, p in model.named_parameters() if k in regathered)
    return out


def reshard_after_backward(rank: int, world_size: int) -> dict:
    """Gradient accumulation, two micro-batches a step: the first with `set_requires_gradient_sync(False)` and
    `set_reshard_after_backward(False)`, the second with both True; on fully_shard, on ours, and on ours with
    parameters resharded after every backward ("ours_resharding"): the losses of each micro-batch, the
    parameters' full values after the steps, and our compiled graphs' collectives."""
    out = {}
    for system in ("fsdp2", "ours_resharding", "ours"):
        clear_compiled_graphs()
        model = _build("fsdp2" if system == "fsdp2" else "ours", group_head=False)

        def before(micro: int, model=model, system=system) -> None:
            model.set_reshard_after_backward(micro == 1 or system == "ours_resharding")
            model.set_requires_gradient_sync(micro == 1)

        out[system] = _micro_batch_steps(model, rank, world_size, before)
        out[f"{system}_params"] = {k: p.full_tensor() for k, p in model.named_parameters()}
    out["graphs"] = [(r.kind, _collectives_with_group_sizes(r.gm)) for r in compiled_graphs()]
    return out


def cpu_offload(rank: int, world_size: int) -> dict:
    """Every group sharded with `CPUOffloadPolicy` on the CPU mesh: both systems' losses (fully_shard with
    pin_memory=False: pinning needs an accelerator; ours with the default, which skips it without one)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    out = {}
    for system, policy in (("fsdp2", CPUOffloadPolicy(pin_memory=False)), ("ours", CPUOffloadPolicy())):
        model = make_model("gpt")
        shard = fully_shard if system == "fsdp2" else fc.shard
        for block in model.blocks:
            shard(block, offload_policy=policy)
        (fully_shard if system == "fsdp2" else fc.shard_compile)(model, offload_policy=policy)
        out[system] = _gpt_steps(model, make_optimizer(model), rank, world_size, range(STEPS))
    return out


def _micro_batch_steps(model, rank: int, world_size: int, before, before_backward=None) -> list[float]:
    """`STEPS` AdamW steps on the GPT, each of two micro-batches (half the rank's batch, the loss halved), with
    `before(micro)` called before each and `before_backward(micro)` between its forward and its backward; the
    losses of every micro-batch, summed over the ranks."""
    opt = make_optimizer(model)
    losses = []
    for i in range(STEPS):
        x, y = batch("gpt", i)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        for micro in (0, 1):
            before(micro)
            loss = loss_fn("gpt", model(x[micro::2]), y[micro::2]) / 2
            if before_backward is not None:
                before_backward(micro)
            loss.backward()
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def sync_set_after_forward(rank: int, world_size: int) -> dict:
    """Gradient sync switched between each micro-batch's forward and its backward, as torch's pipeline schedules
    do: off for the first micro-batch, on for the second (so each forward ran with the other setting). Both
    systems' losses, and the kinds of the graphs ours compiled."""
    out = {}
    for system in ("fsdp2", "ours"):
        clear_compiled_graphs()
        model = _build(system, group_head=False)
        out[system] = _micro_batch_steps(
            model, rank, world_size, lambda micro: None, lambda micro, m=model: m.set_requires_gradient_sync(micro == 1)
        )
    out["graphs"] = [(r.kind, sum(c.kind == "reduce_scatter" for c in collectives(r.gm))) for r in compiled_graphs()]
    return out


def shard_placement(rank: int, world_size: int) -> dict:
    """`shard_placement_fn`: the blocks' matrices sharded on dim 1 (`Shard(1)`), the rest on dim 0, with
    fully_shard and with fsdp2_compile. Both systems' losses, their parameters' placements and their full values
    after training."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    def on_columns(param):
        return Shard(1) if param.ndim == 2 else None

    out = {}
    for system in ("fsdp2", "ours"):
        model = make_model("gpt")
        for block in model.blocks:
            (fully_shard if system == "fsdp2" else fc.shard)(block, shard_placement_fn=on_columns)
        (fully_shard if system == "fsdp2" else fc.shard_compile)(model)
        losses = _gpt_steps(model, make_optimizer(model), rank, world_size, range(STEPS))
        out[system] = dict(
            losses=losses,
            placements={n: tuple(p.placements) for n, p in model.named_parameters()},
            params={n: p.full_tensor() for n, p in model.named_parameters()},
        )
    return out


def _collectives_with_group_sizes(gm) -> list[tuple[str, int, tuple[str, ...]]]:
    """(kind, group size, the groups served) of each FSDP collective of `gm`, in graph order."""
    out = []
    for node in gm.graph.nodes:
        kind = fsdp_collective_kind(node)
        if kind is not None:
            groups = sorted(
                {".".join(p.split(".")[:2]) if p.startswith("blocks.") else "root" for p in node.meta[PARAMS]}
            )
            out.append((str(kind), CollectiveArgs.of(node).ranks(), tuple(groups)))
    return out


def divide_factor(rank: int, world_size: int) -> dict:
    """First-step full gradients of the GPT (blocks, then the root, compiled) with the default average and with
    `set_gradient_divide_factor(f)` on every group, for f in (1.0, world_size, 4.0)."""
    grads = {}
    for factor in (None, 1.0, float(world_size), 4.0):
        clear_compiled_graphs()
        model = _build("ours", group_head=False)
        if factor is not None:
            for m in model.modules():
                if isinstance(m, fc.FSDPModule):
                    m.set_gradient_divide_factor(factor)
        x, y = batch("gpt", 0)
        loss_fn("gpt", model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        grads[factor] = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
        if factor == 1.0:
            grads["ops"] = sorted({c.kind for r in compiled_graphs() for c in collectives(r.gm)})
    return grads


def hsdp_accumulation(rank: int, world_size: int) -> dict:
    """HSDP on (replicate=2, shard=2): two micro-batches a step, the first with `set_requires_all_reduce(False)`
    (reduce-scatter only), the second with it; `fully_shard` and ours, the losses (summed over ranks) of each
    micro-batch and the parameters' full values after the steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    for system in ("fsdp2", "ours"):
        clear_compiled_graphs()
        model = make_model("gpt")
        shard = (lambda m: fully_shard(m, mesh=mesh)) if system == "fsdp2" else (lambda m: fc.shard(m, mesh))
        for block in model.blocks:
            shard(block)
        if system == "fsdp2":
            fully_shard(model, mesh=mesh)
        else:
            fc.shard_compile(model, mesh)
        out[system] = _micro_batch_steps(
            model, rank, world_size, lambda micro, m=model: m.set_requires_all_reduce(micro == 1)
        )
        out[f"{system}_params"] = {k: p.full_tensor() for k, p in model.named_parameters()}
        if system == "ours":
            out["graphs"] = [(r.kind, [c.kind for c in collectives(r.gm)]) for r in compiled_graphs()]
    return out


def blocks_traced_once(rank: int, world_size: int, last_block_keeps: bool, compiler: str = "aot_eager") -> dict:
    """The test GPT with 3 blocks, sharded then the root, the last block with `reshard_after_forward=False` when
    `last_block_keeps`, on fully_shard and on ours (`compiler`): both systems' losses; of ours, the block subgraphs
    each graph calls, its all-gathers, and the gathered parameters its forward saves for backward."""
    import dataclasses

    from gpt import GPT
    from models import GPT_CFG
    from torch.distributed.fsdp import fully_shard
    from workers import _saved_gathered_params

    out = {}
    for system in ("fsdp2", "ours"):
        clear_compiled_graphs()
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(GPT_CFG, n_layer=3))
        for i, block in enumerate(model.blocks):
            keep = last_block_keeps and i == len(model.blocks) - 1
            (fully_shard if system == "fsdp2" else fc.shard)(block, reshard_after_forward=not keep)
        if system == "fsdp2":
            fully_shard(model)
        else:
            fc.shard_compile(model, compile_config=fc.CompileConfig(compiler=compiler))
        out[system] = _gpt_steps(model, make_optimizer(model), rank, world_size, range(STEPS))
    graphs = {r.kind: r.gm for r in compiled_graphs()}
    out["calls"] = {
        kind: [
            n.args[1] for n in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
        ]
        for kind, gm in graphs.items()
    }
    out["gathers"] = {kind: sum(c.kind == "all_gather" for c in collectives(gm)) for kind, gm in graphs.items()}
    out["saved_gathered"] = len(_saved_gathered_params(graphs["forward"]))
    return out


def optimizer_in_backward(rank: int, world_size: int, variant: str) -> dict:
    """FSDP2's optimizer in backward: one AdamW per sharded parameter, stepped by a post-accumulate-grad hook on it
    (no `opt.step()` in the loop), on fully_shard, on `fc.shard` alone (eager) and on ours (blocks then the root):
    each system's losses, how many hooks ran and how many of those inside ours' compiled backward (from
    `fsdp2::deliver_grad`; eager runs them when the backward ends), and ours' backward graph's order of
    reductions, their waits and the deliveries. `variant`: "every_step"; "accumulating_unsynced" (two
    micro-batches a step, the first with gradient sync off: FSDP2 then reduces nothing and runs no hook); "hsdp"
    (a (2, world/2) mesh); "hsdp_partial" (the same, the first micro-batch with `set_requires_all_reduce(False)`:
    no hook then either); "bf16" (bf16 parameters, fp32 reduction); "blocks_hooked" (only the blocks' parameters
    have hooks, the root's are stepped by one AdamW after backward); "activation_checkpointing" (blocks in
    `checkpoint_wrapper`)."""
    import traceback

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp2_compile.core.ir import BUCKET, DELIVER_GRAD, WAIT, DeliverGradArgs, Role, WaitArgs

    hsdp = variant.startswith("hsdp")
    mesh = init_device_mesh(
        "cpu", (2, world_size // 2) if hsdp else (world_size,), mesh_dim_names=("replicate", "shard") if hsdp else None
    )
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if variant == "bf16" else {}
    systems = {
        "fsdp2": lambda m: fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(**bf16)),
        "eager": lambda m: fc.shard(m, mesh, mp_policy=fc.MixedPrecisionPolicy(**bf16)),
        "ours": lambda m: fc.shard(m, mesh, mp_policy=fc.MixedPrecisionPolicy(**bf16)),
    }
    out = {}
    for system, shard in systems.items():
        clear_compiled_graphs()
        model = make_model("gpt")
        if variant == "activation_checkpointing":
            for i, block in enumerate(model.blocks):
                model.blocks[i] = checkpoint_wrapper(block)
        for block in model.blocks:
            shard(block)
        if system == "ours":
            fc.shard_compile(model, mesh, mp_policy=fc.MixedPrecisionPolicy(**bf16))
        else:
            shard(model)
        hooked = [p for n, p in model.named_parameters() if variant != "blocks_hooked" or n.startswith("blocks.")]
        rest = [p for p in model.parameters() if all(p is not h for h in hooked)]
        optimizers = {p: torch.optim.AdamW([p], lr=1e-2) for p in hooked}
        after_backward = torch.optim.AdamW(rest, lr=1e-2) if rest else None
        stepped, in_graph = [], []

        def step(p, optimizers=optimizers, stepped=stepped, in_graph=in_graph):
            optimizers[p].step()
            optimizers[p].zero_grad()
            stepped.append(p)
            in_graph.append(any(frame.name == "deliver_grad" for frame in traceback.extract_stack()))

        for p in hooked:
            p.register_post_accumulate_grad_hook(step)
        losses = []
        for i in range(STEPS):
            for micro in (0, 1) if variant in ("accumulating_unsynced", "hsdp_partial") else (1,):
                if variant == "accumulating_unsynced":
                    model.set_requires_gradient_sync(micro == 1)
                if variant == "hsdp_partial":
                    model.set_requires_all_reduce(micro == 1)
                x, y = batch("gpt", 2 * i + micro)
                loss = loss_fn("gpt", model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
                loss.backward()
            if after_backward is not None:
                after_backward.step()
                after_backward.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world_size)
        out[system] = losses
        out[f"{system}_hooks"] = len(stepped)
        out[f"{system}_hooks_in_graph"] = sum(in_graph)
        out[f"{system}_grads_left"] = sum(p.grad is not None for p in model.parameters())
    out["hooked"] = len(hooked)
    backward = [r.gm for r in compiled_graphs() if r.kind == "backward"][-1]
    out["backward"] = []  # (what, bucket) in graph order: "reduce_scatter", "all_reduce", their waits, "deliver"
    reductions = (Role.REDUCE_SCATTER, Role.ALL_REDUCE)
    for n in backward.graph.nodes:
        if n.target is DELIVER_GRAD:
            out["backward"].append(("deliver", DeliverGradArgs.of(n).grad.meta.get(BUCKET)))  # None: unreduced
        elif n.target is WAIT and fsdp_collective_kind(WaitArgs.of(n).tensor) in reductions:
            out["backward"].append((f"{fsdp_collective_kind(WaitArgs.of(n).tensor)} wait", n.meta[BUCKET]))
        elif fsdp_collective_kind(n) in reductions:
            out["backward"].append((str(fsdp_collective_kind(n)), n.meta[BUCKET]))
    out["params"] = len(list(model.parameters()))
    return out


def optimizer_in_backward_changes(rank: int, world_size: int) -> dict:
    """FSDP2's optimizer in backward on fully_shard and on ours, changed while training: 6 steps, block 0 frozen
    (`requires_grad_(False)`) from step 2, the hooks removed from step 4 (then one AdamW steps after backward):
    each system's losses and how many hooks had run after each step."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    for system in ("fsdp2", "ours"):
        model = make_model("gpt")
        for block in model.blocks:
            (fully_shard if system == "fsdp2" else fc.shard)(block)
        (fully_shard if system == "fsdp2" else fc.shard_compile)(model)
        optimizers = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}
        after_backward = torch.optim.AdamW(model.parameters(), lr=1e-2)
        stepped = [0]

        def step(p, optimizers=optimizers, stepped=stepped):
            stepped[0] += 1
            optimizers[p].step()
            optimizers[p].zero_grad()

        handles = [p.register_post_accumulate_grad_hook(step) for p in model.parameters()]
        losses, hooks = [], []
        for i in range(6):
            if i == 2:
                model.blocks[0].requires_grad_(False)
            if i == 4:
                for handle in handles:
                    handle.remove()
            x, y = batch("gpt", i)
            loss = loss_fn("gpt", model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
            loss.backward()
            if i >= 4:
                after_backward.step()
                after_backward.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world_size)
            hooks.append(stepped[0])
        out[system] = losses
        out[f"{system}_hooks"] = hooks
    out["frozen"] = len(list(model.blocks[0].parameters()))
    out["params"] = len(list(model.parameters()))
    return out


def sum_only_reductions(rank: int, world_size: int, reduce_dtype: torch.dtype, force_sum: bool, hsdp: bool) -> dict:
    """The GPT with `set_gradient_divide_factor(3.0)` on every group (3: a division that rounds) and
    `set_force_sum_reduction_for_comms(force_sum)`, gradients reduced in `reduce_dtype` (not fp32 / bf16: FSDP2
    divides before and after a sum), on a 1-D mesh or with `hsdp` a (replicate 2, shard 2) one: both systems'
    losses, the parameters' full values after the steps, and how many divisions our compiled backwards hold."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(
        "cpu", (2, world_size // 2) if hsdp else (world_size,), mesh_dim_names=("replicate", "shard") if hsdp else None
    )
    out = {}
    for system in ("fsdp2", "ours"):
        clear_compiled_graphs()
        model = make_model("gpt")
        mp = (MixedPrecisionPolicy if system == "fsdp2" else fc.MixedPrecisionPolicy)(reduce_dtype=reduce_dtype)
        shard = fully_shard if system == "fsdp2" else fc.shard
        for block in model.blocks:
            shard(block, mesh=mesh, mp_policy=mp)
        (fully_shard if system == "fsdp2" else fc.shard_compile)(model, mesh=mesh, mp_policy=mp)
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_gradient_divide_factor(3.0)
                m.set_force_sum_reduction_for_comms(force_sum)
        opt = make_optimizer(model)
        out[system] = _gpt_steps(model, opt, rank, world_size, range(STEPS))
        out[f"{system}_params"] = {k: p.full_tensor() for k, p in model.named_parameters()}
    out["divisions"] = sum(
        1
        for r in compiled_graphs()
        if r.kind == "backward"
        for n in r.gm.graph.nodes
        if n.target is torch.ops.aten.div.Tensor
    )
    return out


def aborted_iteration(rank: int, world_size: int) -> dict:
    """The GPT compiled, the steps of `_micro_batch_steps` (the first micro-batch of each with gradient sync off).
    "clean": just that; "reset": first an accumulation that fails (a micro-batch with sync off runs its backward, the next one raises
    after its forward), then `reset_iter_state()` on the root and the same steps; "no_reset": the same failure,
    not reset. Per run: the losses and the parameters' full values."""
    out = {}
    for run in ("clean", "reset", "no_reset"):
        model = _build("ours", group_head=False)
        if run != "clean":
            x, y = batch("gpt", 7)
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            model.set_requires_gradient_sync(False)
            loss_fn("gpt", model(x[0::2]), y[0::2]).backward()  # kept unreduced on each rank
            try:
                model(x[1::2])
                raise RuntimeError("injected: the step fails after this forward")
            except RuntimeError:
                if run == "reset":
                    model.reset_iter_state()
            model.zero_grad()
        sync_second = lambda micro, m=model: m.set_requires_gradient_sync(micro == 1)  # noqa: E731
        losses = _micro_batch_steps(model, rank, world_size, sync_second)
        out[run] = (losses, {k: p.full_tensor() for k, p in model.named_parameters()})
    return out


def kept_per_optimizer(rank: int, world_size: int) -> dict:
    """Two GPTs, each with its own optimizer, both with `set_reshard_after_backward(False)` ("ours") or both
    resharding after backward ("ours_resharding"). Each step runs forward and backward of both and then steps only
    the first's optimizer; the last step steps the second's too. Returns each system's losses, and for "ours" which
    models still had gathered parameters kept right after the first's optimizer stepped."""
    from fsdp2_compile.core.ops import KEPT_UNSHARDED
    from fsdp2_compile.runtime.param_state import managed_params

    out = {}
    for system in ("ours_resharding", "ours"):
        clear_compiled_graphs()
        models = [_build("ours", group_head=False) for _ in range(2)]
        opts = [make_optimizer(m) for m in models]
        for m in models:
            m.set_reshard_after_backward(system == "ours_resharding")
        losses, kept = [], []
        for i in range(STEPS):
            x, y = batch("gpt", i)
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            for m in models:
                loss = loss_fn("gpt", m(x), y)
                loss.backward()
                losses.append(loss.item())
            opts[0].step()
            opts[0].zero_grad()
            kept.append([any(info.kept_key in KEPT_UNSHARDED for _, _, info in managed_params(m)) for m in models])
            if i == STEPS - 1:
                opts[1].step()
        out[system] = losses
        out[f"{system}_kept"] = kept
        out[f"{system}_forwards"] = [
            [c.kind for c in collectives(r.gm)] for r in compiled_graphs() if r.kind == "forward"
        ]
        out[f"{system}_params"] = [{k: p.full_tensor() for k, p in m.named_parameters()} for m in models]
    return out


def manual_finalization(rank: int, world_size: int, async_op: bool) -> dict:
    """torch 2.15's manual backward finalization, as its pipeline stages drive it: each step's two micro-batches
    with gradient sync off and resharding after backward off, then sync on and `finalize_backward(async_op=...)`
    (and the handle's `wait()`), with `set_keep_unsharded_storage(True)`. Both systems' losses and final shards."""
    out = {}
    for system in ("fsdp2", "ours"):
        model = _build(system, group_head=False)
        model.set_keep_unsharded_storage(True)
        model.set_manual_backward_finalization(True)
        opt = make_optimizer(model)
        losses = []
        for i in range(STEPS):
            x, y = (local_slice(t, rank, world_size) for t in batch("gpt", i))
            model.set_requires_gradient_sync(False)
            model.set_reshard_after_backward(False)
            for micro in (0, 1):
                loss = loss_fn("gpt", model(x[micro::2]), y[micro::2]) / 2
                loss.backward()
                losses.append(loss.item())
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)
            handle = model.finalize_backward(async_op=async_op)
            if async_op:
                handle.wait()
            else:
                assert handle is None
            opt.step()
            opt.zero_grad()
        model.set_manual_backward_finalization(False)
        out[system] = {"losses": losses, "shards": [p.to_local().clone() for p in model.parameters()]}
    return out


def torch_policy(rank: int, world_size: int, override: bool) -> dict:
    """torch's own `MixedPrecisionPolicy` (bfloat16 parameters, float32 reductions; with `override`, torch 2.15's
    `param_dtype_override_fn` keeping the position embedding in float32) given to `fully_shard` and to `shard` /
    `shard_compile`: both systems' losses."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    out = {}
    for system in ("fsdp2", "ours"):
        model = make_model("gpt")
        kept = model.pos_emb.weight  # float32: the sum with the token embedding is float32, cast at each block
        kwargs = {"param_dtype_override_fn": lambda p, kept=kept: p.dtype if p is kept else None} if override else {}
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, **kwargs)
        for block in model.blocks:
            (fully_shard if system == "fsdp2" else fc.shard)(block, mp_policy=policy)
        if system == "fsdp2":
            fully_shard(model, mp_policy=policy)
        else:
            fc.shard_compile(model, mp_policy=policy)
        opt = make_optimizer(model)
        out[system] = _gpt_steps(model, opt, rank, world_size, list(range(STEPS)))
    return out


def all_reduce_hook(rank: int, world_size: int, hsdp: bool) -> dict:
    """4 ranks. `hsdp=False`: FSDP over 2-rank meshes (ranks {0, 1} and {2, 3}, torchft's layout: one replica
    group each) with a hook on every group that averages the reduced shards over the replica group FSDP does not
    know (ranks {0, 2} and {1, 3}); `hsdp=True`: HSDP (replicate 2, shard 2) with a hook averaging over all ranks.
    fully_shard, ours compiled and ours eager: each system's losses, full parameters, and the hook's calls per step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    grid = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    mesh, over = (grid, dist.group.WORLD) if hsdp else (grid["shard"], grid.get_group("replicate"))
    calls = [0]

    def average(reduced: torch.Tensor) -> None:
        calls[0] += 1
        dist.all_reduce(reduced, group=over)  # gloo has no AVG: the sum, then the division
        reduced.div_(dist.get_world_size(over))

    out = {}
    for system in ("fsdp2", "compiled", "eager"):
        clear_compiled_graphs()
        model = make_model("gpt")
        shard = fully_shard if system == "fsdp2" else fc.shard
        for block in model.blocks:
            shard(block, mesh=mesh)
        (fc.shard_compile if system == "compiled" else shard)(model, mesh=mesh)
        for m in model.modules():
            if hasattr(m, "set_all_reduce_hook"):
                m.set_all_reduce_hook(average)
        calls[0] = 0
        out[system] = _gpt_steps(model, make_optimizer(model), rank, world_size, range(STEPS))
        out[f"{system}_calls"] = calls[0] / STEPS
        out[f"{system}_params"] = {k: p.full_tensor() for k, p in model.named_parameters()}
    return out


def narrow_reduce_accumulation(rank: int, world_size: int) -> dict:
    """fp32 parameters reduced in bf16, each step three micro-batches with gradient sync on the last only: FSDP2
    keeps the unsynced gradients in bf16, each sum rounded to it. fully_shard, ours compiled and eager: each
    system's losses and full parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    micro_batches, out = 3, {}
    for system in ("fsdp2", "compiled", "eager"):
        model = make_model("gpt")
        mp = (MixedPrecisionPolicy if system == "fsdp2" else fc.MixedPrecisionPolicy)(reduce_dtype=torch.bfloat16)
        shard = fully_shard if system == "fsdp2" else fc.shard
        for block in model.blocks:
            shard(block, mp_policy=mp)
        (fc.shard_compile if system == "compiled" else shard)(model, mp_policy=mp)
        opt, losses = make_optimizer(model), []
        for i in range(STEPS):
            x, y = batch("gpt", i)
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            for m in range(micro_batches):
                model.set_requires_gradient_sync(m == micro_batches - 1)
                loss = loss_fn("gpt", model(x[m::micro_batches]), y[m::micro_batches]) / micro_batches
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        out[system] = losses
        out[f"{system}_params"] = {k: p.full_tensor() for k, p in model.named_parameters()}
    return out
