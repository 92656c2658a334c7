"""What people read from a compiled graph: the compact view (graph.svg / graph.dot), the compile log lines, sizes in
the unit that fits, and a dump folder that cannot be written (training goes on)."""

from __future__ import annotations

import logging
import xml.etree.ElementTree as ET

import pytest

SVG = "{http://www.w3.org/2000/svg}"


def compile_tiny(mp: bool = False):
    """The 2-block tiny model sharded per block over the fake group, one forward + backward; its graph records."""
    import cli_factories
    import torch

    import fsdp2_compile as fc
    from fsdp2_compile.report import clear_compiled_graphs, compiled_graphs

    clear_compiled_graphs()
    model, (idx,) = cli_factories.tiny()
    policy = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None
    kwargs = {"mp_policy": policy} if mp else {}
    for block in model.blocks:
        fc.shard(block, **kwargs)
    fc.shard_compile(model, compile_config=fc.CompileConfig(hardware="cpu-gloo-loopback"), **kwargs)
    model(idx).sum().backward()
    records = compiled_graphs()
    clear_compiled_graphs()
    return model, records


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16"])
def test_compact_view_rows(fake_pg, mp):
    """One row per collective and wait, casts of a bucket in one row, consecutive compute merged with no view op
    named, every parameter shard input named by its parameter; far fewer rows than nodes."""
    from fsdp2_compile.graph_view import compact_rows, input_params
    from fsdp2_compile.ir import WAIT, collective_kind

    model, records = compile_tiny(mp)
    names = {n for n, _ in model.named_parameters()}
    for record in records:
        nodes = list(record.gm.graph.nodes)
        rows = compact_rows(record.gm)
        assert len(rows) * 4 < len(nodes)
        assert sorted(n for row in rows for n in row.nodes) == sorted(nodes)  # every node in exactly one row
        for row in rows:
            comm = [n for n in row.nodes if collective_kind(n) is not None or n.target is WAIT]
            assert len(comm) == (row.category in ("all_gather", "reduce_scatter", "all_reduce", "wait"))
            assert row.category != "compute" or not {"view", "reshape", "slice", "t"} & set(
                op.split(" ")[0] for op in row.text.split(": ", 1)[1].split(", "))
        for a, b in zip(rows, rows[1:]):
            assert not (a.category == b.category == "compute")
        casts = [r for r in rows if r.category == "cast"]
        if mp and record.kind == "forward":  # one row per bucket: 3 buckets, every parameter cast to bf16
            assert len(casts) == 3 and all("bfloat16" in r.text for r in casts)
        carried = {param for param, _ in input_params(record.gm).values()}
        if record.kind == "forward":
            assert carried == names
            shown = " ".join(r.text for r in rows if r.category == "input")
            assert all(n.rpartition(".")[2] in shown for n in names) and "bucket 'blocks.0'" in shown
        else:  # backward gathers again what it needs: the blocks' parameters (reshard_after_forward)
            assert carried and carried <= names


def test_svg_labels_fit_their_boxes(fake_pg, tmp_path):
    """The built-in SVG: valid XML, each text's pinned width (textLength) inside its box, no label cut short."""
    from fsdp2_compile.graph_view import compact_rows, text_width, write_dot, write_svg

    _, records = compile_tiny()
    gm = records[1].gm
    assert write_svg(gm, str(tmp_path / "g.svg"), "backward graph") == "builtin"  # no `dot` binary here
    root = ET.parse(tmp_path / "g.svg").getroot()
    rects = [r for r in root.iter(f"{SVG}rect") if r.get("height") != "12" and r.get("width") != "100%"]
    texts = list(root.iter(f"{SVG}text"))
    box_right = max(float(r.get("x")) + float(r.get("width")) for r in rects)
    for t in texts:
        assert float(t.get("textLength")) == pytest.approx(text_width(t.text, float(t.get("font-size"))), abs=0.1)
        assert float(t.get("x")) + float(t.get("textLength")) <= max(box_right, float(root.get("width")))
    rows = compact_rows(gm)
    assert len(rects) == len(rows)
    shown = " ".join(t.text for t in texts)
    for row in rows:  # wrapped, never truncated: every word of every row is drawn
        assert all(word in shown for word in row.text.split())
    write_dot(gm, str(tmp_path / "g.dot"), "backward graph")
    dot = (tmp_path / "g.dot").read_text()
    assert dot.startswith("digraph") and dot.count("  r") - dot.count(" -> ") == len(rows) and "legend_wait" in dot


def test_compile_logs_one_line_at_start_and_end(fake_pg, caplog):
    caplog.set_level(logging.INFO, logger="fsdp2_compile")
    compile_tiny()
    lines = [r.getMessage() for r in caplog.records if r.name == "fsdp2_compile"]
    starts = [m for m in lines if m.startswith("compiling ")]
    ends = [m for m in lines if m.startswith("compiled ")]
    assert [m.split()[1] for m in starts] == ["forward", "backward"]
    assert ends[0].startswith("compiled forward graph in ") and "3 all_gather, 0 reduce_scatter, 0 all_reduce" in ends[0]
    assert "3 all_gather, 3 reduce_scatter, 0 all_reduce" in ends[1]


def test_unwritable_dump_folder_warns_once_and_training_goes_on(fake_pg, tmp_path, monkeypatch, caplog):
    from fsdp2_compile.report import dump_requested

    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("FSDP2_COMPILE_DUMP", str(blocker))
    caplog.set_level(logging.WARNING)
    _, records = compile_tiny()  # forward and backward both compiled and ran
    assert [r.kind for r in records] == ["forward", "backward"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "DUMP" in r.getMessage()]
    assert len(warnings) == 1 and f"FSDP2_COMPILE_DUMP={blocker}" in warnings[0]
    assert not dump_requested()  # no snapshots kept for a dump that cannot be written


@pytest.mark.parametrize("n, text", [(0, "0 B"), (512, "512 B"), (3 * 1024 + 256, "3.25 KiB"),
                                     (1.5 * 2**20, "1.50 MiB"), (2 * 2**30, "2.00 GiB")])
def test_size_text(n, text):
    from fsdp2_compile.dump import size_text

    assert size_text(n) == text


def test_summary_sizes_fit(fake_pg):
    from fsdp2_compile.dump import summarize

    _, records = compile_tiny()
    summary = summarize(records)
    assert "KiB" in summary and "0.00 MiB" not in summary
