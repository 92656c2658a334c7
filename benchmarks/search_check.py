"""The planner's search against measured steps on CPU: for the benchmark GPT at 2 ranks, on loopback and on the
1 Gbit/s namespace of `run.py`, plan a grid of the knobs that apply on CPU (reshard_after_forward, prefetch depth,
keep_gathered, memory budget) with the search's own planning (`search.plan_candidates`), pick the fastest predicted,
then measure every configuration and print the predicted and measured table, Spearman's rank correlation between
predicted and measured step times, and how far the pick is from the fastest measured configuration.

    .venv/bin/python benchmarks/search_check.py [--links loopback 1gbit] [--runs 2] [--steps 4] [--per-job 4] [--quick]

Measuring: each run is a series of torchrun jobs, each holding the anchor (FSDP2's defaults: reshard, prefetch 2,
nothing kept) and at most `--per-job` - 1 other configurations (a job of many models skews their figures), each
sharded and compiled with its own CompileConfig and stepped in turn, one step each per round, the order rotated
every round; a configuration's figure is the median of its step times after warm-up divided by the anchor's in the
same job, then the median of those ratios over the runs. Bucket sizes are not in the grid: the planner models one
bucket per block. Prefetch depth 0 is not either: the planner plans it as 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

from run import TORCHRUN, shaped_link  # noqa: E402

PROFILES = {"loopback": "cpu-gloo-loopback", "1gbit": "cpu-gloo-1gbit"}
FULL = dict(layers=8, d_model=512, heads=8, vocab=8192, seq=256, batch=8)
"""The GPT of step_time.py and run.py (tests/cli_factories.py:gpt_bench), global batch 8 at 2 ranks."""
QUICK = dict(layers=2, d_model=256, heads=8, vocab=2048, seq=128, batch=8)
WORLD = 2
MIB = 2**20


def grid(dims: dict) -> list[dict]:
    """The configurations: FSDP2's defaults first (the anchor), then prefetch 1 and 2 x (reshard, keep a quarter,
    half, all of the resharded bytes, no reshard) and two memory budgets at prefetch 2: the window of 3 of the
    largest buckets (`CompileConfig.memory_budget_bytes`), then 2 and 5 blocks' gathered bytes more."""
    out = []
    for pre in (2, 1):
        for reshard, keep in ((None, None), (None, 0.25), (None, 0.5), (None, 1.0), (False, None)):
            out.append(dict(reshard=reshard, prefetch=pre, keep=keep, budget=None))
    d, block = dims["d_model"], block_bytes(dims)
    root = 4 * (dims["vocab"] * d + dims["seq"] * d + 2 * d)  # embeddings (the head is tied) and the last norm
    for extra in (2, 5):
        out.append(dict(reshard=None, prefetch=2, keep=None, budget=3 * max(root, block) + extra * block))
    return out


def name(cfg: dict) -> str:
    words = ["no reshard" if cfg["reshard"] is False else "reshard", f"prefetch {cfg['prefetch']}"]
    if cfg["keep"] is not None:
        words.append(f"keep {cfg['keep']:g}")
    if cfg["budget"] is not None:
        words.append(f"budget {cfg['budget'] / MIB:.1f} MiB")
    return ", ".join(words)


# ---- pure parts (tests/test_search_check.py) ----


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing the average of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation: Pearson's of the ranks (ties averaged), as scipy.stats.spearmanr; None where
    one list is constant (undefined)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"spearman needs two lists of the same length >= 2, got {len(xs)} and {len(ys)}")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    if not vx or not vy:
        return None  # undefined: one list is constant
    return cov / (vx * vy) ** 0.5


def job_groups(n: int, per_job: int) -> list[list[int]]:
    """Rows 1..n-1 split into the groups measured beside the anchor (row 0), at most `per_job` models a job
    (0 or 1: all in one job)."""
    size = per_job - 1 if per_job > 1 else max(n - 1, 1)
    return [list(range(1, n))[k : k + size] for k in range(0, n - 1, size)] or [[]]


def compare(rows: list[dict]) -> dict:
    """From rows with `predicted_s` (the planner's step) and `measured` (step / anchor's step, measured), the pick
    (the row with the least predicted step, the first on a tie, as the search's order), the fastest measured
    row, the pick's gap to it (measured, %) and Spearman's rho; with two runs or more (`measured_runs`), also the
    rho of the first two runs' figures with each other (`runs_rho`): how far the measured ranking repeats itself."""
    pick = min(range(len(rows)), key=lambda i: rows[i]["predicted_s"])
    fastest = min(range(len(rows)), key=lambda i: rows[i]["measured"])
    gap = (rows[pick]["measured"] / rows[fastest]["measured"] - 1) * 100
    rho = spearman([r["predicted_s"] for r in rows], [r["measured"] for r in rows])
    runs = [r.get("measured_runs", []) for r in rows]
    runs_rho = spearman([m[0] for m in runs], [m[1] for m in runs]) if all(len(m) > 1 for m in runs) else None
    return dict(pick=pick, fastest=fastest, gap_pct=gap, rho=rho, runs_rho=runs_rho)


def table(rows: list[dict], anchor: int = 0) -> str:
    """Markdown: each configuration with its predicted step, predicted and measured ratio to the anchor and both
    ranks; the pick marked `*`, the fastest measured `+`."""
    got = compare(rows)
    rp = ranks([r["predicted_s"] for r in rows])
    rm = ranks([r["measured"] for r in rows])
    a = rows[anchor]
    lines = [
        "| configuration | predicted step | predicted vs anchor | measured vs anchor | predicted rank | measured rank |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows):
        mark = ("*" if i == got["pick"] else "") + ("+" if i == got["fastest"] else "")
        lines.append(
            f"| {r['name']}{' ' + mark if mark else ''} | {r['predicted_s']:.3f} s | "
            f"{r['predicted_s'] / a['predicted_s']:.3f} | {r['measured'] / a['measured']:.3f} | {rp[i]:g} | {rm[i]:g} |"
        )
    rho = "undefined (a constant list)" if got["rho"] is None else format(got["rho"], ".2f")
    lines += [
        "",
        f"Spearman rho {rho}; pick ({rows[got['pick']]['name']}) {got['gap_pct']:+.1f}% vs the fastest "
        f"measured ({rows[got['fastest']]['name']}).",
    ]
    if got["runs_rho"] is not None:
        lines.append(f"The first two runs' rankings agree with each other at rho {got['runs_rho']:.2f}.")
    return "\n".join(lines)


# ---- predicting ----


def factory_for(dims: dict):
    """The benchmark GPT on meta at one rank's share of the batch (`batch=`), as cli_factories.gpt_bench."""

    def gpt(batch: int = dims["batch"] // WORLD):
        import torch
        import torch.nn.functional as F
        from gpt import GPT

        with torch.device("meta"):
            cfg = gpt_config(dims)
            model = GPT(cfg)
            idx = torch.zeros(batch, dims["seq"], dtype=torch.long)

        def loss(logits):
            targets = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        return model, (idx,), loss

    return gpt


def block_bytes(dims: dict) -> int:
    """One block's gathered fp32 bytes (attention 4 d^2 + MLP 8 d^2 + biases and norms)."""
    d = dims["d_model"]
    return 4 * (12 * d * d + 13 * d)


def predict(dims: dict, profile: str, configs: list[dict]) -> list[float]:
    """The planner's step seconds of each configuration on `profile`, planned by the search's own stages."""
    from fsdp2_compile.cli.model_loading import fake_group
    from fsdp2_compile.planner.candidates import Candidate
    from fsdp2_compile.planner.layout import Layout
    from fsdp2_compile.planner.search import plan_candidates

    cands = [
        Candidate(
            Layout(
                WORLD,
                reshard_after_forward=c["reshard"],
                prefetch=c["prefetch"],
                keep_gathered=c["keep"],
                memory_budget_bytes=c["budget"],
            ),
            dims["batch"] // WORLD,
        )
        for c in configs
    ]
    with fake_group(WORLD):
        scored, _ = plan_candidates(factory_for(dims), cands, profile, device_memory=64 * 2**30)
    return [s.step_s for s in scored]


# ---- measuring ----


def gpt_config(dims: dict):
    """The benchmark GPT's config at `dims`."""
    from gpt import GPTConfig

    return GPTConfig(
        vocab_size=dims["vocab"],
        block_size=dims["seq"],
        n_layer=dims["layers"],
        n_head=dims["heads"],
        d_model=dims["d_model"],
    )


def measure(dims: dict, configs: list[dict], link: str, steps: int, warmup: int, port: int) -> list[list[float]]:
    """Step seconds of each configuration (after warm-up), all stepped in turn in one 2-rank job on `link`."""
    prefix = shaped_link("1gbit") if link == "1gbit" else []
    cmd = [
        *prefix,
        TORCHRUN,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--nproc-per-node",
        str(WORLD),
        os.path.abspath(__file__),
        "--worker",
        json.dumps(dict(dims=dims, configs=configs, steps=steps, warmup=warmup)),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd[:8])} ... failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])["times"]


def worker(spec: dict) -> None:
    """Under torchrun: build each configuration's model, then step them in turn (one step each per round)."""
    import torch
    import torch.distributed as dist
    from gpt import GPT, gpt_loss, make_batch

    import fsdp2_compile as fc

    dims, configs = spec["dims"], spec["configs"]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = gpt_config(dims)
    models, opts = [], []
    for c in configs:
        torch.manual_seed(0)
        model = GPT(cfg)
        for block in model.blocks:
            fc.shard(block, reshard_after_forward=c["reshard"])
        config = fc.CompileConfig(
            prefetch_depth=c["prefetch"], keep_gathered=c["keep"], memory_budget_bytes=c["budget"]
        )
        fc.shard_compile(model, compile_config=config)
        models.append(model)
        opts.append(torch.optim.AdamW(model.parameters(), lr=1e-4))
    local = dims["batch"] // WORLD
    times: list[list[float]] = [[] for _ in configs]
    n = len(configs)
    for step in range(spec["warmup"] + spec["steps"]):
        x, y = make_batch(cfg, dims["batch"], dims["seq"], seed=step)
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        for k in range(n):
            i = (k + step) % n  # rotated: no configuration always follows the same one
            dist.barrier()
            start = time.perf_counter()
            gpt_loss(models[i](x), y).backward()
            opts[i].step()
            opts[i].zero_grad()
            if step >= spec["warmup"]:
                times[i].append(time.perf_counter() - start)
    if rank == 0:
        print(json.dumps(dict(times=times)), flush=True)
    dist.destroy_process_group()


def check_link(dims: dict, link: str, runs: int, steps: int, warmup: int, port: int, per_job: int = 0) -> dict:
    configs = grid(dims)
    t0 = time.perf_counter()
    predicted = predict(dims, PROFILES[link], configs)
    print(f"# {link}: planned {len(configs)} configurations in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    groups = job_groups(len(configs), per_job)
    per_run = []
    for run in range(runs):
        t0 = time.perf_counter()
        ratios = [1.0] * len(configs)
        for g, rows in enumerate(groups):  # each job: the anchor and its group
            times = measure(dims, [configs[0]] + [configs[i] for i in rows], link, steps, warmup, port + 10 * run + g)
            medians = [statistics.median(t) for t in times]
            for i, m in zip(rows, medians[1:]):
                ratios[i] = m / medians[0]
        per_run.append(ratios)
        print(
            f"# {link}: run {run + 1}/{runs} in {time.perf_counter() - t0:.0f} s, anchor median {medians[0]:.3f} s",
            file=sys.stderr,
            flush=True,
        )
    rows = [
        dict(
            name=name(c),
            config=c,
            predicted_s=p,
            measured=statistics.median(r[i] for r in per_run),
            measured_runs=[r[i] for r in per_run],
        )
        for i, (c, p) in enumerate(zip(configs, predicted))
    ]
    return dict(link=link, profile=PROFILES[link], rows=rows, **compare(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--links", nargs="+", choices=list(PROFILES), default=list(PROFILES))
    p.add_argument("--runs", type=int, default=2, help="jobs per link (each steps every configuration)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per configuration per job")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a 2-layer d 256 GPT, one job of 2 steps: to try the harness")
    p.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    p.add_argument(
        "--per-job",
        type=int,
        default=4,
        metavar="K",
        help="at most K models in one job: the anchor and K-1 rows, jobs one after another (default 4; 0: every "
        "row in one job)",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    dims = QUICK if args.quick else FULL
    runs, steps, warmup = (1, 2, 1) if args.quick else (args.runs, args.steps, args.warmup)
    command = " ".join([".venv/bin/python", "benchmarks/search_check.py", *sys.argv[1:]])
    results = []
    for k, link in enumerate(args.links):
        res = check_link(dims, link, runs, steps, warmup, 29800 + 100 * k, args.per_job)
        results.append(res)
        print(
            f"\n{link} ({res['profile']}), {runs} job(s) x {steps} timed steps per configuration "
            f"(ratios to the first row's step in the same job, median over jobs):\n"
        )
        print(table(res["rows"]), flush=True)
        if args.json:  # after each link: a long run stopped half-way keeps what it measured
            with open(args.json, "w") as f:
                json.dump(dict(command=command, dims=dims, results=results), f, indent=1)
                f.write("\n")
    print(f"\nMeasured with `{command}`.")


if __name__ == "__main__":
    main()
