"""The planner against published and measured runs: prints docs/results.md's table (run, source, published or
measured, predicted, ratio). Runs `make_plan` in this process under the fake process group (about 15 s a row).

    .venv/bin/python benchmarks/plan_check.py [--rows tt8 tt8c ...] [--json PATH]

--json PATH also writes the table's figures (as numbers: tokens/s, seconds, bytes) to
PATH; benchmarks/figures.py plots the committed benchmarks/plan_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

TT = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
GIB, MIB = 2**30, 2**20

# name: (description, source, factory, kwargs, world, profile, plan options, tokens/s/rank, peak bytes, step s)
ROWS = {
    "tt8": (
        "Llama 3.1 8B, 8 H100, bs 2 x 8192, SAC op, eager (CALIBRATION)",
        f"{TT}, Table 1 'FSDP'",
        "llama:llama3_8b",
        {"batch": 2, "seq": 8192},
        8,
        "h100-nvlink",
        {"ac": "selective", "compiler": "aot_eager", "mp": "bf16"},
        5762,
        82.4 * GIB,
        None,
    ),
    "tt8c": (
        "Llama 3.1 8B, 8 H100, bs 2 x 8192, SAC op, torch.compile",
        f"{TT}, Table 1 'FSDP + torch.compile'",
        "llama:llama3_8b",
        {"batch": 2, "seq": 8192},
        8,
        "h100-nvlink",
        {"ac": "selective", "compiler": "inductor-blocks", "mp": "bf16"},
        6667,
        77.0 * GIB,
        None,
    ),
    "tt128": (
        "Llama 3.1 8B, 128 H100, bs 2 x 8192, SAC op, eager",
        f"{TT}, Table 3 'FSDP'",
        "llama:llama3_8b",
        {"batch": 2, "seq": 8192},
        128,
        "h100-infiniband",
        {"ac": "selective", "compiler": "aot_eager", "mp": "bf16"},
        5605,
        67.0 * GIB,
        None,
    ),
    "tt128c": (
        "Llama 3.1 8B, 128 H100, bs 2 x 8192, SAC op, torch.compile",
        f"{TT}, Table 3 'FSDP + torch.compile'",
        "llama:llama3_8b",
        {"batch": 2, "seq": 8192},
        128,
        "h100-infiniband",
        {"ac": "selective", "compiler": "inductor-blocks", "mp": "bf16"},
        6514,
        62.0 * GIB,
        None,
    ),
    "tt8f8": (
        "Llama 3.1 8B, 8 H100, bs 2 x 8192, SAC op, torch.compile, float8",
        f"{TT}, Table 1 'FSDP + torch.compile + Float8'",
        "llama:llama3_8b",
        {"batch": 2, "seq": 8192},
        8,
        "h100-nvlink",
        {"ac": "selective", "compiler": "inductor-blocks", "mp": "bf16", "float8": True},
        8532,
        76.8 * GIB,
        None,
    ),
    "tt128f8": (
        "Llama 3.1 8B, 128 H100, bs 2 x 8192, SAC op, torch.compile, float8",
        f"{TT}, Table 3 'FSDP + torch.compile + Float8'",
        "llama:llama3_8b",
        {"batch": 2, "seq": 8192},
        128,
        "h100-infiniband",
        {"ac": "selective", "compiler": "inductor-blocks", "mp": "bf16", "float8": True},
        8380,
        61.8 * GIB,
        None,
    ),
    "tt70": (
        "Llama 3.1 70B, 256 H100 (FSDP 32 x TP 8), bs 16 x 8192, full AC, torch.compile, float8",
        f"{TT}, Table 4 '2D'",
        "llama:llama3_70b",
        {"batch": 16, "seq": 8192},
        256,
        "h100-infiniband",
        {"ac": "full", "compiler": "inductor-blocks", "mp": "bf16", "float8": True, "tp": 8},
        829,
        71.9 * GIB,
        None,
    ),
    "tt405": (
        "Llama 3.1 405B, 512 H100 (PP 8 x FSDP 8 x TP 8, Interleaved 1F1B, 8 micro-batches), bs 32 x 8192, "
        "full AC, torch.compile, float8, async TP",
        f"{TT}, Table 5 'Interleaved 1F1B'",
        "llama:llama3_405b",
        {"batch": 32, "seq": 8192},
        512,
        "h100-infiniband",
        {
            "ac": "full",
            "compiler": "inductor-blocks",
            "mp": "bf16",
            "float8": True,
            "tp": 8,
            "pp": 8,
            "pp_schedule": "Interleaved1F1B",
            "microbatches": 8,
        },
        128,
        72.7 * GIB,
        None,
    ),
    "tt405-1f1b": (
        "Llama 3.1 405B, 512 H100 (PP 8 x FSDP 8 x TP 8, 1F1B, 8 micro-batches), bs 32 x 8192, full AC, "
        "torch.compile, float8, async TP",
        f"{TT}, Table 5 '1F1B'",
        "llama:llama3_405b",
        {"batch": 32, "seq": 8192},
        512,
        "h100-infiniband",
        {
            "ac": "full",
            "compiler": "inductor-blocks",
            "mp": "bf16",
            "float8": True,
            "tp": 8,
            "pp": 8,
            "pp_schedule": "1F1B",
            "microbatches": 8,
        },
        100,
        82.5 * GIB,
        None,
    ),
    "gpt-lo": (
        "GPT 29.5M, 2 ranks gloo loopback, full pipeline",
        "benchmarks/run.py, full, mean of 3 runs",
        "cli_factories:gpt_bench",
        {},
        2,
        "cpu-gloo-loopback",
        {},
        None,
        1304 * MIB,
        2.912,
    ),
    "gpt-1g": (
        "GPT 29.5M, 2 ranks gloo 1 Gbit/s, full pipeline",
        "benchmarks/run.py, full, mean of 3 runs",
        "cli_factories:gpt_bench",
        {},
        2,
        "cpu-gloo-1gbit",
        {},
        None,
        1307 * MIB,
        3.616,
    ),
}


def plan_row(name: str):
    import importlib

    from fsdp2_compile.cli.model_loading import call_factory, fake_group
    from fsdp2_compile.config import MixedPrecisionPolicy
    from fsdp2_compile.planner.layout import Layout
    from fsdp2_compile.planner.plan import make_plan

    desc, source, target, kwargs, world, profile, opts, *_ = ROWS[name]
    module, attr = target.split(":")
    factory = getattr(importlib.import_module(module), attr)
    opts = dict(opts)
    mp_policy = MixedPrecisionPolicy()
    if opts.pop("mp", None):
        mp_policy = MixedPrecisionPolicy(param_dtype=torch_bf16(), reduce_dtype=torch_f32())

    def call(f, **kw):
        return call_factory(f, **{**kwargs, **kw})

    with fake_group(world):
        return make_plan(factory, Layout(world, mp_policy=mp_policy, **opts), call=call, profiles=[profile])


def torch_bf16():
    import torch

    return torch.bfloat16


def torch_f32():
    import torch

    return torch.float32


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=list(ROWS))
    p.add_argument("--json", metavar="PATH", help="also write the table's figures to PATH")
    args = p.parse_args()
    print("| run | source | quantity | published / measured | predicted | ratio |")
    print("|---|---|---|---|---|---|")
    table = []
    for name in args.rows:
        desc, source, _, _, _, profile, _, tps, peak, step = ROWS[name]
        plan = plan_row(name)
        rows = []
        if tps:
            got = plan.tokens_per_s_per_rank[profile]
            rows.append(("tokens/s per rank", f"{tps:,}", f"{got:,.0f}", got / tps))
            table.append(dict(row=name, run=desc, quantity="tokens/s per rank", published=tps, predicted=got))
        if step:
            got = plan.step_time_s[profile]
            rows.append(("step time", f"{step:.3f} s", f"{got:.3f} s", got / step))
            table.append(dict(row=name, run=desc, quantity="step time", published=step, predicted=got))
        if peak:
            got = plan.peak_reserved_bytes[profile]
            table.append(dict(row=name, run=desc, quantity="peak memory", published=peak, predicted=got))
            unit, div = ("GiB", GIB) if peak > GIB * 4 else ("MiB", MIB)
            rows.append(
                ("peak memory (reserved / RSS)", f"{peak / div:.1f} {unit}", f"{got / div:.1f} {unit}", got / peak)
            )
        for quantity, pub, got, ratio in rows:
            print(f"| {desc} | {source} | {quantity} | {pub} | {got} | {ratio:.2f} |", flush=True)
        print(
            f"<!-- {name}: mfu {plan.mfu[profile]:.3f}, compute {plan.compute_s[profile]}, exposed "
            f"{plan.exposed_comm_s[profile]:.3f} s, peak allocated {plan.per_rank_bytes['peak'] / GIB:.2f} GiB, "
            f"activations {plan.per_rank_bytes['activations'] / GIB:.2f} GiB -->",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=" ".join(["benchmarks/plan_check.py", *sys.argv[1:]]), table=table), f)
            f.write("\n")


if __name__ == "__main__":
    main()
