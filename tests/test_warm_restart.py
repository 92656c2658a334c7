"""Warm restarts (`CompileConfig.cache_dir`): a relaunch loads the compile a launch saved (torch's ahead-of-time
compile) and trains bitwise equal; a file that cannot be used is named in a warning, compiled again on every rank
and replaced; a file of another world size, config or model is never loaded."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn
from warm_workers import first_call, train_cached

from fsdp2_compile.compiler.warm_start import MAGIC


def _same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["shards"][k], b["shards"][k]) for k in a["shards"])


def _whats(result: dict) -> list[str]:
    return [what for what, _ in result["events"]]


def test_a_relaunch_loads_and_trains_bitwise_equal_and_a_garbled_file_is_compiled_again(tmp_path):
    cache = str(tmp_path)
    cold = run_ranks(train_cached, 2, cache, [{}])
    for [c] in cold:
        assert _whats(c) == ["miss", "stored"]
    assert len(list(tmp_path.glob("*.bin"))) == 2  # one file per rank
    warm = run_ranks(train_cached, 2, cache, [{}], "mlp", 2, True)
    for rank, [hit] in enumerate(warm):
        assert _whats(hit) == ["hit"] and _same(hit, cold[rank][0])  # nothing traced or compiled
        assert hit["events"][0][1] == cold[rank][0]["events"][0][1]
        assert "changed between a forward and its backward" in hit["flip_error"]

    garbled = Path(cold[1][0]["events"][0][1])  # rank 1's file of the first launch, 8 bytes in its middle flipped
    data = bytearray(garbled.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8] = bytes(b ^ 0xFF for b in data[len(data) // 2 :][:8])
    garbled.write_bytes(bytes(data))
    again = run_ranks(train_cached, 2, cache, [{}])
    # rank 1 warns; both ranks compile again (one decision everywhere) and train as the first launch did
    assert _whats(again[0][0]) == ["miss", "stored"] and not again[0][0]["warnings"]
    assert _whats(again[1][0]) == ["unreadable", "miss", "stored"]
    [warning] = again[1][0]["warnings"]
    assert str(garbled) in warning and "checksum" in warning and "compiling again" in warning
    for rank in (0, 1):
        assert _same(again[rank][0], cold[rank][0])
    replaced = garbled.read_bytes()  # a whole file again, its checksum right
    assert hashlib.sha256(replaced[len(MAGIC) + 65 :]).hexdigest().encode() == replaced[len(MAGIC) : len(MAGIC) + 64]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


class _Branchy(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y * 2 if y.sum() > 0 else y  # data-dependent: a graph break


def _relaunched() -> None:
    """This process as a relaunch: it loads the files it saved (a process compiles again rather than load its own)."""
    from fsdp2_compile.compiler import warm_start

    warm_start._SAVED_HERE.clear()


def _first_call(cache_dir, world: int, out_features: int = 8, cls: type = nn.Linear, **config) -> list[str]:
    """The cache events of the first call of a sharded `cls(8, out_features)` on a fake process group of `world`
    ranks."""
    import fsdp2_compile as fc
    from fsdp2_compile._torch_private import clear_dtensor_caches, fake_process_group
    from fsdp2_compile.compiler.warm_start import cache_events

    fake_process_group(rank=0, world_size=world)
    try:
        torch.manual_seed(0)
        model = fc.shard_compile(
            cls(8, out_features), compile_config=fc.CompileConfig(cache_dir=str(cache_dir), **config)
        )
        before = len(cache_events())
        model(torch.randn(2, 8)).sum().backward()
        return [what for what, _ in cache_events()[before:]]
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()


def test_gradient_sync_changed_after_a_forward_runs_a_variant_where_compiled_and_the_file_is_deleted(tmp_path):
    """As pipeline schedules do: the process that compiled the module runs the backward variant, as the ordinary
    compile does, and deletes its file (a loaded backward could not follow); the relaunch compiles again."""
    variant = [{}]
    first = run_ranks(train_cached, 2, str(tmp_path), variant, "mlp", 2, True)
    for [r] in first:
        assert "flip_error" not in r and r["flip_events"] == ["miss", "stored", "dropped"], r
        assert r["flip_reduced"] and not any(r["flip_reduced"])  # the variant ran: gradients kept unsharded
    assert not list(tmp_path.glob("*.bin"))
    for [r], [before] in zip(run_ranks(train_cached, 2, str(tmp_path), variant), first):
        assert _whats(r) == ["miss", "stored"] and r["losses"] == before["losses"], r


def test_files_of_another_world_size_config_or_model_are_not_loaded_and_a_graph_break_compiles_as_usual(
    tmp_path, caplog
):
    with caplog.at_level(logging.WARNING, logger="fsdp2_compile"):
        assert _first_call(tmp_path, 2) == ["miss", "stored"]
        assert _first_call(tmp_path, 4) == ["miss", "stored"]
        _relaunched()
        assert _first_call(tmp_path, 4) == ["hit"]
        assert _first_call(tmp_path, 2, schedule=False) == ["miss", "stored"]
        assert _first_call(tmp_path, 2, out_features=16) == ["miss", "stored"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "fsdp2_compile"]
    assert len(list(tmp_path.glob("*.bin"))) == 4
    with caplog.at_level(logging.WARNING, logger="fsdp2_compile"):  # one graph is needed: compiled as usual
        assert _first_call(tmp_path, 2, cls=_Branchy) == ["miss", "uncompiled"]
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "fsdp2_compile"]
    assert "cannot be compiled ahead of time" in warning and "nothing is saved" in warning
    assert len(list(tmp_path.glob("*.bin"))) == 4


def test_cache_dir_through_torch_compile_is_refused_by_name(tmp_path):
    import fsdp2_compile as fc
    from fsdp2_compile._torch_private import clear_dtensor_caches, fake_process_group
    from fsdp2_compile.api import make_backend

    fake_process_group(rank=0, world_size=2)
    try:
        model = fc.shard(nn.Linear(8, 8))
        compiled = torch.compile(model, backend=make_backend(fc.CompileConfig(cache_dir=str(tmp_path))))
        with pytest.raises(Exception, match=r"CompileConfig.cache_dir is read by fsdp2_compile.shard_compile"):
            compiled(torch.randn(2, 8))
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()


def test_a_module_switched_to_eval_after_its_first_call_does_not_run_the_saved_training_graph(tmp_path):
    import fsdp2_compile as fc
    from fsdp2_compile._torch_private import clear_dtensor_caches

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
        reference = nn.Sequential(nn.Linear(8, 8))
        reference.load_state_dict(model.state_dict(), strict=False)
        fc.shard_compile(model, compile_config=fc.CompileConfig(cache_dir=str(tmp_path)))
        x = torch.randn(4, 8)
        model(x).sum().backward()  # traced and saved in training mode: dropout in the graph
        model.eval()
        torch.testing.assert_close(model(x).detach(), reference(x).detach())
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.scale = nn.Linear(8, 8), 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


def _one_rank(fn):
    """`fn()` on a gloo process group of one rank (no collectives: real outputs), destroyed after."""
    from fsdp2_compile._torch_private import clear_dtensor_caches

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return fn()
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()


def test_by_default_inductor_saves_in_torchs_cache_directory_and_aot_eager_saves_nothing(tmp_path, monkeypatch):
    """`cache_dir="auto"`, the default: under Inductor, `fsdp2_compile/` in torch's compile cache directory, or the
    directory $FSDP2_COMPILE_CACHE_DIR names; under aot_eager nothing is saved."""
    import fsdp2_compile as fc
    from fsdp2_compile.compiler.graph_records import compiled_graphs
    from fsdp2_compile.compiler.warm_start import cache_events

    monkeypatch.delenv("FSDP2_COMPILE_CACHE_DIR")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    records = []

    def first_calls(config: fc.CompileConfig) -> list[tuple[str, str]]:
        before = len(cache_events())
        for _ in range(2):  # the second model, the same as the first, compiles: a process loads no file it saved
            torch.manual_seed(0)
            model = fc.shard_compile(nn.Linear(8, 8), compile_config=config)
            model(torch.ones(3, 8)).sum().backward()
            records.append(sorted(r.kind for r in compiled_graphs() if r.owner == id(model)))
        return cache_events()[before:]

    events = _one_rank(lambda: first_calls(fc.CompileConfig(compiler="inductor")))
    assert [what for what, _ in events] == ["miss", "stored"] * 2
    assert records == [["backward", "forward"]] * 2
    assert os.path.dirname(events[0][1]) == str(tmp_path / "fsdp2_compile") and os.path.exists(events[0][1])
    monkeypatch.setenv("FSDP2_COMPILE_CACHE_DIR", str(tmp_path / "elsewhere"))
    events = _one_rank(lambda: first_calls(fc.CompileConfig(compiler="inductor")))
    assert os.path.dirname(events[0][1]) == str(tmp_path / "elsewhere") and os.path.exists(events[0][1])
    for config in (fc.CompileConfig(), fc.CompileConfig(compiler="aot_eager", cache_dir="auto")):  # the CPU default
        assert _one_rank(functools.partial(first_calls, config)) == []


def test_a_hook_added_or_an_attribute_changed_after_the_first_call_is_not_run_through_the_saved_compile(tmp_path):
    """What Dynamo guarded on the module (its attributes read, its hook dicts) is checked at every call of a
    saved compile, and a loaded one compares it with the values it was traced with; a call that differs runs the
    ordinary compile (which, as torch.compile, does not see hooks added after it compiled)."""
    import copy

    import fsdp2_compile as fc
    from fsdp2_compile.compiler.warm_start import cache_events

    def run() -> list[str]:
        before = len(cache_events())
        torch.manual_seed(0)
        reference = _Scaled()
        model = fc.shard_compile(copy.deepcopy(reference), compile_config=fc.CompileConfig(cache_dir=str(tmp_path)))
        x = torch.randn(4, 8)
        torch.testing.assert_close(model(x), reference(x))
        seen = []
        model.inner.register_forward_hook(lambda *_: seen.append("hook"))
        model(x)
        assert seen == ["hook"]
        model.scale = reference.scale = 3.0
        torch.testing.assert_close(model(x), reference(x))
        return [what for what, _ in cache_events()[before:]]

    assert _one_rank(run) == ["miss", "stored"]

    def hooked_before_its_first_call() -> list[str]:  # the same key: loaded, but not run with a hook it lacks
        before = len(cache_events())
        torch.manual_seed(0)
        model = fc.shard_compile(_Scaled(), compile_config=fc.CompileConfig(cache_dir=str(tmp_path)))
        seen = []
        model.inner.register_forward_hook(lambda *_: seen.append("hook"))
        model(torch.randn(4, 8))
        assert seen == ["hook"]
        return [what for what, _ in cache_events()[before:]]

    _relaunched()
    assert _one_rank(hooked_before_its_first_call) == ["hit"]


_DOUBLE = True
"""A module-level setting the traced code reads (Dynamo guards it as a global)."""


class _Flagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return y * 2 if _DOUBLE else y


def test_a_global_changed_after_the_first_call_and_a_retained_graph_are_as_without_a_saved_compile(tmp_path):
    """A module-level variable the forward read is compared at every call, where compiled and where loaded; a
    backward run twice (`retain_graph=True`) adds its gradients twice, as torch.compile's does."""
    import copy

    import fsdp2_compile as fc
    from fsdp2_compile.compiler.warm_start import cache_events

    def run() -> list[str]:
        global _DOUBLE
        before = len(cache_events())
        torch.manual_seed(0)
        reference = _Flagged()
        model = fc.shard_compile(copy.deepcopy(reference), compile_config=fc.CompileConfig(cache_dir=str(tmp_path)))
        x = torch.randn(4, 8)
        try:
            for double in (True, False):
                _DOUBLE = double
                loss, expected = model(x).sum(), reference(x).sum()
                torch.testing.assert_close(loss, expected)
                for _ in range(2):
                    loss.backward(retain_graph=True)
                    expected.backward(retain_graph=True)
                grad = dict(model.named_parameters())["inner.weight"].grad.full_tensor()
                torch.testing.assert_close(grad, reference.inner.weight.grad)
        finally:
            _DOUBLE = True
        return [what for what, _ in cache_events()[before:]]

    assert _one_rank(run) == ["miss", "stored"]
    _relaunched()
    assert _one_rank(run) == ["hit"]


def test_the_key_is_the_same_in_every_process():
    """torch's compile settings enter the key through a digest that does not depend on Python's hash seed (the
    config modules' own hashes pickle sets, whose order does)."""
    import subprocess
    import sys

    code = "from fsdp2_compile._torch_private import compile_settings_digest; print(compile_settings_digest())"
    digests = {
        subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(digests) == 1 and len(digests.pop().strip()) == 64


_HELPER = """
import torch
from torch import nn


def helper(y):
    return y * {factor}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x):
        return helper(self.inner(x))
"""


def test_a_file_whose_traced_code_changed_since_it_was_saved_is_compiled_again(tmp_path, monkeypatch):
    """The key holds the code of the module's classes; code they call (a helper function) is checked when a
    file is loaded, by the source of every module Dynamo traced through."""
    import importlib
    import sys

    import fsdp2_compile as fc
    from fsdp2_compile.compiler.warm_start import cache_events

    source = tmp_path / "traced_helper.py"
    monkeypatch.syspath_prepend(str(tmp_path))

    def launch(factor: str) -> tuple[list[str], torch.Tensor]:
        source.write_text(_HELPER.format(factor=factor))
        module = importlib.reload(sys.modules["traced_helper"]) if "traced_helper" in sys.modules else None
        module = module or importlib.import_module("traced_helper")
        before = len(cache_events())
        torch.manual_seed(0)
        model = fc.shard_compile(module.Net(), compile_config=fc.CompileConfig(cache_dir=str(tmp_path / "cache")))
        out = model(torch.ones(2, 8))
        torch.manual_seed(0)
        torch.testing.assert_close(out, module.Net()(torch.ones(2, 8)))
        return [what for what, _ in cache_events()[before:]], out

    try:
        assert _one_rank(lambda: launch("2.0"))[0] == ["miss", "stored"]
        _relaunched()
        assert _one_rank(lambda: launch("2.0"))[0] == ["hit"]
        assert _one_rank(lambda: launch("3.25"))[0] == ["stale", "miss", "stored"]
    finally:
        sys.modules.pop("traced_helper", None)


def test_under_inductor_a_launch_that_saves_and_its_relaunch_accumulate_bitwise_as_without_cache_dir(tmp_path):
    """`compiler="inductor"` on a GPT whose blocks are sharded (traced once where Inductor takes them), gradients
    accumulated over two micro-batches with sync off for the first: the launch that compiles and saves, the relaunch
    that loads and a model without `cache_dir` train bitwise alike."""
    inductor = {"compiler": "inductor"}
    # the saved model first in both launches: the keys of its kept state, in its graphs, are the same
    cold = run_ranks(train_cached, 2, str(tmp_path), [inductor, inductor | {"cache_dir": None}], "gpt", 1, False, True)
    warm = run_ranks(train_cached, 2, str(tmp_path), [inductor], "gpt", 1, False, True)
    for [saved, plain], [loaded] in zip(cold, warm):
        assert (_whats(plain), _whats(saved), _whats(loaded)) == ([], ["miss", "stored"], ["hit"])
        assert _same(saved, plain) and _same(loaded, plain), (plain["losses"], saved["losses"], loaded["losses"])


def test_a_rank_without_cache_dir_is_named_at_once_on_every_rank(tmp_path):
    """The ranks agree at the first call, before compiling: a rank that differs in `cache_dir` is named by the
    ranks with it and by itself, without either waiting for the other until the timeout."""
    outs = run_ranks(first_call, 2, [str(tmp_path), None])
    for out in outs:
        assert "rank 1 has CompileConfig.cache_dir=None, rank 0 a directory" in out["error"], out
        assert out["seconds"] < 10, out
    assert not list(tmp_path.glob("*.bin"))


def test_the_link_is_measured_only_when_no_profile_is_named_and_something_compiles(tmp_path):
    assert [o["measured"] for o in run_ranks(first_call, 2, [None, None])] == [True, True]
    assert [o["measured"] for o in run_ranks(first_call, 2, [None, None], "cpu-gloo-loopback")] == [False, False]
    cache = [str(tmp_path)] * 2
    assert [o["measured"] for o in run_ranks(first_call, 2, cache)] == [True, True]  # compiled and saved
    assert [o["measured"] for o in run_ranks(first_call, 2, cache)] == [False, False]  # loaded: nothing compiles
