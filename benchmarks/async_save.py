"""What an async checkpoint costs the training loop, against a sync one.

    .venv/bin/python benchmarks/async_save.py [--saves 10] [--steps-per-save 6] [--checkpointer thread|process]

2 gloo ranks train the benchmark GPT of `examples/train_gpt.py` (4 layers, d_model 128; blocks sharded, then the
root through `shard_compile`) with AdamW. After warm-up, each of `--saves` rounds runs `--steps-per-save` quiet
steps, a sync save, an async one (`async_save=True`) and `--steps-per-save` steps after it, then `wait()`. Rank 0
reports: the median step time with no save and of the steps that started while the async save was in flight, the
median over rounds of their ratio (each round against its own quiet steps, so that the machine's drift cancels),
the median time blocked in `save_checkpoint` for a sync save and for an async one (until the state is copied), how
many steps started with the async save in flight and how long `wait()` then blocked. `--checkpointer process`:
the async saves write through DCP's background process (`AsyncCheckpointerType.PROCESS`), started by a first save
before the rounds.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT, GPTConfig, gpt_loss, make_batch  # noqa: E402

CFG = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, d_model=128)  # examples/train_gpt.py
BATCH = 8


def _rank(rank: int, world: int, port: int, folder: str, saves: int, steps_per_save: int, checkpointer: str) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import fsdp2_compile as fc
    from fsdp2_compile.checkpoint import save_checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        fc.shard(block)
    fc.shard_compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_rank, step_count = BATCH // world, [0]

    def step() -> float:
        x, y = make_batch(CFG, BATCH, CFG.block_size, seed=step_count[0])
        step_count[0] += 1
        start = time.perf_counter()
        gpt_loss(
            model(x[rank * per_rank : (rank + 1) * per_rank]), y[rank * per_rank : (rank + 1) * per_rank]
        ).backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        return time.perf_counter() - start

    for _ in range(5):  # compile, and AdamW's state
        step()
    how = dict(async_save=True, async_checkpointer_type=AsyncCheckpointerType(checkpointer))
    if checkpointer == "process":  # its process starts at the first save
        save_checkpoint(os.path.join(folder, "async"), model, opt, **how).wait()
    quiet, in_flight, ratios, blocked_sync, blocked_async, spans, waits = [], [], [], [], [], [], []
    for _ in range(saves):  # each round: quiet steps, a sync save, an async save and the steps it overlaps
        round_quiet = [step() for _ in range(steps_per_save)]
        start = time.perf_counter()
        save_checkpoint(os.path.join(folder, "sync"), model, opt)
        blocked_sync.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        pending = save_checkpoint(os.path.join(folder, "async"), model, opt, **how)
        blocked_async.append(time.perf_counter() - start)
        round_busy = []
        for _ in range(steps_per_save):
            busy = not pending.done()
            took = step()
            if busy:
                round_busy.append(took)
        start = time.perf_counter()
        pending.wait()
        waits.append(time.perf_counter() - start)
        spans.append(len(round_busy))
        quiet += round_quiet
        in_flight += round_busy
        if round_busy:
            ratios.append(statistics.median(round_busy) / statistics.median(round_quiet))
    if rank == 0:
        ms = lambda values: f"{1e3 * statistics.median(values):.1f} ms"  # noqa: E731
        print(f"step, no save in flight:          {ms(quiet)} (median of {len(quiet)})")
        print(f"step, an async save in flight:    {ms(in_flight)} (median of {len(in_flight)})")
        print(f"  in flight / quiet, per round:   {statistics.median(ratios):.2f}x (median of {len(ratios)} rounds)")
        print(f"blocked in save_checkpoint, sync:  {ms(blocked_sync)} (median of {saves})")
        print(f"blocked in save_checkpoint, async: {ms(blocked_async)} (median of {saves})")
        print(f"steps started in an async save:   {statistics.median(spans)} of {steps_per_save} (median)")
        print(f"blocked in wait() after them:      {ms(waits)} (median of {saves})")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--steps-per-save", type=int, default=6)
    parser.add_argument("--checkpointer", choices=["thread", "process"], default="thread")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(2, port, folder, args.saves, args.steps_per_save, args.checkpointer), nprocs=2)


if __name__ == "__main__":
    main()
