"""Soak: long runs of the default pipeline, to show that a step is memory-safe and that nothing grows with steps.

    .venv/bin/python benchmarks/soak.py [--runs 3] [--steps 2000] [--malloc-check] [--system ours|fsdp2]

Each run spawns 2 gloo ranks that train the GPT of `examples/train_gpt.py` (4 layers, d_model 128; blocks sharded,
then the root through `shard_compile` with the default `CompileConfig`), all-reducing the loss every step as a
logging loop would.
`--malloc-check` runs the ranks under glibc's `MALLOC_CHECK_=3` and `MALLOC_PERTURB_`: freed memory is filled
with a byte pattern at once, so a collective reading a freed buffer sends garbage (the losses stop matching) or
glibc aborts. `--system fsdp2` runs `fully_shard` instead, and `--compare` runs both and checks the losses bitwise.
Prints, per run: steps done, how it ended (exit code / signal), RSS at step 100 and at the end (growth in %), and
compile counts at step 100 and at the end.
"""

from __future__ import annotations

import argparse
import ast
import faulthandler
import os
import socket
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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _build(system: str, config: dict):
    import fsdp2_compile as fc

    torch.manual_seed(0)
    model = GPT(CFG)
    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        for block in model.blocks:
            fc.shard(block)
        fc.shard_compile(model, compile_config=fc.CompileConfig(**config))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _counts(system: str) -> tuple[int, ...]:
    if system == "fsdp2":
        return ()
    from fsdp2_compile.compiler.graph_records import compile_counts

    c = compile_counts()
    return (c.forward, c.backward, c.inference)


def _rank(rank: int, world: int, port: int, out: str, system: str, steps: int, config: dict) -> None:
    faulthandler.enable()  # an abort or segfault prints the rank's Python stack
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, opt = _build(system, config)
    losses, marks = [], {}
    per_rank = BATCH // world
    for step in range(steps):
        x, y = make_batch(CFG, BATCH, CFG.block_size, seed=step % 512)
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        loss = gpt_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        losses.append(logged.item() / world)
        if step + 1 in (min(100, steps), steps):
            marks[step + 1] = (_rss_bytes(), _counts(system))
        with open(os.path.join(out, f"rank{rank}.step"), "w") as f:
            f.write(str(step + 1))
        if rank == 0 and (step + 1) % 500 == 0:
            print(f"  step {step + 1}", flush=True)
    torch.save(dict(losses=losses, marks=marks), os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_int(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read() or 0)
    except FileNotFoundError:
        return 0


def run(system: str, steps: int, malloc_check: bool, world: int = 2, config: dict | None = None) -> dict:
    """One run on `world` spawned ranks; returns how it ended and rank 0's results (None if it died)."""
    env = {"MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165"} if malloc_check else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # read by glibc when the spawned interpreters start
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as out:
            ctx = mp.start_processes(
                _rank,
                args=(world, _free_port(), out, system, steps, config or {}),
                nprocs=world,
                join=False,
                start_method="spawn",
            )
            codes = []
            for p in ctx.processes:
                p.join()
                codes.append(p.exitcode)
            if any(codes):
                for p in ctx.processes:
                    p.kill()
                done = [_read_int(os.path.join(out, f"rank{r}.step")) for r in range(world)]
                return dict(codes=codes, result=None, steps_done=done, seconds=time.monotonic() - start)
            return dict(codes=codes, result=torch.load(os.path.join(out, "rank0.pt")), seconds=time.monotonic() - start)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--malloc-check", action="store_true", help="MALLOC_CHECK_=3 and MALLOC_PERTURB_ in the ranks")
    parser.add_argument("--system", choices=("ours", "fsdp2"), default="ours")
    parser.add_argument("--compare", action="store_true", help="also run fully_shard once; compare losses bitwise")
    parser.add_argument(
        "--config", default="{}", help="CompileConfig fields as a Python dict, e.g. \"{'prefetch': False}\""
    )
    args = parser.parse_args()
    config = ast.literal_eval(args.config)

    reference = run("fsdp2", args.steps, args.malloc_check)["result"] if args.compare else None
    aborts = 0
    for i in range(args.runs):
        print(
            f"run {i + 1}/{args.runs}: {args.system} {config}, {args.steps} steps, malloc check {args.malloc_check}",
            flush=True,
        )
        ended = run(args.system, args.steps, args.malloc_check, config=config)
        if ended["result"] is None:
            aborts += 1
            print(
                f"  ABORTED: exit codes {ended['codes']} after {ended['seconds']:.0f} s, steps done per rank {ended['steps_done']}"
            )
            continue
        res = ended["result"]
        (rss0, counts0), (rss1, counts1) = res["marks"][min(100, args.steps)], res["marks"][args.steps]
        line = (
            f"  ok in {ended['seconds']:.0f} s; RSS step 100 {rss0 / 2**20:.1f} MiB, end {rss1 / 2**20:.1f} MiB "
            f"({100 * (rss1 - rss0) / rss0:+.2f}%); compiled (fw, bw, inference) {counts0} -> {counts1}; "
            f"last loss {res['losses'][-1]:.6f}"
        )
        if reference is not None:
            same = sum(a == b for a, b in zip(res["losses"], reference["losses"]))
            line += f"; losses bitwise equal to fully_shard at {same}/{args.steps} steps"
        print(line, flush=True)
    print(f"aborts: {aborts} of {args.runs} runs")


if __name__ == "__main__":
    main()
