"""torchft's replica recovery with `shard_compile` (examples/train_gpt_ft.py, 2 replica groups x 2 gloo ranks): the
steps lost when a group is lost mid-step, the time from its relaunch to its first committed step, and the step time
with torchft's quorum against plain HSDP (one job, a (2, 2) mesh) on the same 4 ranks, model and per-rank batch.

    .venv/bin/python benchmarks/torchft_recovery.py [--steps 20] [--lost-at 8] [--back-at 12] [--layers 2]
        [--d-model 128] [--runs 2]

The scenario is tests/test_torchft.py's: group 1 exits abruptly before the backward of step --lost-at and is
relaunched at once; group 0 trains on alone and holds before step --back-at until group 1 is back. Step times are
medians over the steps both groups (or, for plain HSDP, all ranks) commit, after the first two; the runs alternate
the two systems.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from harness import free_port  # noqa: E402
from test_torchft import scenario  # noqa: E402


def recovery(tmp: Path, args: argparse.Namespace) -> dict:
    model = ["--layers", str(args.layers), "--d-model", str(args.d_model)]
    out = scenario(tmp, model, steps=args.steps, lost_at=args.lost_at, back_at=args.back_at)
    live, back = out["live.0"], out["back.0"]
    committed = [s for s, c, _, _ in live["rows"] if c]
    first = next(i for i, (_, c, _, _) in enumerate(back["rows"]) if c)
    first_done = back["stamps"][first + 1][2]  # the next quorum, or the end
    starts = [t for where, _, t in live["stamps"]]
    both = [i for i, (s, c, n, _) in enumerate(live["rows"]) if c and n == 2 and s >= args.back_at + 2]
    return dict(
        steps_lost=args.steps - len(set(committed)),
        steps_run_again=sum(not c for _, c, _, _ in live["rows"]),
        relaunch_to_first_commit_s=first_done - out["relaunched"],
        step_s=statistics.median(starts[i + 1] - starts[i] for i in both),
    )


def plain_hsdp_rank(steps: int, layers: int, d_model: int) -> None:
    """One rank of plain HSDP: the GPT of train_gpt_ft.py sharded over (2, 2); prints each step's wall time."""
    import torch
    import torch.distributed as dist
    from gpt import GPT, GPTConfig, gpt_loss, make_batch
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2_compile as fc

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=layers, d_model=d_model)
    model = GPT(cfg)
    for block in model.blocks:
        fc.shard(block, mesh=mesh)
    fc.shard_compile(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rank, part = dist.get_rank(), 2  # the per-rank batch of train_gpt_ft.py's default: 8 over 2 groups x 2 ranks
    for step in range(steps):
        start = time.time()
        opt.zero_grad()
        x, y = make_batch(cfg, 8, cfg.block_size, seed=step)
        gpt_loss(model(x[rank * part : (rank + 1) * part]), y[rank * part : (rank + 1) * part]).backward()
        opt.step()
        dist.barrier()
        if rank == 0:
            print(json.dumps(dict(step=step, s=time.time() - start)), flush=True)
    dist.destroy_process_group()


def plain_hsdp(args: argparse.Namespace) -> float:
    port, ranks = str(free_port()), []
    for rank in range(4):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="4")
        command = [sys.executable, __file__, "--plain-rank", "--steps", str(args.steps), "--layers", str(args.layers)]
        command += ["--d-model", str(args.d_model)]
        ranks.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    lines = ranks[0].communicate(timeout=600)[0].splitlines()
    assert [r.wait(timeout=60) for r in ranks] == [0] * 4
    times = [json.loads(line)["s"] for line in lines if line.startswith("{")]
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lost-at", type=int, default=8)
    parser.add_argument("--back-at", type=int, default=12)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--plain-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_rank:
        plain_hsdp_rank(args.steps, args.layers, args.d_model)
        return
    results = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            ft = recovery(Path(tmp), args)
        results.append(dict(ft, plain_hsdp_step_s=plain_hsdp(args)))
        print(json.dumps(results[-1]), flush=True)
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    print(
        f"\nsteps lost {med['steps_lost']:.0f}, run again {med['steps_run_again']:.0f}; relaunch to first committed "
        f"step {med['relaunch_to_first_commit_s']:.1f} s; step {med['step_s'] * 1e3:.0f} ms with torchft vs "
        f"{med['plain_hsdp_step_s'] * 1e3:.0f} ms plain HSDP ({med['step_s'] / med['plain_hsdp_step_s']:.2f}x)"
    )


if __name__ == "__main__":
    main()
