"""Sharded training of a small GPT on CPU/gloo through the compiler pipeline.

    torchrun --nproc-per-node 2 examples/train_gpt.py [--steps 20] [--bf16] [--eager] [--accumulate 2] [--layers 4]
    torchrun --nproc-per-node 4 examples/train_gpt.py --hsdp        # 2 replicas x 2 shards
    torchrun --nproc-per-node 2 examples/train_gpt.py --checkpoint-dir ckpt --checkpoint-every 5

With --checkpoint-dir the run resumes from the checkpoint committed there, if any, and saves the model, AdamW, the
LR scheduler and the step every --checkpoint-every steps and at the end (the data is synthetic: a step's batch is a
function of the step, so the step is the data position, and the data is endless). SIGTERM (a scheduler's notice before SIGKILL; torchrun
passes it on to its workers and kills them 30 s later) stops every rank after the same step, saves, and exits 0.

Prints the loss of every step, then per rank the bytes held (parameters, gradients, AdamW state) against the
unsharded model, and the collectives of every compiled graph (with --accumulate: a forward/backward pair without
gradient sync, and one with it).
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import sys
import threading
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(__file__))
from gpt import GPT, GPTConfig, gpt_loss  # noqa: E402

import fsdp2_compile as fc  # noqa: E402
from fsdp2_compile.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from fsdp2_compile.compiler.graph_records import collectives, compiled_graphs  # noqa: E402


class TrainState:
    """The next step to run; saved with the checkpoint through its state_dict() / load_state_dict()."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def pattern_batch(cfg: GPTConfig, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that follow t[i+1] = (5 t[i] + 3) mod vocab from a random start: learnable, so the loss falls."""
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(seed))
    seq = [start]
    for _ in range(cfg.block_size):
        seq.append((5 * seq[-1] + 3) % cfg.vocab_size)
    data = torch.cat(seq, dim=1)
    return data[:, :-1], data[:, 1:]


def local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if t is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="global batch (split over the ranks)")
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 gradient reduction")
    parser.add_argument("--eager", action="store_true", help="run the sharded module without compiling it")
    parser.add_argument("--hsdp", action="store_true", help="HSDP: shard within pairs of ranks, replicate across")
    parser.add_argument(
        "--accumulate", type=at_least_one, default=1, help="micro-batches per step, gradient sync only on the last"
    )
    parser.add_argument("--layers", type=at_least_one, default=4, help="transformer blocks")
    parser.add_argument("--d-model", type=at_least_one, default=128, help="model width (a multiple of 4, the heads)")
    parser.add_argument("--checkpoint-dir", help="resume from the checkpoint committed here, if any; save here")
    parser.add_argument("--checkpoint-every", type=at_least_one, default=10, help="save every this many steps")
    parser.add_argument(
        "--async-save", action="store_true", help="the saves every --checkpoint-every steps in the background"
    )
    args = parser.parse_args()
    if args.d_model % 4:
        parser.error(f"--d-model must be a multiple of 4 (the heads), got {args.d_model}")
    stop_asked = threading.Event()
    if args.checkpoint_dir:  # SIGTERM: finish the step, agree with the other ranks, save, exit 0
        signal.signal(signal.SIGTERM, lambda signum, frame: stop_asked.set())

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % (world * args.accumulate):  # before any collective: every rank exits alike
        parser.error(
            f"--batch {args.batch} does not split evenly over {world} ranks x --accumulate {args.accumulate} "
            "micro-batches: run on a number of ranks whose product with --accumulate divides --batch (the global "
            "batch, and so the math, stays the same), or change --batch"
        )
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard")) if args.hsdp else None
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4, d_model=args.d_model)
    model = GPT(cfg)
    unsharded = sum(p.numel() * p.element_size() for p in model.parameters())

    mp = (
        fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.bf16
        else fc.MixedPrecisionPolicy()
    )
    for block in model.blocks:
        fc.shard(block, mesh, mp_policy=mp)
    (fc.shard if args.eager else fc.shard_compile)(model, mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))  # 5 steps of warmup
    train = TrainState()
    saved = dict(scheduler=scheduler, train=train)
    if args.checkpoint_dir:
        try:
            load_checkpoint(args.checkpoint_dir, model, opt, extra_state=saved)
            if rank == 0:
                print(f"resumed from {args.checkpoint_dir} at step {train.step}", flush=True)
        except FileNotFoundError:  # nothing committed there yet (every rank alike): start afresh
            pass
        if train.step > args.steps:  # every rank loaded the same step
            parser.error(
                f"--steps {args.steps} is below step {train.step}, where the checkpoint in {args.checkpoint_dir} "
                "resumes (the data is endless: a step's batch is a function of the step); pass --steps above "
                f"{train.step} to train on, or another --checkpoint-dir to start afresh"
            )

    local = args.batch // world
    for step in range(train.step, args.steps):
        x, y = pattern_batch(cfg, args.batch, seed=step)
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        loss = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(args.accumulate), y.chunk(args.accumulate))):
            model.set_requires_gradient_sync(i == args.accumulate - 1)  # reduce once, on the last micro-batch
            micro = gpt_loss(model(xm).float(), ym) / args.accumulate
            micro.backward()
            loss += micro.detach()
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=False)
        train.step = step + 1
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:  # 9 digits tell every float32 apart: runs compare bitwise by their output
            print(f"step {step:3d}  loss {mean.item() / world:.9g}", flush=True)
        if not args.checkpoint_dir:
            continue
        stop = torch.tensor([float(stop_asked.is_set())])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # a rank signalled later than another stops at the same step
        if stop.item() or train.step % args.checkpoint_every == 0 or train.step == args.steps:
            background = args.async_save and not stop.item() and train.step < args.steps
            save_checkpoint(args.checkpoint_dir, model, opt, extra_state=saved, async_save=background)
        if stop.item():
            if rank == 0:
                print(f"SIGTERM: saved at step {train.step} to {args.checkpoint_dir}; exiting", flush=True)
            dist.destroy_process_group()
            return

    params = list(model.parameters())
    state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    mine = dict(
        params=local_bytes(params),
        grads=local_bytes(p.grad for p in params),
        optimizer=local_bytes(state),
        peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    gathered = torch.zeros(world * len(mine), dtype=torch.int64)
    dist.all_gather_single(gathered, torch.tensor(list(mine.values())))
    every = [dict(zip(mine, row.tolist())) for row in gathered.view(world, -1)]
    if rank == 0:
        mib = 2**20
        print(
            f"\nper-rank memory (unsharded model: params {unsharded / mib:.2f} MiB, "
            f"+ grads {unsharded / mib:.2f} MiB, + AdamW state {2 * unsharded / mib:.2f} MiB)"
        )
        for r, m in enumerate(every):
            print(
                f"  rank {r}: params {m['params'] / mib:.2f} MiB  grads {m['grads'] / mib:.2f} MiB  "
                f"AdamW state {m['optimizer'] / mib:.2f} MiB  peak RSS {m['peak_rss'] / mib:.0f} MiB"
            )
        print("\ncollectives of each compiled graph" + (" (eager: none compiled)" if args.eager else ""))
        for record in compiled_graphs():
            counts = defaultdict(lambda: [0, 0])
            for c in collectives(record.gm):
                counts[(c.kind, str(c.dtype).removeprefix("torch."))][0] += 1
                counts[(c.kind, str(c.dtype).removeprefix("torch."))][1] += c.nbytes
            for (kind, dtype), (count, nbytes) in sorted(counts.items()):
                print(f"  {record.kind:8s} {kind:15s} {dtype:9s} x{count:3d}  {nbytes / mib:.2f} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
