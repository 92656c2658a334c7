"""The graph records and debug artefacts: bounded over long runs, on the compile path only when asked for,
decisions logged. One process, the fake process group."""

from __future__ import annotations

import logging
import subprocess
import sys

import torch
from torch import nn

import fsdp2_compile as fc
from fsdp2_compile.compiler import graph_records


def test_the_compile_path_imports_no_drawing_code():
    code = (
        "import sys, fsdp2_compile, fsdp2_compile.compiler.backend, fsdp2_compile.api, "
        "fsdp2_compile.compiler.pass_list\n"
        "assert 'fsdp2_compile.debug.dump' not in sys.modules, 'the compile path imported dump.py'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    fc.shard(model[0])
    fc.shard(model[2])
    return model


def test_twenty_recompiles_keep_the_report_bounded(fake_pg, monkeypatch, caplog):
    """20 input shapes, each its own compiled graph: the report keeps the newest MAX_RECORDS (here 8) records, none
    of them with per-pass snapshots, while compile_counts() still counts all 20; the decisions are logged."""
    monkeypatch.delenv("FSDP2_COMPILE_DUMP", raising=False)
    monkeypatch.setattr(graph_records, "MAX_RECORDS", 8)
    graph_records.clear_compiled_graphs()
    model = _model()
    fc.shard_compile(model, dynamic=False)
    caplog.set_level(logging.INFO, logger="fsdp2_compile")
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256), torch.no_grad():
        for batch in range(1, 21):
            model(torch.randn(batch, 8))
    counts = graph_records.compile_counts()
    assert (counts.inference, counts.frames, counts.recompiles) == (20, 1, 19)
    records = graph_records.compiled_graphs()
    assert len(records) == 8 and all(r.kind == "inference" for r in records)
    assert all(r.snapshots == [] for r in records)  # nothing per pass unless a dump is asked for
    assert all(r.profile is not None and r.timeline is not None for r in records)
    messages = [r.getMessage() for r in caplog.records if r.name == "fsdp2_compile"]
    assert any("cost-model profile cpu-gloo-loopback" in m for m in messages)
    assert any("prefetch distances" in m for m in messages)
    assert any("bucket '0' fuses 2 all_gather collectives" in m for m in messages)  # weight and bias of model[0]
    graph_records.clear_compiled_graphs()
    assert graph_records.compile_counts().inference == 0 and graph_records.compiled_graphs() == []


def test_the_dump_simulates_each_graph_with_its_schedulers_profile(fake_pg):
    from torch.fx.experimental.proxy_tensor import make_fx

    from fsdp2_compile.core.hardware import PROFILES
    from fsdp2_compile.debug.dump import summarize

    gm = make_fx(lambda x: (x @ x).sum(), tracing_mode="fake")(torch.randn(4, 4))
    record = graph_records.GraphRecord("forward", gm, profile=PROFILES["h100-nvlink"])
    assert summarize([record], PROFILES["cpu-gloo-loopback"]).startswith("cost model profile: h100-nvlink (")
    bare = graph_records.GraphRecord("forward", gm)  # no profile recorded: the one asked for
    assert summarize([bare], PROFILES["cpu-gloo-1gbit"]).startswith("cost model profile: cpu-gloo-1gbit (")


def test_no_fsdp_op_or_collective_is_read_by_position():
    """The graph contract lives in ir.py: the package reads op arguments through its named views."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    found = [
        f"{path.relative_to(root)}:{i}: {line.strip()}"
        for folder in ("fsdp2_compile", "passes")
        for path in sorted((root / folder).glob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\.args\[-?[0-9]+\]", line)
    ]
    assert found == []


def test_sizes_read_from_data_count_at_a_hint_the_same_on_every_rank():
    """A size traced from data (an unbacked symbol, e.g. `.tolist()` of token counts) has no recorded value: the
    cost model counts it at `UNBACKED_HINT`, whatever this rank's data, so every rank schedules the graph alike."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fsdp2_compile.core.ir import UNBACKED_HINT, concrete, nbytes

    env = ShapeEnv()
    tokens = env.create_unbacked_symint()
    assert concrete(tokens + 1) == UNBACKED_HINT + 1
    with torch._subclasses.fake_tensor.FakeTensorMode(shape_env=env):
        assert nbytes(torch.empty(tokens, 16)) == UNBACKED_HINT * 16 * 4
