"""Sharded training of a small GPT on CPU/gloo through the compiler pipeline.

    torchrun --nproc-per-node 2 examples/train_gpt.py [--steps 20] [--bf16] [--eager] [--accumulate 2]
    torchrun --nproc-per-node 4 examples/train_gpt.py --hsdp        # 2 replicas x 2 shards

Prints the loss of every step, then per rank the bytes held (parameters, gradients, AdamW state) against the
unsharded model, and the collectives of every compiled graph (with --accumulate: a forward/backward pair without
gradient sync, and one with it).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(__file__))
from gpt import GPT, GPTConfig, gpt_loss  # noqa: E402

import fsdp2_compile as fc  # noqa: E402
from fsdp2_compile.compiler.report import collectives, compiled_graphs  # noqa: E402


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
        "--accumulate", type=int, default=1, help="micro-batches per step, gradient sync only on the last"
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard")) if args.hsdp else None
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, d_model=128)
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

    local = args.batch // world
    for step in range(args.steps):
        x, y = pattern_batch(cfg, args.batch, seed=step)
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        loss = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(args.accumulate), y.chunk(args.accumulate))):
            model.set_requires_gradient_sync(i == args.accumulate - 1)  # reduce once, on the last micro-batch
            micro = gpt_loss(model(xm).float(), ym) / args.accumulate
            micro.backward()
            loss += micro.detach()
        opt.step()
        opt.zero_grad(set_to_none=False)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step:3d}  loss {mean.item() / world:.4f}", flush=True)

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
