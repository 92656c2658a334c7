"""The `fsdp2-compile` CLI: dump artefacts, planner figures, errors and help."""

from __future__ import annotations

import json
import math
import os
import re
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
import zlib

import pytest
import torch

from fsdp2_compile.plan import _sharded_bytes, analytical_bytes, shard_for_plan

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FACTORIES = os.path.join(HERE, "cli_factories.py")


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdp2_compile", *args], capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, **(env or {})}, timeout=300,
    )


def decode_png(data: bytes) -> tuple[int, int, bytes]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 2)
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == height * (1 + 3 * width)
    return width, height, raw


def graph_counts(text: str) -> tuple[int, int, int]:
    """Nodes, all-gathers, reduce-scatters of a dumped graph text."""
    nodes = len(re.findall(r"^\s*(?:%\w+ : |return\b)", text, re.MULTILINE))
    return nodes, text.count("all_gather_into_tensor.default]"), text.count("reduce_scatter_tensor.default]")


def test_dump_end_to_end(tmp_path):
    out = tmp_path / "dump"
    r = cli("dump", f"{FACTORIES}:tiny", "--world-size", "4", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "done" in r.stderr  # progress on stderr
    for kind in ("forward", "backward"):
        files = sorted(os.listdir(out / kind))
        assert files[0] == "00_captured.txt" and "graph.svg" in files and "graph.dot" in files
        ET.parse(out / kind / "graph.svg")  # valid XML
        assert (out / kind / "graph.dot").read_text().startswith("digraph")
        passes = [f for f in files if f.endswith(".txt")]
        assert len(passes) == 7
        # the summary's row for every pass equals the counts in that pass's graph text
        section = r.stdout.split(f"== {kind} graph")[1].split("==")[0]
        for name in passes:
            nodes, gathers, scatters = graph_counts((out / kind / name).read_text())
            row = re.search(rf"^\s+{name[3:-4]}\s+(\d+)\s+(\d+)\s+(\d+)", section, re.MULTILINE)
            assert tuple(map(int, row.groups())) == (nodes, gathers, scatters), name
        final = (out / kind / passes[-1]).read_text()
        assert "bucket='blocks.0'" in final and "params=[" in final  # provenance on collective lines
    trace = json.loads((out / "trace.json").read_text())
    lanes = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert lanes == {1, 2}
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"} == {"compute", "communication"}
    width, height, _ = decode_png((out / "memory.png").read_bytes())
    assert width > 100 and height > 100
    assert "exposed communication" in r.stdout and "peak memory" in r.stdout


def test_summary_counts_match_the_compiled_graphs(fake_pg, tmp_path, monkeypatch):
    """In process, on the real records: the per-pass stats of the final pass equal the graph, bytes are kept by
    every pass after lowering, and FSDP2_COMPILE_DUMP writes the artefacts of a real run to DIR/rank<r>."""
    import cli_factories

    import fsdp2_compile as fc
    from fsdp2_compile.dump import pass_stats
    from fsdp2_compile.report import clear_compiled_graphs, collectives, compiled_graphs

    monkeypatch.setenv("FSDP2_COMPILE_DUMP", str(tmp_path))
    clear_compiled_graphs()
    model, (idx,) = cli_factories.tiny()
    for block in model.blocks:
        fc.shard(block)
    fc.shard_compile(model, compile_config=fc.CompileConfig(hardware="cpu-gloo-loopback"))
    model(idx).sum().backward()
    records = compiled_graphs()
    assert [r.kind for r in records] == ["forward", "backward"]
    for record in records:
        stats = pass_stats(record)
        final, found = stats[-1], collectives(record.gm)
        assert final.nodes == len(record.gm.graph.nodes)
        for kind in ("all_gather", "reduce_scatter"):
            assert final.counts[kind] == sum(c.kind == kind for c in found)
        lowered = [s for s in stats if s.name not in ("captured", "combine_tied_grads", "lower_unshard")]
        assert all(s.bytes_by_dtype == final.bytes_by_dtype and not s.unknown_bytes for s in lowered)
    clear_compiled_graphs()
    assert sorted(os.listdir(tmp_path / "rank3")) == ["backward", "forward", "memory.png", "summary.txt", "trace.json"]


@pytest.mark.parametrize("world_size", [8, 64, 1024])
def test_plan_bytes_match_the_analytical_formula(world_size):
    from fsdp2_compile._torch_private import fake_process_group
    import cli_factories

    fake_process_group(0, world_size)
    try:
        model, _, _ = cli_factories.wide_meta()
        padded = sum(-(-p.shape[0] // world_size) * math.prod(p.shape[1:]) * 4 for p in model.parameters())
        analytical = analytical_bytes(model, world_size)
        shard_for_plan(model)
        measured = _sharded_bytes(model)
    finally:
        torch.distributed.destroy_process_group()
    assert measured["params"] == measured["grads"] == padded  # rank 0 holds ceil(dim0 / N) rows of each
    assert measured["optimizer"] == 2 * padded
    for key in ("params", "grads", "optimizer"):
        assert abs(measured[key] - analytical[key]) / analytical[key] < 0.01


def test_plan_json(tmp_path):
    r = cli("plan", f"{FACTORIES}:wide_meta", "--world-size", "64", "--hardware", "h100-nvlink", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["world_size"] == 64 and plan["layers"] == 3
    per_rank = plan["per_rank_bytes"]
    assert set(per_rank) == {"params", "grads", "optimizer", "gathered_peak", "activations", "total"}
    assert per_rank["total"] == sum(v for k, v in per_rank.items() if k != "total")
    numel = 1000 * 4096 + 3 * (2 * 4096 + 4096 * 4096 + 4096) + 2048 * 4096 + 2048
    assert abs(per_rank["params"] - numel * 4 / 64) / (numel * 4 / 64) < 0.01
    assert plan["comm_bytes_per_step"] > 0 and plan["step_time_s"]["h100-nvlink"] > 0
    assert plan["exposed_comm_s"]["h100-nvlink"] >= 0


@pytest.mark.parametrize(
    "target, code, message",
    [
        ("no_such_module_xyz:make", 2, "cannot import 'no_such_module_xyz'"),
        ("not-a-target", 2, "is not of the form module:factory"),
        (f"{FACTORIES}:missing", 2, "has no callable 'missing'"),
        (f"{FACTORIES}:raises", 1, "raised ValueError: boom from the factory"),
        (f"{FACTORIES}:wrong_return", 1, "expected (model, args) or (model, args, loss_fn)"),
        (f"{FACTORIES}:wrong_model", 1, "expected an nn.Module"),
    ],
)
def test_bad_targets_fail_clearly(target, code, message):
    r = cli("plan", target, "--world-size", "2")
    assert r.returncode == code, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_help_and_usage_errors():
    r = cli("--help")
    assert r.returncode == 0 and "dump" in r.stdout and "plan" in r.stdout and "examples:" in r.stdout
    for sub in ("dump", "plan"):
        r = cli(sub, "--help")
        assert r.returncode == 0 and "examples:" in r.stdout and "--world-size" in r.stdout
    r = cli("plan", "x:y")  # missing --world-size
    assert r.returncode == 2 and "--world-size" in r.stderr and "Traceback" not in r.stderr
