"""The host cost of a training step where nothing needs communicating: one process, a world of `--world-size`
ranks (1: gloo; more: torch's fake process group, whose collectives return at once), a GPT whose compute is tiny
(16 layers of d 64, a few tokens), so a step's time is mostly the host's work per op.

    .venv/bin/python benchmarks/host_cost.py [--world-size 8 --layers 16 --runs 6 --steps 20]

Systems: `fsdp2` (`fully_shard` per block and on the root, eager), `fsdp2-compiled` (the same, each block compiled
first with `torch.compile`, Inductor, as torchtitan does), `ours` (`shard` per block, `shard_compile` on the root,
the default `CompileConfig`, whose `compile_cache` is off), `ours-inductor` (`compiler="inductor"`). Each is
built and its first step timed (Inductor's caches in a fresh directory, so the first step compiles cold), then
warmed up; the steps are timed in alternation (`--runs` rounds, the order reversed every other round, `--steps` steps each). Prints one JSON line:
per system the first step and the median over rounds of each round's median step, its ratio to `fsdp2`'s, and for
ours the nodes our emitted forward and backward graphs execute per managed parameter, by kind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="host-cost-inductor-"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT, GPTConfig, gpt_loss, make_batch  # noqa: E402

import fsdp2_compile as fc  # noqa: E402
from fsdp2_compile._torch_private import fake_process_group  # noqa: E402
from fsdp2_compile.compiler.graph_records import compiled_graphs  # noqa: E402
from fsdp2_compile.core.fx_edit import VIEW_OPS  # noqa: E402
from fsdp2_compile.core.ir import ROLE, Role  # noqa: E402

SYSTEMS = ("fsdp2", "fsdp2-compiled", "ours", "ours-inductor")
COMMUNICATION = {Role.ALL_GATHER, Role.REDUCE_SCATTER, Role.ALL_REDUCE, Role.ALL_TO_ALL, Role.WAIT}


def build(system: str, args) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, d_model=args.d_model
    )
    model = GPT(cfg)
    if system.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            if system == "fsdp2-compiled":
                block.compile()
            fully_shard(block)
        fully_shard(model)
    else:
        for block in model.blocks:
            fc.shard(block)
        compiler = "inductor" if system == "ours-inductor" else fc.CompileConfig().compiler
        fc.shard_compile(model, compile_config=fc.CompileConfig(compiler=compiler))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step_seconds(model, opt, x, y) -> float:
    start = time.perf_counter()
    gpt_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def kind_of(node) -> str:
    """compute, communication (collectives and their waits) or bookkeeping (casts, pads, copies, views, the
    passes' own ops) for a node a graph executes."""
    role = node.meta.get(ROLE)
    if role is not None:
        return "communication" if role in COMMUNICATION else "bookkeeping"
    target = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    namespace = getattr(node.target, "namespace", "")
    if namespace == "fsdp2" or target in VIEW_OPS or target in ("getitem", "_to_copy", "clone", "copy_"):
        return "bookkeeping"
    return "compute"


def count_nodes(gm: torch.fx.GraphModule, counts: dict[str, int]) -> None:
    """Add the call_function nodes `gm` executes to `counts` by kind, a called subgraph's (a block traced once)
    at each call."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        subgraph = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if subgraph is not None and subgraph.op == "get_attr":
            count_nodes(getattr(gm, subgraph.target), counts)
        else:
            counts[kind_of(node)] += 1


def ops_per_param(first: int, params: int) -> dict[str, float]:
    """Nodes per managed parameter of the forward and backward graphs compiled since record `first`, by kind
    (as handed to the compiler: Inductor fuses them further)."""
    counts: dict[str, int] = {"compute": 0, "communication": 0, "bookkeeping": 0}
    for record in compiled_graphs()[first:]:
        if record.kind in ("forward", "backward"):
            count_nodes(record.gm, counts)
    return {k: round(v / params, 2) for k, v in counts.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="timed steps per system and round")
    p.add_argument("--runs", type=int, default=6, help="rounds, the systems alternated")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    args = p.parse_args()

    torch.set_num_threads(1)
    if args.world_size == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        fake_process_group(rank=0, world_size=args.world_size)
    built, first_step, ops = {}, {}, {}
    for system in args.systems:
        records = len(compiled_graphs())
        model, opt = built[system] = build(system, args)
        x, y = make_batch(model.cfg, args.batch, args.seq, seed=0)
        first_step[system] = step_seconds(model, opt, x, y)
        if system.startswith("ours"):
            ops[system] = ops_per_param(records, sum(1 for _ in model.parameters()))
        for _ in range(args.warmup):
            step_seconds(model, opt, x, y)
    rounds: dict[str, list[float]] = {system: [] for system in args.systems}
    for r in range(args.runs):
        for system in args.systems if r % 2 == 0 else reversed(args.systems):
            model, opt = built[system]
            rounds[system].append(statistics.median(step_seconds(model, opt, x, y) for _ in range(args.steps)))
    median = {system: statistics.median(seconds) for system, seconds in rounds.items()}
    anchor = median.get("fsdp2")
    print(
        json.dumps(
            dict(
                world_size=args.world_size,
                layers=args.layers,
                d_model=args.d_model,
                median_step_ms={s: round(v * 1e3, 3) for s, v in median.items()},
                vs_fsdp2={s: round(v / anchor, 3) for s, v in median.items()} if anchor else None,
                first_step_s={s: round(v, 2) for s, v in first_step.items()},
                ops_per_param=ops,
                rounds_ms={s: [round(v * 1e3, 3) for v in seconds] for s, seconds in rounds.items()},
            )
        ),
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
