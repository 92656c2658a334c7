"""Peak RSS per rank, ours (shard + the fsdp2 backend, default CompileConfig) against FSDP2 eager (fully_shard per
block + root), on 2 ranks for the benchmark GPT (8 layers, d 512, vocab 8192, seq 256, global batch 8) and a tiny
2-layer Llama (examples/llama.py:llama_tiny). Each side runs in its own torchrun; fp32 AdamW; one thread per rank.

    .venv/bin/python benchmarks/rss_check.py [--models gpt tiny] [--steps 8] [--phases]

Prints, per model, each side's peak RSS per rank (MiB) and ours / eager; exits 1 when ours exceeds eager's for any
model. --phases also prints the RSS (current and peak) at each phase of one side's run: after the model is built,
after sharding, after the first forward (compiles forward), the first backward (compiles backward), the first
optimizer step, and the last step. Worker mode (under torchrun): --worker SIDE MODEL.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
SIDES = ("fsdp2", "ours")
MODELS = ("gpt", "tiny")


def _rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB."""
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return current / 2**20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def _build(model_name: str):
    """(model, blocks, batch(step) -> (input, loss_fn)) for one rank's share of the global batch."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    rank, world = dist.get_rank(), dist.get_world_size()
    if model_name == "gpt":
        from gpt import GPT, GPTConfig, gpt_loss, make_batch

        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=8192, block_size=256, n_layer=8, n_head=8, d_model=512)
        model, local = GPT(cfg), 8 // world

        def batch(step):
            x, y = make_batch(cfg, 8, 256, seed=step)
            x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
            return x, lambda out: gpt_loss(out, y)

        return model, model.blocks, batch
    from llama import llama_tiny, next_token_loss

    model, (tokens,), _ = llama_tiny(batch=2 * world)
    local = tokens.shape[0] // world

    def batch(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, model.cfg.vocab_size, tokens.shape, generator=g)[rank * local : (rank + 1) * local]
        return x, next_token_loss

    return model, model.layers, batch


def worker(side: str, model_name: str, steps: int) -> None:
    """One side's run (under torchrun): prints one JSON line (rank 0) with each rank's RSS at every phase."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    phases = {}
    model, blocks, batch = _build(model_name)
    phases["built"] = _rss_mib()
    if side == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        import fsdp2_compile as fc

        for block in blocks:
            fc.shard(block)
        fc.shard_compile(model)
    phases["sharded"] = _rss_mib()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(steps):
        x, loss_fn = batch(step)
        loss = loss_fn(model(x))
        if step == 0:
            phases["forward"] = _rss_mib()
        loss.backward()
        if step == 0:
            phases["backward"] = _rss_mib()
        opt.step()
        opt.zero_grad()
        if step == 0:
            phases["optimizer"] = _rss_mib()
    phases["last step"] = _rss_mib()
    mine = torch.tensor([v for pair in phases.values() for v in pair], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if dist.get_rank() == 0:
        names = list(phases)
        result = {
            name: [[round(e[2 * i].item(), 1), round(e[2 * i + 1].item(), 1)] for e in every]
            for i, name in enumerate(names)
        }
        print(json.dumps({"side": side, "model": model_name, "phases": result}), flush=True)
    dist.destroy_process_group()


def run_side(side: str, model_name: str, steps: int, port: int) -> dict:
    """One side's torchrun job; one that dies (fully_shard's eager run on gloo aborts now and then, see run.py) is
    run once more, on another port, and said so on stderr."""
    for attempt in range(2):
        cmd = [
            TORCHRUN,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port + 100 * attempt),
            "--nproc-per-node",
            "2",
            os.path.abspath(__file__),
            "--worker",
            side,
            model_name,
            "--steps",
            str(steps),
        ]
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if not out.returncode and lines:
            return json.loads(lines[-1])
        why = [
            line for line in out.stderr.splitlines() if any(w in line for w in ("terminate called", "Signal", "Error"))
        ]
        print(f"# {side} {model_name} failed (attempt {attempt + 1}): {why[-2:]}", file=sys.stderr, flush=True)
    raise RuntimeError(f"{' '.join(cmd)} failed twice:\n{out.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--steps", type=int, default=8, help="training steps (benchmarks/run.py: 2 + 6)")
    p.add_argument("--phases", action="store_true", help="print RSS per phase too")
    p.add_argument("--worker", nargs=2, metavar=("SIDE", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker, args.steps)
        return
    over, port = False, 29900
    for model_name in args.models:
        peaks = {}
        for side in SIDES:
            port += 1
            r = run_side(side, model_name, args.steps, port)
            peaks[side] = [peak for _, peak in r["phases"]["last step"]]
            if args.phases:
                for phase, ranks in r["phases"].items():
                    shown = "  ".join(
                        f"rank {i}: {cur:7.1f} cur {peak:7.1f} peak" for i, (cur, peak) in enumerate(ranks)
                    )
                    print(f"  {model_name:5s} {side:6s} {phase:10s} {shown}")
        ratio = max(o / e for o, e in zip(peaks["ours"], peaks["fsdp2"]))
        over |= ratio > 1.0
        print(
            f"{model_name:5s} peak RSS per rank (MiB): fsdp2 eager {peaks['fsdp2']}  ours {peaks['ours']}  "
            f"ours / eager {ratio:.3f}x",
            flush=True,
        )
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
