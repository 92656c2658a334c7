"""benchmarks/gpu_check.py's whole logic on CPU/gloo (2 ranks, the tiny GPT, aot_eager and the compiled `fully_shard`
baseline, fp32 and bf16): it compares losses and final parameters with `fully_shard` bitwise and checks the
collectives; its report fails on a difference; benchmarks/gpu_check.sh skips cleanly without CUDA."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_check  # noqa: E402


def _json(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("GPU_CHECK_JSON ")]
    assert lines, f"no GPU_CHECK_JSON line in:\n{stdout[-3000:]}"
    return json.loads(lines[-1].removeprefix("GPU_CHECK_JSON "))


def test_cpu_mode_on_two_ranks_reports_bitwise_parity_with_fully_shard():
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        os.path.join(ROOT, "benchmarks", "gpu_check.py"),
        "--device",
        "cpu",
        "--size",
        "tiny",
        "--compilers",
        "aot_eager",
        "--warmup",
        "1",
        "--steps",
        "2",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert "| param dtype | system | losses / final parameters vs fully_shard |" in out.stdout
    report = _json(out.stdout)
    assert report["ok"] and report["world"] == 2 and report["backend"] == "gloo"
    ours = [r for r in report["results"] if r["system"] == "ours aot_eager"]
    assert sorted(r["dtype"] for r in ours) == ["bf16", "fp32"]
    for r in ours:
        ref = next(x for x in report["results"] if x["system"] == "fully_shard" and x["dtype"] == r["dtype"])
        assert r["losses"] == ref["losses"] and len(r["losses"]) == 2 and len(r["losses"][0]) == 3  # ranks x steps
        assert r["bitwise"] and r["params_bitwise"] and r["params_max_abs_diff"] == 0.0
        assert r["graph_coverage"]["forward_gathers_all"] and r["graph_coverage"]["backward_reduces_all"]
        # one bucket per block and one for the root: 3 all-gathers in forward, 2 in backward (the root stays
        # gathered, as fully_shard's), 3 reduce-scatters
        assert r["runtime_collectives"] == {"all_gather": 5, "reduce_scatter": 3}
        assert r["median_s"] > 0 and r["peak_bytes"] > 0
    for r in (r for r in report["results"] if r["system"] == "fully_shard + compile"):  # the compiled baseline
        ref = next(x for x in report["results"] if x["system"] == "fully_shard" and x["dtype"] == r["dtype"])
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=5e-2, atol=0)
    assert {r["dtype"] for r in report["results"] if r["system"] == "fully_shard + compile"} == {"bf16", "fp32"}


def _fake_result(system: str, losses, params_bitwise=True, diff=0.0) -> dict:
    return dict(
        system=system,
        dtype="fp32",
        losses=losses,
        median_s=0.1,
        first_step_s=1.0,
        host_s=0.05,
        peak_bytes=2**20,
        params=10,
        runtime_collectives={"all_gather": 6, "reduce_scatter": 3},
        params_bitwise=params_bitwise,
        params_max_abs_diff=diff,
        graph_coverage=None
        if system.startswith("fully_shard")
        else dict(forward_gathers_all=True, backward_reduces_all=True, missing_gather=[], missing_reduce=[]),
    )


def test_report_fails_on_a_one_ulp_loss_difference_or_different_parameters(capsys):
    args = SimpleNamespace(
        inductor_rtol=5e-2,
        budget_s=400,
        layers=2,
        d_model=64,
        heads=4,
        vocab=256,
        seq=32,
        batch=2,
        warmup=1,
        steps=1,
        sdpa="default",
    )
    dev = gpu_check.Device(torch.device("cpu"))
    ref = _fake_result("fully_shard", [[5.0, 4.0]])
    same = _fake_result("ours aot_eager", [[5.0, 4.0]])
    assert gpu_check.report([ref, same], args, dev, 1, "gloo")
    off = _fake_result("ours aot_eager", [[5.0, float(torch.nextafter(torch.tensor(4.0), torch.tensor(5.0)))]])
    assert not gpu_check.report([copy.deepcopy(ref), off], args, dev, 1, "gloo")
    params_off = _fake_result("ours aot_eager", [[5.0, 4.0]], params_bitwise=False, diff=1e-7)
    assert not gpu_check.report([copy.deepcopy(ref), params_off], args, dev, 1, "gloo")
    text = capsys.readouterr().out
    assert text.count("FAIL: fp32 ours aot_eager: not bitwise equal to fully_shard") == 2
    assert "NOTE: world size 1: fully_shard issues no collectives" in text


def test_sh_skips_clearly_without_cuda():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("SKIP: gpu_check needs a CUDA GPU; none is available")
