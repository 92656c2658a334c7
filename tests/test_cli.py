"""The `fsdp2-compile` CLI: dump artefacts, planner figures, errors and help."""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

from fsdp2_compile.compiler.pass_list import PASSES
from fsdp2_compile.debug.sizes import size_text
from fsdp2_compile.planner.block_sharding import shard_for_plan
from fsdp2_compile.planner.param_bytes import analytical_bytes, sharded_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FACTORIES = os.path.join(HERE, "cli_factories.py")


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdp2_compile", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=300,
        check=False,
    )


def graph_counts(text: str) -> tuple[int, int, int, int]:
    """Nodes, all-gathers, reduce-scatters, all-reduces of a dumped graph text."""
    nodes = len(re.findall(r"^\s*(?:%\w+ : |return\b)", text, re.MULTILINE))
    return (
        nodes,
        text.count("all_gather_into_tensor.default]"),
        text.count("reduce_scatter_tensor.default]"),
        text.count("all_reduce.default]"),
    )


def check_summary_rows(stdout: str, folder, kind: str) -> list[str]:
    """Every pass's row of `kind`'s summary table equals the counts in that pass's graph text; the pass files."""
    passes = sorted(f for f in os.listdir(folder / kind) if f.endswith(".txt"))
    section = stdout.split(f"== {kind} graph")[1].split("==")[0]
    for name in passes:
        row = re.search(rf"^\s+{name[3:-4]}\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)", section, re.MULTILINE)
        assert tuple(map(int, row.groups())) == graph_counts((folder / kind / name).read_text()), name
    return passes


def test_dump_end_to_end(tmp_path):
    out = tmp_path / "dump"
    r = cli("dump", f"{FACTORIES}:tiny", "--world-size", "4", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "done" in r.stderr  # progress on stderr
    for kind in ("forward", "backward"):
        files = sorted(os.listdir(out / kind))
        assert files[0] == "00_captured.txt" and "graph.svg" in files and "graph.dot" in files
        svg = ET.parse(out / kind / "graph.svg").getroot()  # valid XML, the compact view: parameter names on inputs
        shown = " ".join(t.text for t in svg.iter("{http://www.w3.org/2000/svg}text"))
        assert "parameter shards, bucket 'blocks.0'" in shown and "fc.weight" in shown
        assert (out / kind / "graph.dot").read_text().startswith("digraph")
        passes = check_summary_rows(r.stdout, out, kind)
        assert len(passes) == len(PASSES) + 1  # the captured graph, then one file per pass
        final = (out / kind / passes[-1]).read_text()
        assert "bucket='blocks.0'" in final and "params=[" in final  # provenance on collective lines
        assert graph_counts(final)[3] == 0  # no all-reduce without --replicate
        (block,) = os.listdir(out / kind / "subgraphs")  # both blocks run one subgraph, traced once
        assert "called 2 time(s)" in (out / kind / "subgraphs" / block).read_text()
        assert f"blocks traced once: subgraph {block[:-4]} (" in r.stdout
    trace = json.loads((out / "trace.json").read_text())
    lanes = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert lanes == {1, 2}
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"} == {
        "compute",
        "communication",
    }
    curve = [tuple(map(float, row.split(","))) for row in (out / "memory.csv").read_text().splitlines()[1:]]
    peak = max(b for _, b in curve)
    assert peak > 0 and f"peak memory {size_text(peak)}" in r.stdout  # the plot and the summary agree
    image = pytest.importorskip("matplotlib.image").imread(out / "memory.png")
    assert image.shape[0] > 200 and image.shape[1] > 400
    assert "exposed communication" in r.stdout and "peak memory" in r.stdout


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp_2x2"])
def test_summary_counts_match_the_compiled_graphs(fake_pg, tmp_path, monkeypatch, hsdp):
    """In process, on the real records: the per-pass stats of the final pass equal the graph, bytes are kept by
    every pass after lowering (HSDP: the all-reduces' too), and FSDP2_COMPILE_DUMP writes the artefacts of a real
    run to DIR/rank<r>."""
    import cli_factories

    import fsdp2_compile as fc
    from fsdp2_compile.compiler.graph_records import clear_compiled_graphs, collectives, compiled_graphs
    from fsdp2_compile.debug.dump import pass_stats
    from fsdp2_compile.planner.tensor_parallel import hsdp_mesh

    monkeypatch.setenv("FSDP2_COMPILE_DUMP", str(tmp_path))
    clear_compiled_graphs()
    mesh = hsdp_mesh(4, 2) if hsdp else None
    model, (idx,) = cli_factories.tiny()
    for block in model.blocks:
        fc.shard(block, mesh)
    fc.shard_compile(model, mesh, compile_config=fc.CompileConfig(hardware="cpu-gloo-loopback"))
    model(idx).sum().backward()
    records = compiled_graphs()
    assert [r.kind for r in records] == ["forward", "backward"]
    for record in records:
        stats = pass_stats(record)
        final, found = stats[-1], collectives(record.gm)
        assert final.nodes == len(record.gm.graph.nodes)
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            assert final.counts[kind] == sum(c.kind == kind for c in found)
        names = [p.__name__ for p in PASSES]
        lowered = stats[1 + names.index("lower_reduce_grad") :]  # stats[0] is the captured graph
        assert all(s.bytes_by_dtype == final.bytes_by_dtype for s in lowered)
        if hsdp and record.kind == "backward":  # 3 buckets; each all-reduce moves its reduced shard: 1/2
            assert final.counts["all_reduce"] == final.counts["reduce_scatter"] == 3
            reduced, scattered = (final.bytes_by_dtype[(k, "float32")] for k in ("all_reduce", "reduce_scatter"))
            assert 2 * reduced == scattered
        else:
            assert final.counts["all_reduce"] == 0
    clear_compiled_graphs()
    assert sorted(os.listdir(tmp_path / "rank3")) == [
        "backward",
        "forward",
        "memory.csv",
        "memory.png",
        "summary.txt",
        "trace.json",
    ]


def test_snapshots_carry_exact_provenance_and_bytes(fake_pg):
    """Every pass's snapshot has exact facts: after `lower_unshard` each forward all-gather serves one parameter
    and together they move the padded parameter bytes (ceil(rows / N) * N rows); after `bucket_collectives` each
    all-gather lists its bucket's parameters."""
    import cli_factories

    import fsdp2_compile as fc
    from fsdp2_compile.compiler.graph_records import clear_compiled_graphs, compiled_graphs
    from fsdp2_compile.debug.dump import annotate, pass_stats

    world = 4  # the fake group's size
    model, (idx,) = cli_factories.tiny()
    padded = sum(-(-p.shape[0] // world) * world * math.prod(p.shape[1:]) * 4 for p in model.parameters())
    names = [n for n, _ in model.named_parameters()]
    buckets = {b: {n for n in names if n.startswith(f"{b}.")} for b in ("blocks.0", "blocks.1")}
    buckets[""] = {n for n in names if not n.startswith("blocks.")}  # the root's: embed and head
    clear_compiled_graphs()
    for block in model.blocks:
        fc.shard(block)
    fc.shard_compile(model, compile_config=fc.CompileConfig(keep_snapshots=True))
    model(idx).sum().backward()
    forward = compiled_graphs()[0]
    clear_compiled_graphs()
    snaps = {s.name: s for s in forward.snapshots}
    note = re.compile(r"# bucket='([^']*)' params=\[([^\]]*)\] role=all_gather$")

    lowered = [
        note.search(line)
        for line in annotate(snaps["lower_unshard"]).splitlines()
        if "all_gather_into_tensor.default]" in line
    ]
    assert all(lowered) and sorted(m.group(2) for m in lowered) == sorted(names)  # one parameter each
    gathers = [f for f in snaps["lower_unshard"].nodes.values() if f.role == "all_gather"]
    assert sum(f.nbytes for f in gathers) == padded
    stats = {s.name: s for s in pass_stats(forward)}
    assert stats["lower_unshard"].bytes_by_dtype == {("all_gather", "float32"): padded}

    bucketed = [
        note.search(line)
        for line in annotate(snaps["bucket_collectives"]).splitlines()
        if "all_gather_into_tensor.default]" in line
    ]
    assert all(bucketed) and len(bucketed) == len(buckets)
    assert {m.group(1): set(m.group(2).split(", ")) for m in bucketed} == buckets
    assert stats["bucket_collectives"].bytes_by_dtype == {("all_gather", "float32"): padded}


@pytest.mark.parametrize("world_size", [8, 64, 1024])
def test_plan_bytes_match_the_analytical_formula(world_size):
    import cli_factories

    from fsdp2_compile._torch_private import fake_process_group

    fake_process_group(0, world_size)
    try:
        model, _, _ = cli_factories.wide_meta()
        padded = sum(-(-p.shape[0] // world_size) * math.prod(p.shape[1:]) * 4 for p in model.parameters())
        analytical = analytical_bytes(model, world_size)
        shard_for_plan(model)
        measured = sharded_bytes(model)
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
    assert set(per_rank) == {"params", "grads", "optimizer", "gathered_peak", "activations", "total", "peak"}
    assert per_rank["total"] == sum(v for k, v in per_rank.items() if k not in ("total", "peak"))
    numel = 1000 * 4096 + 3 * (2 * 4096 + 4096 * 4096 + 4096) + 2048 * 4096 + 2048
    assert abs(per_rank["params"] - numel * 4 / 64) / (numel * 4 / 64) < 0.01
    assert plan["comm_bytes_per_step"] > 0 and plan["step_time_s"]["h100-nvlink"] > 0
    assert plan["exposed_comm_s"]["h100-nvlink"] >= 0
    assert plan["replicate"] == 1 and plan["shard_size"] == 64


def test_dump_hsdp_has_one_all_reduce_per_reduce_scatter(tmp_path):
    out = tmp_path / "dump"
    r = cli("dump", f"{FACTORIES}:tiny", "--world-size", "4", "--replicate", "2", "--out", str(out), "-q")
    assert r.returncode == 0, r.stderr
    assert "mesh 2 x 2 (replicate x shard)" in r.stdout
    for kind in ("forward", "backward"):
        passes = check_summary_rows(r.stdout, out, kind)  # the all_reduce column included
        final = (out / kind / passes[-1]).read_text()
        _, gathers, scatters, reduces = graph_counts(final)
        if kind == "forward":
            assert gathers == 3 and scatters == reduces == 0
            continue
        assert scatters == reduces == 3  # one bucket per block and one for the root
        # each all-reduce takes its bucket's reduce-scatter (through its wait), and has the same bucket
        lines = {m.group(1): m.group(0) for m in re.finditer(r"^\s*%(\w+) : .*$", final, re.MULTILINE)}
        waited = {}
        for name, line in lines.items():
            m = re.search(r"wait_tensor\.default\]\(args = \(%(\w+),", line)
            if m:
                waited[name] = m.group(1)
        inputs = []
        for line in lines.values():
            if "all_reduce.default]" in line:
                wait = re.search(r"all_reduce\.default\]\(args = \(%(\w+),", line).group(1)
                scatter = lines[waited[wait]]
                assert "reduce_scatter_tensor.default]" in scatter
                bucket = re.compile(r"# bucket='([^']*)'")
                assert bucket.search(scatter).group(1) == bucket.search(line).group(1)
                inputs.append(waited[wait])
        assert len(set(inputs)) == 3
    dot = (out / "backward" / "graph.dot").read_text()
    assert "legend_all_reduce" in dot and dot.count('fillcolor="#ce93d8"') == 1 + 3  # legend + the all-reduces


def test_plan_hsdp_shards_over_n_over_r_and_adds_the_all_reduces():
    """8 ranks as 2 x 4: per-rank bytes of a 4-rank plan (same shard size); the bytes sent grow by the all-reduces:
    each rank all-reduces its gradient shard over 2 replicas once per step, sending 2 (R-1)/R of it."""
    import cli_factories

    args = ("plan", f"{FACTORIES}:wide_meta", "--hardware", "h100-nvlink", "--json", "-q")
    r4, r8x2 = cli(*args, "--world-size", "4"), cli(*args, "--world-size", "8", "--replicate", "2")
    assert r4.returncode == 0 and r8x2.returncode == 0, r4.stderr + r8x2.stderr
    fsdp, hsdp = json.loads(r4.stdout), json.loads(r8x2.stdout)
    assert (hsdp["world_size"], hsdp["replicate"], hsdp["shard_size"]) == (8, 2, 4)
    model, _, _ = cli_factories.wide_meta()
    numel = sum(p.numel() for p in model.parameters())  # every dim 0 divides by 4: no padding
    shard_bytes = numel * 4 / 4
    for key, factor in (("params", 1), ("grads", 1), ("optimizer", 2)):
        assert hsdp["per_rank_bytes"][key] == fsdp["per_rank_bytes"][key] == factor * shard_bytes
        assert hsdp["analytical_bytes"][key] == factor * shard_bytes
    for kind in ("all_gather", "reduce_scatter"):  # the same collectives over the same 4-rank shard group
        assert hsdp["collective_buffer_bytes"][kind] == fsdp["collective_buffer_bytes"][kind]
    assert "all_reduce" not in fsdp["collective_buffer_bytes"]
    assert hsdp["collective_buffer_bytes"]["all_reduce"] == shard_bytes
    replicas = 2
    extra = hsdp["comm_bytes_per_step"] - fsdp["comm_bytes_per_step"]
    assert abs(extra - 2 * (replicas - 1) / replicas * shard_bytes) <= 2  # int() of each total
    assert hsdp["step_time_s"]["h100-nvlink"] > fsdp["step_time_s"]["h100-nvlink"]


def test_plan_text_names_the_mesh():
    from fsdp2_compile.planner.format import format_plan
    from fsdp2_compile.planner.plan import Plan

    bytes_ = {"params": 10, "grads": 10, "optimizer": 20, "gathered_peak": 1, "activations": 1, "total": 42}
    analytical = {"params": 10.0, "grads": 10.0, "optimizer": 20.0}
    plan = Plan(
        1024,
        1,
        80,
        bytes_,
        analytical,
        5,
        {"all_reduce": 1},
        {"h100-nvlink": 1.0},
        {"h100-nvlink": 0.5},
        "method",
        replicate=8,
    )
    text = format_plan(plan, 1.0, 2**20)
    assert text.startswith("plan: 1 parameters, 80 blocks, world size 1024, mesh 8 x 128 (replicate x shard)\n")
    assert "numel*bytes/(N/R)" in text and "128 or 8 ranks" in text
    plan.replicate = 1
    assert "mesh" not in format_plan(plan, 1.0, 2**20).splitlines()[0]


@pytest.mark.parametrize("command", ["dump", "plan"])
@pytest.mark.parametrize(
    "world_size, replicate, message",
    [
        (
            "6",
            "4",
            (
                "--world-size 6 is not a multiple of --replicate 4: HSDP needs --world-size = --replicate x "
                "shard size; pass a --replicate that divides 6 or a --world-size that is a multiple of 4"
            ),
        ),
        ("4", "0", "--replicate must be >= 1, got 0"),
    ],
)
def test_replicate_usage_errors(command, world_size, replicate, message, capsys):
    from fsdp2_compile.cli.main import main

    code = main([command, f"{FACTORIES}:tiny", "--world-size", world_size, "--replicate", replicate])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err == f"fsdp2-compile: error: {message}\n"  # one line


@pytest.mark.parametrize(
    "target, code, message",
    [
        ("no_such_module_xyz:make", 2, "cannot import 'no_such_module_xyz'"),
        ("not-a-target", 2, "is not of the form module:factory"),
        (f"{FACTORIES}:missing", 2, "has no callable 'missing'"),
        (f"{FACTORIES}:raises", 1, "raised ValueError: boom from the factory"),
        (f"{FACTORIES}:wrong_return", 1, "expected (model, args) or (model, args, loss_fn)"),
        (f"{FACTORIES}:wrong_model", 1, "expected an nn.Module"),
        (f"{FACTORIES}:needs_width", 1, "factory needs_width() needs width=, and the command calls it with no argu"),
        (f"{FACTORIES}:needs_width", 1, "give them defaults, or name a factory that fixes them"),
        (f"{FACTORIES}:no_parameters", 1, "returned a ReLU without parameters: there is nothing to shard"),
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


def test_help_does_not_import_torch():
    """`--help` answers from argparse alone: neither torch nor the compiler is imported (what makes it fast)."""
    code = (
        "import sys\n"
        "from fsdp2_compile.cli.main import main\n"
        "for argv in (['--help'], ['dump', '--help'], ['plan', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('fsdp2_compile.')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert (
        r.stdout.splitlines()[-1]
        == "['fsdp2_compile.cli', 'fsdp2_compile.cli.arguments', 'fsdp2_compile.cli.dump_command', "
        "'fsdp2_compile.cli.footprint', 'fsdp2_compile.cli.main', 'fsdp2_compile.cli.model_loading', "
        "'fsdp2_compile.cli.plan_command', 'fsdp2_compile.cli.progress']"
    )


def test_unwritable_out_fails_before_compiling(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    bad = blocker / "dump"
    r = cli("dump", f"{FACTORIES}:tiny", "--world-size", "2", "--out", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"--out '{bad}' is not a folder this process can write to" in r.stderr
    assert "building" not in r.stderr and "compiling" not in r.stderr  # nothing ran


def test_large_world_size_warns_with_the_memory(capsys):
    from fsdp2_compile.cli.footprint import BYTES_PER_RANK, memory_estimate
    from fsdp2_compile.cli.main import main

    code = main(["plan", "no_such_module_xyz:make", "--world-size", "1000000"])  # warns, then the bad TARGET
    err = capsys.readouterr().err
    assert code == 2 and "warning: --world-size 1,000,000" in err
    assert f"about {size_text(memory_estimate(1_000_000))} of memory" in err
    assert memory_estimate(2_000_000) - memory_estimate(1_000_000) == 1_000_000 * BYTES_PER_RANK
    main(["plan", "no_such_module_xyz:make", "--world-size", "100000"])
    assert "warning" not in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_progress(terminal):
    """Plain lines with elapsed seconds on a pipe; a tqdm bar on a terminal (when tqdm is installed)."""
    from fsdp2_compile.cli.progress import Progress

    if terminal:
        pytest.importorskip("tqdm")
    stream = _Terminal() if terminal else io.StringIO()
    with Progress(2, stream=stream) as progress:
        progress.step("compiling")
        progress.step("writing")
    text = stream.getvalue()
    assert "compiling" in text and "writing" in text and text.rstrip().endswith("done")
    if terminal:
        assert "\r" in text and "compiling [phase 1/2" in text and "writing [phase 2/2" in text
    else:
        assert re.findall(r"\[\s*[\d.]+ s\] (\w+)", text) == ["compiling", "writing", "done"]
    quiet = io.StringIO()
    with Progress(2, quiet=True, stream=quiet) as progress:
        progress.step("compiling")
    assert quiet.getvalue() == ""


# ---------------------------------------------------------------------------------------------- --tp


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world-size", "6", "--tp", "4"], "--world-size 6 is not a multiple of --replicate 1 x --tp 4"),
        (["--world-size", "8", "--replicate", "2", "--tp", "3"], "is not a multiple of --replicate 2 x --tp 3"),
        (["--world-size", "4", "--tp", "0"], "--tp must be >= 1, got 0"),
    ],
)
def test_tp_usage_errors(args, message, capsys):
    from fsdp2_compile.cli.main import main

    code = main(["plan", f"{FACTORIES}:tp_mlp", *args])
    assert code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pp", "3"], "--world-size 8 is not a multiple of --pp 3 x --replicate 1 x --tp 1"),
        (["--pp", "2", "--tp", "4", "--replicate", "2"], "not a multiple of --pp 2 x --replicate 2 x --tp 4"),
        (["--microbatches", "2"], "--microbatches needs --pp P with P > 1"),
        (["--pp", "8"], "--pp 8 x 1 stage(s) per rank = 8 stages, but 'blocks' has 2 blocks"),
        (["--pp", "2", "--microbatches", "3"], "--microbatches 3 does not divide the local batch"),
        (["--float8"], "--float8 needs --mp bf16"),
        (["--float8", "--mp", "bf16", "--hardware", "cpu-gloo-1gbit"], "--float8 on --hardware cpu-gloo-1gbit: that"),
    ],
)
def test_pp_and_float8_usage_errors(args, message, capsys):
    from fsdp2_compile.cli.main import main

    code = main(["plan", f"{FACTORIES}:tp_mlp", "--world-size", "8", "-q", *args])
    assert code == 2 and message in capsys.readouterr().err


def test_tp_default_plan_that_finds_no_linear_pair_is_a_usage_error(capsys, tmp_path):
    from fsdp2_compile.cli.main import main

    code = main(["dump", f"{FACTORIES}:tiny", "--world-size", "4", "--tp", "2", "--out", str(tmp_path), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "found no column-wise / row-wise pair among the block's Linear layers (fc)" in err
    assert "factory.tp_plan" in err


def test_dump_tp_end_to_end(tmp_path):
    """dump --tp 2 on 4 ranks: the plan used is stated, the summary counts TP's all-reduces in their own column and
    graph.svg draws them in their own colour, with a legend entry."""
    out = tmp_path / "dump"
    r = cli("dump", f"{FACTORIES}:tp_mlp_real", "--world-size", "4", "--tp", "2", "--out", str(out), "-q")
    assert r.returncode == 0, r.stderr
    assert "sharded over 4 ranks, mesh 2 x 2 (dp x tp)" in r.stdout
    assert (
        "tensor parallel 2: the default plan (Linear layers by name), per block: colwise up_proj; rowwise down_proj"
    ) in r.stdout
    assert r.stdout.count("tensor parallel: 2 collectives (all_reduce x2)") == 2  # forward and backward
    final = [line.split() for line in r.stdout.splitlines() if line.strip().startswith("keep_inputs_until_wait")]
    assert len(final) == 2 and all(row[4] == "0" and row[6] == "2" for row in final)  # all_reduce 0, tp 2
    svg = (out / "forward" / "graph.svg").read_text()
    assert "tensor parallel collective" in svg and "tensor parallel all_reduce" in svg


def test_plan_tp_json_keeps_its_keys_and_adds_tp_ones():
    r = cli(
        "plan", f"{FACTORIES}:tp_mlp", "--world-size", "4", "--tp", "2", "--hardware", "h100-nvlink", "--json", "-q"
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in (
        "world_size",
        "replicate",
        "shard_size",
        "per_rank_bytes",
        "comm_bytes_per_step",
        "collective_buffer_bytes",
        "step_time_s",
        "exposed_comm_s",
        "tp",
        "tp_plan",
        "tp_comm_bytes_per_step",
        "tp_collective_buffer_bytes",
        "tp_collectives_per_layer",
        "tp_collectives_per_step",
        "tp_comm_s",
    ):
        assert key in out, key
    assert out["tp"] == 2 and out["shard_size"] == 2 and out["per_rank_bytes"]["params"] == 1584 * 4
    assert out["tp_collectives_per_layer"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}
    assert "intra_node_bytes_per_s" in out["profiles"]["h100-nvlink"]["device"]


@pytest.mark.parametrize("budget", [["--keep-gathered", "0.5"], ["--memory-budget", str(1 << 40)]])
def test_dump_shows_which_buckets_selective_unsharding_keeps_and_the_bytes_saved(tmp_path, budget):
    """`--keep-gathered 0.5` (or a memory budget with room for every bucket): both graphs' summaries name the kept
    buckets and their gathered bytes; the buckets the backward graph no longer gathers are exactly those (and the
    root, which FSDP2's default keeps), and their forward all-gathers add up to the bytes named."""
    out = tmp_path / "dump"
    r = cli("dump", f"{FACTORIES}:tiny", "--world-size", "4", *budget, "--out", str(out), "-q")
    assert r.returncode == 0, r.stderr
    sections = {kind: r.stdout.split(f"== {kind} graph")[1].split("==")[0] for kind in ("forward", "backward")}
    row = re.compile(r"^\s+(\S+)\s+all_gather\s+\S+\s+([\d.]+ \w+)\s+\d+$", re.MULTILINE)
    gathered = {kind: dict(row.findall(text)) for kind, text in sections.items()}
    kept = sorted(set(gathered["forward"]) - set(gathered["backward"]) - {"<root>"})  # the root: kept by default
    assert kept and set(gathered["backward"]) < set(gathered["forward"])
    line = re.compile(
        r"selective unsharding: kept gathered for backward: (.+) \((.+) gathered of .+ resharded, "
        r"budget .+\): backward does not gather them again"
    )
    for text in sections.values():
        names, kept_bytes = line.search(text).groups()
        assert sorted(names.split(", ")) == kept
    sizes = {"B": 1, "KiB": 2**10, "MiB": 2**20}
    total = sum(float(v.split()[0]) * sizes[v.split()[1]] for b, v in gathered["forward"].items() if b in kept)
    assert size_text(total) == kept_bytes


def test_keep_gathered_and_memory_plot_usage_errors(capsys):
    from fsdp2_compile.cli.main import main

    for bad in ("1.5", "-3", "lots"):
        assert main(["dump", f"{FACTORIES}:tiny", "--world-size", "2", "--keep-gathered", bad]) == 2
        assert "--keep-gathered" in capsys.readouterr().err
    for bad in ("0", "-3", "lots"):
        assert main(["dump", f"{FACTORIES}:tiny", "--world-size", "2", "--memory-budget", bad]) == 2
        assert "--memory-budget" in capsys.readouterr().err
    for bad in ("memory.pdf", "sub/memory.svg"):
        assert main(["dump", f"{FACTORIES}:tiny", "--world-size", "2", "--memory-plot", bad]) == 2
        assert "--memory-plot" in capsys.readouterr().err


def test_seq_len_and_local_batch_are_passed_to_the_factory(capsys):
    """`--seq-len S --local-batch B` plans the model the factory builds with seq=S, batch=B: the plan is
    make_plan's of that factory, key for key; a factory's seq_len= is preferred to its max_seq_len= and seq=."""
    import functools

    import cli_factories

    from fsdp2_compile.cli.main import main
    from fsdp2_compile.cli.model_loading import call_factory, fake_group, sized_call
    from fsdp2_compile.planner.layout import Layout
    from fsdp2_compile.planner.plan import make_plan

    args = ["plan", "tests/cli_factories.py:llama_small", "--world-size", "2", "--hardware", "h100-nvlink"]
    assert main([*args, "--seq-len", "48", "--local-batch", "3", "--json", "-q"]) == 0
    planned = json.loads(capsys.readouterr().out)
    planned.pop("planner")  # this run's wall time and RSS
    with fake_group(2):
        reference = make_plan(
            functools.partial(cli_factories.llama_small, seq=48, batch=3),
            Layout(2),
            call=call_factory,
            profiles=["h100-nvlink"],
        )
    assert planned == json.loads(json.dumps(reference.to_json()))
    assert planned["assumptions"]["tokens_per_step_per_rank"] == 3 * 48  # not the factory's batch 1 x seq 32

    def takes_all(seq=1, max_seq_len=1, seq_len=1):
        return torch.nn.Linear(1, 1), (torch.zeros(seq, max_seq_len, seq_len),)

    assert sized_call(takes_all, 3)(takes_all)[1][0].shape == (1, 1, 3)
    assert sized_call(takes_all, None) is call_factory


@pytest.mark.parametrize("command", ["dump", "plan"])
@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--seq-len", "64", "--seq-len 64: factory tiny() takes none of seq_len=, max_seq_len=, seq=; give it one of"),
        ("--seq-len", "0", "--seq-len must be >= 1, got 0"),
        ("--local-batch", "4", "--local-batch 4: factory tiny() takes no batch=; give it a batch= argument"),
        ("--local-batch", "0", "--local-batch must be >= 1, got 0"),
    ],
)
def test_seq_len_and_local_batch_usage_errors(command, flag, value, message, capsys, tmp_path):
    from fsdp2_compile.cli.main import main

    out = ["--out", str(tmp_path)] if command == "dump" else []
    code = main([command, f"{FACTORIES}:tiny", "--world-size", "2", flag, value, *out, "-q"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert message in captured.err and "Traceback" not in captured.err
