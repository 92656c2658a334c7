"""Fault-tolerant HSDP with torchft: `shard_compile` shards within a replica group, torchft all-reduces across the
live replica groups, so a job that loses a group keeps training, and the group, relaunched, heals and rejoins.

    pip install -e '.[ft]'
    torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 &         # prints its address; export it:
    export TORCHFT_LIGHTHOUSE=http://$(hostname):29510
    torchrun --nproc-per-node 2 --master-port 29600 examples/train_gpt_ft.py --replica-id 0 &
    torchrun --nproc-per-node 2 --master-port 29700 examples/train_gpt_ft.py --replica-id 1

Each replica group is a torch.distributed job of its own (its own torchrun, store and process group); the model is
sharded over the group's ranks. Each `shard` group gets an all-reduce hook (`set_all_reduce_hook`, as torchtitan
wires torchft) that averages its reduce-scattered gradient over torchft's managed process group: the same rank of
every live group. A step commits (`manager.should_commit()`) only if every collective of it succeeded; a group that
joins behind the others receives the model and optimizer state of a live group (the manager's `state_dict` /
`load_state_dict` functions). The data of a step is split over `--replicas` groups by replica id (a lost group's
part is not trained until it is back). Prints one line per step: the step, whether it committed, how many groups
took part, and the group's loss.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torchft import Manager, ProcessGroupGloo
from torchft.process_group import ManagedProcessGroup

sys.path.insert(0, os.path.dirname(__file__))
from gpt import GPT, GPTConfig, gpt_loss, make_batch  # noqa: E402

import fsdp2_compile as fc  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replica-id", type=int, required=True, help="this replica group's number, from 0")
    parser.add_argument("--replicas", type=int, default=2, help="replica groups the data is split over")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="global batch (split over groups, then ranks)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=30.0, help="torchft's collective and quorum timeout")
    parser.add_argument("--fully-shard", action="store_true", help="torch's fully_shard instead, for comparison")
    return parser.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer, GPTConfig]:
    """The GPT sharded over this replica group's ranks (blocks, then the root), and its AdamW."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)  # every rank of every group starts from the same weights
    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model)
    model = GPT(cfg)
    for block in model.blocks:
        (fully_shard if args.fully_shard else fc.shard)(block, mesh=mesh)
    (fully_shard if args.fully_shard else fc.shard_compile)(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3), cfg


def fault_tolerant(model: torch.nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace) -> Manager:
    """torchft's manager for this rank, the state a recovering group receives, and the hook that all-reduces each
    reduced gradient shard over the live replica groups."""

    def state_dict() -> dict:
        model_state, optim_state = get_state_dict(model, opt)  # this rank's shards (DTensors)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(state: dict) -> None:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout_s)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        use_async_quorum=False,  # the quorum (and a peer's recovery) at each step's start, not beside its forward
        init_sync=False,  # every group starts from the same seed: nothing to send at step 0
        timeout=timedelta(seconds=args.timeout_s),
        quorum_timeout=timedelta(seconds=4 * args.timeout_s),
        replica_id=f"train_gpt_ft_{args.replica_id}",
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
    )
    replicas = ManagedProcessGroup(manager)

    def average_over_replicas(reduced: torch.Tensor) -> None:
        dist.all_reduce(reduced, group=replicas, op=dist.ReduceOp.AVG)

    for module in model.modules():
        if hasattr(module, "set_all_reduce_hook"):  # every shard group (FSDPModule), as torchtitan does
            module.set_all_reduce_hook(average_over_replicas)
    return manager


def train(args: argparse.Namespace, before: Callable[[str, int], None] = lambda where, step: None) -> tuple[list, Any]:
    """Train until the job's step reaches `--steps`; returns the rows printed and the model. `before(where, step)`
    runs before each step's "quorum" and before its "backward" (a test's fault injection)."""
    dist.init_process_group("gloo")
    model, opt, cfg = build(args)
    manager = fault_tolerant(model, opt, args)
    rank, world = dist.get_rank(), dist.get_world_size()
    part = args.batch // (args.replicas * world)
    first = (args.replica_id * world + rank) * part
    rows = []
    while manager.current_step() < args.steps:
        before("quorum", manager.current_step())
        manager.start_quorum()  # a group behind the others loads a live group's state here
        step = manager.current_step()
        opt.zero_grad()
        x, y = make_batch(cfg, args.batch, cfg.block_size, seed=step)
        loss = gpt_loss(model(x[first : first + part]), y[first : first + part])
        before("backward", step)
        loss.backward()  # reduce-scatter in the group, then the hook: the average over the live groups
        committed = manager.should_commit()  # False if a collective of this step failed: it is run again
        if committed:
            opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        rows.append((step, committed, manager.num_participants(), mean.item() / world))
        if rank == 0:
            print(
                f"step {step:3d}  committed {committed!s:5}  groups {rows[-1][2]}  loss {rows[-1][3]:.9g}", flush=True
            )
    manager.shutdown(wait=False)
    return rows, model


if __name__ == "__main__":
    train(parse_args())
    dist.destroy_process_group()
