"""The code blocks of README.md and docs/*.md run as written, and the benchmark tables are run.py's output.

Marker convention: the fence's info string is the language, then one marker (GitHub shows only the language).
Every block in python, bash, sh or shell carries exactly one of:

    ```python torchrun=N   a whole script: written to a temporary folder under the name its first line gives
                           (`# use.py — run with: ...`, else block.py) and run there with
                           `python -m torch.distributed.run --nproc-per-node N` (gloo on CPU); must exit 0.
    ```bash run            shell commands, one a line (comments and blank lines skipped), each run with bash from the
                           repository root with the venv's bin first on PATH; each must exit 0.
    ```python snippet=NAME a fragment that needs context (a model, a mesh size): SNIPPETS[NAME] runs it as written
                           with that context and checks its result.
    ```bash norun          not run: set-up commands, fragments without their context, runs too long for the suite.

Blocks in any other language (`text`, none) are output samples or pseudo-code and are never run.
A generated table sits between `<!-- benchmark table: CMD -->` and `<!-- end benchmark table -->`; it must equal
`benchmarks/run.py --markdown benchmarks/results.json` (the step table only where CMD says "(step table)").
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
CODE_LANGUAGES = {"python", "bash", "sh", "shell"}
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)


def blocks(page: str) -> list[dict]:
    """Every fenced block of `page`: language, marker (or None), body (dedented), line."""
    text = open(os.path.join(ROOT, page)).read()
    found = []
    for m in FENCE.finditer(text):
        language, *attrs = m["info"].split() or [""]
        found.append(
            dict(
                page=page,
                line=text.count("\n", 0, m.start()) + 1,
                language=language,
                attrs=attrs,
                body=textwrap.dedent(m["body"]),
            )
        )
    return found


ALL = [b for page in PAGES for b in blocks(page)]


def runnable(marker: str) -> list:
    return [
        pytest.param(b, id=f"{b['page']}:{b['line']}")
        for b in ALL
        if b["language"] in CODE_LANGUAGES and b["attrs"] and b["attrs"][0].split("=")[0] == marker
    ]


def test_every_code_block_is_marked():
    unmarked = [
        f"{b['page']}:{b['line']}"
        for b in ALL
        if b["language"] in CODE_LANGUAGES
        and (len(b["attrs"]) != 1 or b["attrs"][0].split("=")[0] not in ("torchrun", "run", "snippet", "norun"))
    ]
    assert not unmarked, f"code blocks without exactly one marker (see this file's docstring): {unmarked}"
    assert runnable("torchrun") and runnable("run") and runnable("snippet")


@pytest.mark.parametrize("block", runnable("torchrun"))
def test_script_block_runs_as_written(block, tmp_path):
    ranks = int(block["attrs"][0].split("=")[1])
    name = re.match(r"# (\w+\.py)\b", block["body"])
    script = tmp_path / (name[1] if name else "block.py")
    script.write_text(block["body"])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    if script.name == "use.py":  # README's example trains: every rank's loss falls over its 5 steps
        for rank in range(ranks):
            losses = [float(v) for v in re.findall(rf"rank {rank} step \d loss ([\d.]+)", proc.stdout)]
            assert len(losses) == 5 and losses[-1] < losses[0], proc.stdout


@pytest.mark.parametrize("block", runnable("run"))
def test_shell_block_runs_as_written(block, tmp_path):
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    for line in block["body"].splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        proc = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"


def _tp(body: str) -> None:
    from harness import run_ranks
    from workers import docs_tp_snippet

    for r in run_ranks(docs_tp_snippet, 4, body):
        assert r["tp_grad_error"] < 1e-5, r
        meshes = r["tp_meshes"]  # TP'd weights on the (dp, tp) mesh, the rest (norms, embedding, head) over dp
        assert meshes["layers.0.attn.wq.weight"] == meshes["layers.1.mlp.w2.weight"] == ("dp", "tp"), meshes
        assert meshes["layers.0.attn_norm.weight"] == meshes["embed.weight"] == ("dp",), meshes


SNIPPETS = {"tp": _tp}


@pytest.mark.parametrize("block", runnable("snippet"))
def test_snippet_block_runs_as_written(block):
    SNIPPETS[block["attrs"][0].split("=")[1]](block["body"])


# ---------------------------------------------------------------------------------------------- benchmark tables


def _run_py():
    spec = importlib.util.spec_from_file_location("benchmarks_run", os.path.join(ROOT, "benchmarks", "run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_markdown_rendering_of_a_small_results_file(tmp_path):
    report = dict(
        command="benchmarks/run.py --modes fsdp2 full",
        commit="abc1234",
        date="2026-01-01",
        rate="8mbit",
        steps=3,
        params=2_000_000,
        world=2,
        compute_s=1.0,
        crashes=[],
        rows=[
            dict(
                link="loopback",
                mode="fsdp2",
                median_s=2.0,
                peak_rss_mib=400,
                collectives_per_step=None,
                bytes_per_step=None,
            ),
            dict(
                link="loopback",
                mode="full",
                median_s=1.5,
                peak_rss_mib=300,
                collectives_per_step=6,
                bytes_per_step=3_000_000,
            ),
            dict(
                link="8mbit",
                mode="fsdp2",
                median_s=4.0,
                peak_rss_mib=400,
                collectives_per_step=None,
                bytes_per_step=None,
            ),
            dict(
                link="8mbit",
                mode="full",
                median_s=3.3,
                peak_rss_mib=500,
                collectives_per_step=6,
                bytes_per_step=3_000_000,
            ),
        ],
        compile=[
            dict(layers=4, first_minus_median_s=2.0, compiling_s=1.0),
            dict(layers=8, first_minus_median_s=5.0, compiling_s=1.5),
        ],
    )
    text = _run_py().render_markdown(report)
    assert text.startswith("Measured at abc1234 with `benchmarks/run.py --modes fsdp2 full`: GPT of 2.0 M")
    # loopback: the floor is the compute alone; 8 Mbit/s = 1 MB/s, so 3 MB a step floors at 3 s (fsdp2 rows use full's)
    assert "| loopback | full | 1.500 s | 0.75x | 1.000 s | 1.50x | 300 MiB | 0.75x | 6 | 3.0 |" in text
    assert "| 8mbit | fsdp2 | 4.000 s | 1.00x | 3.000 s | 1.33x | 400 MiB | 1.00x | - | - |" in text
    assert "| 8mbit | full | 3.300 s | 0.82x | 3.000 s | 1.10x | 500 MiB | 1.25x | 6 | 3.0 |" in text
    assert "| 8 | 5.0 s | 2.50x | 1.5 s | 1.50x |" in text
    assert "| layers |" not in _run_py().render_markdown(report, compile_table=False)
    path = tmp_path / "results.json"
    path.write_text(__import__("json").dumps(report))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--markdown", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == text, proc.stderr


def test_the_pages_tables_are_run_py_output():
    import json

    with open(os.path.join(ROOT, "benchmarks", "results.json")) as f:
        report = json.load(f)
    run = _run_py()
    found = 0
    for page in PAGES:
        text = open(os.path.join(ROOT, page)).read()
        for cmd, table in re.findall(
            r"<!-- benchmark table: (.*?) -->\n(.*?)\n<!-- end benchmark table -->", text, re.S
        ):
            assert "benchmarks/run.py --markdown benchmarks/results.json" in cmd, (page, cmd)
            assert table == run.render_markdown(report, compile_table="(step table)" not in cmd), page
            found += 1
    assert found >= 2


def test_the_data_flow_figure_lists_the_pass_list(tmp_path):
    """docs/img/data_flow.svg (benchmarks/figures.py) names every pass of the pass list, in its order: a pass added,
    renamed or moved makes the committed figure stale (`make figures` draws it again)."""
    pytest.importorskip("matplotlib")
    import xml.etree.ElementTree as ET

    spec = importlib.util.spec_from_file_location("figures", os.path.join(ROOT, "benchmarks", "figures.py"))
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    names = [p.__name__ for p in figures.pass_list()]
    figures.draw_data_flow(str(tmp_path / "data_flow.svg"))
    for path in (tmp_path / "data_flow.svg", os.path.join(ROOT, "docs", "img", "data_flow.svg")):
        texts = [
            "".join(t.itertext()).strip() for t in ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}text")
        ]
        assert [t for t in texts if t in names] == names, path


def test_no_tracked_file_speaks_of_sessions_or_issue_numbers():
    files = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT).stdout.split()
    words = re.compile(r"\bsessions?\b|\bissue [0-9]+|\bhelper-[0-9]", re.I)
    hits = [
        f
        for f in files
        if os.path.isfile(os.path.join(ROOT, f)) and words.search(open(os.path.join(ROOT, f), errors="replace").read())
    ]
    assert not hits, hits
