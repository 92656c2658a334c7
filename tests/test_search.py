"""`fsdp2-compile plan --search`: its figures for a layout are make_plan's for that layout, exactly; the recipe it
writes builds and trains; bad input fails clearly."""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import cli_factories  # noqa: E402
from harness import run_ranks  # noqa: E402
from search_workers import recipe_step  # noqa: E402

from fsdp2_compile.cli.main import main  # noqa: E402
from fsdp2_compile.cli.model_loading import call_factory, fake_group  # noqa: E402
from fsdp2_compile.config import MixedPrecisionPolicy  # noqa: E402
from fsdp2_compile.planner.candidates import Candidate, enumerate_candidates  # noqa: E402
from fsdp2_compile.planner.layout import Layout  # noqa: E402
from fsdp2_compile.planner.plan import make_plan  # noqa: E402
from fsdp2_compile.planner.search import plan_candidates, search  # noqa: E402

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
TARGET = "tests/cli_factories.py:llama_small"


def _pick(cands, **want):
    for c in cands:
        lay = c.layout
        if all(getattr(lay, k) == v for k, v in want.items()):
            return c
    raise AssertionError(f"no candidate with {want}")


def test_search_figures_are_make_plans():
    """The search derives the full model's shard and the copies' collectives for other dp splits (padding at 3
    ranks, HSDP's all-reduces, no resharding) from stages built once: each figure equals make_plan's."""
    f, n = functools.partial(cli_factories.llama_small, layers=2), 6  # 2 blocks: one compile of the whole model
    with fake_group(n):
        cands, pruned, _ = enumerate_candidates(
            n, 12, 2, 2, "h100-nvlink", base=Layout(n, mp_policy=BF16), degrees={"tp": 1, "pp": None, "replicate": None}
        )
        picks = [
            _pick(cands, replicate=1, pp=1, keep_gathered=0.5, float8=True, ac="selective", prefetch=1),
            _pick(cands, replicate=2, pp=1, reshard_after_forward=False, keep_gathered=None, ac="full", prefetch=2),
            _pick(cands, replicate=1, pp=2, pp_schedule="1F1B", float8=False, ac="none"),
        ]
        scored, built = plan_candidates(f, [cands[0], *picks], "h100-nvlink", 2**40, call=call_factory)
        assert built["copy compiles"] == 1  # one compile served every dp split (shard sizes 6, 3)
        for s in scored[1:]:
            lb = s.candidate.local_batch
            plan = make_plan(
                f,
                s.candidate.layout,
                call=lambda g, lb=lb, **kw: call_factory(g, batch=lb, **kw),
                profiles=["h100-nvlink"],
            )
            assert s.plan.to_json() == plan.to_json(), s.candidate


def test_a_pinned_pp_searches_micro_batches_of_several_samples():
    """With pp pinned the search also tries micro-batches of several samples (each count of at least pp dividing
    the local batch); such a candidate's figures equal make_plan's."""
    f, n = functools.partial(cli_factories.llama_small, layers=2), 4
    with fake_group(n):
        cands, _, _ = enumerate_candidates(
            n, 8, 2, 2, "h100-nvlink", base=Layout(n, mp_policy=BF16), degrees={"tp": 1, "pp": 2, "replicate": 1}
        )
        # 2 blocks: no room for Interleaved1F1B's 2 stages per rank
        assert {(c.layout.pp_schedule, c.layout.microbatches) for c in cands} == {("1F1B", 2), ("1F1B", 4)}
        two_samples = _pick(cands, pp_schedule="1F1B", microbatches=2, float8=False, ac="full")
        [scored], _ = plan_candidates(f, [two_samples], "h100-nvlink", 2**40, call=call_factory)
        plan = make_plan(
            f, two_samples.layout, call=lambda g, **kw: call_factory(g, batch=4, **kw), profiles=["h100-nvlink"]
        )
        assert scored.plan.to_json() == plan.to_json()


def test_search_derives_tp_compiles_for_other_rows():
    """Under TP the search compiles each tp at one row count per micro-batch (and, once, at a second: which of TP's
    collectives scale with the rows); its figures at other row counts equal make_plan's, which compiles each.
    torchtitan's sequence-parallel plan: the norms' replicated weights all-reduce their gradients, bytes the rows
    do not scale."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import llama

    f = functools.partial(cli_factories.llama_small, layers=2)
    f.tp_plan, f.tp_root_plan = llama.tp_plan, llama.TP_ROOT_PLAN
    n = 4
    with fake_group(n):
        lay = Layout(n, tp=2, mp_policy=BF16)
        cands = [Candidate(lay, rows) for rows in (1, 2, 3, 4)]
        scored, built = plan_candidates(f, cands, "h100-nvlink", 2**40, call=call_factory)
        assert built["copy compiles"] == 2  # rows 1 and 2; 3 and 4 derived
        wire = {s.candidate.local_batch: s.plan.tp_comm_bytes_per_step for s in scored}
        assert wire[3] != 3 * wire[1] and wire[3] > wire[1]  # a collective the rows do not scale
        for s in scored[2:]:
            lb = s.candidate.local_batch
            plan = make_plan(
                f, lay, call=lambda g, lb=lb, **kw: call_factory(g, batch=lb, **kw), profiles=["h100-nvlink"]
            )
            assert s.plan.to_json() == plan.to_json(), lb


def test_emitted_recipe_builds_and_trains(tmp_path):
    """--emit-config writes the winner's recipe; two gloo ranks build the model from it and run a step whose loss
    is the unsharded model's (bf16 parameters: within bf16's rounding)."""
    path = tmp_path / "recipe.json"
    code = main(
        [
            "plan",
            TARGET,
            "--world-size",
            "2",
            "--search",
            "--global-batch",
            "4",
            "--hardware",
            "cpu-gloo-loopback",
            "--device-memory",
            str(2**30),
            "--mp",
            "bf16",
            "--tp",
            "1",
            "--pp",
            "1",
            "--replicate",
            "1",
            "--seq-len",
            "16",
            "--emit-config",
            str(path),
            "-q",
            "--json",
        ]
    )
    assert code == 0
    recipe = json.loads(path.read_text())
    assert (recipe["global_batch"], recipe["seq_len"]) == (4, 16)
    names = tuple(recipe["mesh"]["dim_names"])
    dp_dims = ("replicate", "shard") if "replicate" in names else ("dp",)
    results = run_ranks(recipe_step, 2, str(path))
    for r in results:
        assert r["loss"] == pytest.approx(r["reference"], rel=2e-2)
        assert {mesh for _, mesh in r["placements"].values()} == {dp_dims}  # every parameter sharded over dp


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world-size", "8", "--search", "--hardware", "h100-nvlink"], "--search needs --global-batch"),
        (["--world-size", "8", "--search", "--global-batch", "8"], "--search needs --hardware"),
        (["--world-size", "8", "--global-batch", "8"], "--global-batch needs --search"),
        (
            ["--world-size", "8", "--search", "--global-batch", "8", "--hardware", "h100-nvlink", "--tp", "3"],
            "not a multiple of --replicate 1 x --tp 3",
        ),
        (
            [
                "--world-size",
                "8",
                "--search",
                "--global-batch",
                "6",
                "--hardware",
                "h100-nvlink",
                "--tp",
                "2",
                "--pp",
                "1",
            ],
            "--global-batch 6 is not a multiple of the data-parallel size 4",
        ),
        (
            ["--world-size", "8", "--search", "--global-batch", "8", "--hardware", "h100-nvlink", "--ac", "full"],
            "--ac with --search",
        ),
        (
            ["--world-size", "8", "--search", "--global-batch", "8", "--hardware", "h100-nvlink", "--local-batch", "2"],
            "--local-batch with --search: the search enumerates it",
        ),
    ],
)
def test_search_usage_errors(args, message, capsys):
    assert main(["plan", TARGET, *args]) == 2
    assert message in capsys.readouterr().err


def test_search_errors_name_the_constraint_and_the_amount():
    """A model that fits nowhere: the smallest peak, where, and by how much it is over; a global batch no layout
    divides: which sizes it would need."""
    f = cli_factories.llama_small
    with fake_group(2):
        with pytest.raises(
            ValueError,
            match=r"no layout fits: the smallest reserved peak, at .* is .* over the "
            r"device's 1.00 MiB",
        ):
            search(
                f,
                2,
                2,
                "h100-nvlink",
                base=Layout(2, mp_policy=BF16),
                call=call_factory,
                device_memory=2**20,
                degrees={"tp": 1, "pp": 1, "replicate": 1},
            )
        with pytest.raises(ValueError, match="global batch 3 is not a multiple of the data-parallel size"):
            search(
                f,
                2,
                3,
                "h100-nvlink",
                base=Layout(2, mp_policy=BF16),
                call=call_factory,
                degrees={"tp": 1, "pp": 1, "replicate": None},
            )
