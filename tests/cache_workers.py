"""What the compile-cache tests run on each rank: models compiled with `CompileConfig(compile_cache=True)` whose
calls change every kind of thing Dynamo guards, each call compared with the same model unsharded."""

from __future__ import annotations

import copy
import dataclasses
import enum
import importlib
import os
import shutil
import sys
from collections.abc import Callable

import torch
from models import batch, local_slice, loss_fn, make_model, make_optimizer
from torch import nn

import fsdp2_compile as fc
from fsdp2_compile.compiler.compile_cache import cache_events

FLAG = True
"""A module-level flag the model reads."""
TABLE = {"bias": 0.5}
"""A module-level dict the model reads."""
HELPER = None
"""`cache_helper`, a module of the test's that it may edit between launches."""


class Mode(enum.Enum):
    SUM = "sum"
    MAX = "max"


@dataclasses.dataclass
class Options:
    power: int = 2
    shift: float = 0.0


class Config:
    """A nested config object, as Hugging Face models read `self.config`."""

    def __init__(self):
        self.act = "relu"
        self.scales = {"out": 1.0}
        self.extra = [1.0]


def _double(y: torch.Tensor) -> torch.Tensor:
    return y * 2


def _negate(y: torch.Tensor) -> torch.Tensor:
    return -y


class Probe(nn.Module):
    """A forward that reads each kind of non-tensor argument and nested state."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.drop = nn.Dropout(0.0)
        self.cfg = Config()
        self.post = _double

    def forward(
        self,
        x,
        mask=None,
        k: int = 1,
        scale: float = 1.0,
        flip: bool = False,
        mode: str = "mean",
        kind: Mode = Mode.SUM,
        opts: Options = Options(),
        dims: tuple = (0,),
    ):
        h = self.fc1(x)
        h = torch.relu(h) if self.cfg.act == "relu" else torch.tanh(h)
        y = self.fc2(self.drop(h)) * self.cfg.scales["out"] * len(self.cfg.extra)
        y = HELPER.helper(y)
        if mask is not None:
            y = y * mask
        if flip:
            y = -y
        y = self.post(y) * k * scale
        if FLAG:
            y = y + TABLE["bias"]
        y = (y + opts.shift).pow(opts.power)
        y = y.amax(dim=dims) if kind is Mode.MAX else y.sum(dim=dims)
        return y.mean() if mode == "mean" else y.sum()


def _calls(x: torch.Tensor) -> list[tuple[str, dict, Callable | None]]:
    """(name, kwargs, a change to the model or its globals before the call): each kind of thing Dynamo guards,
    changed between calls."""
    mask = torch.rand(x.shape, generator=torch.Generator().manual_seed(1))
    this = sys.modules[__name__]
    return [
        ("plain", {}, None),
        ("mask tensor", {"mask": mask}, None),
        ("mask None", {"mask": None}, None),
        ("int", {"k": 3}, None),
        ("float", {"scale": 0.25}, None),
        ("bool", {"flip": True}, None),
        ("str", {"mode": "sum"}, None),
        ("enum", {"kind": Mode.MAX}, None),
        ("dataclass", {"opts": Options(power=3, shift=0.5)}, None),
        ("tuple length", {"dims": (0, 1)}, None),
        ("config field", {}, lambda m: setattr(m.cfg, "act", "tanh")),
        ("dict value", {}, lambda m: m.cfg.scales.__setitem__("out", 3.0)),
        ("list length", {}, lambda m: m.cfg.extra.append(2.0)),
        ("attribute function", {}, lambda m: setattr(m, "post", _negate)),
        ("global flag", {}, lambda m: setattr(this, "FLAG", False)),
        ("module-level dict", {}, lambda m: TABLE.__setitem__("bias", -2.0)),
        ("eval", {}, lambda m: m.eval()),
        ("train", {}, lambda m: m.train()),
    ]


def _reset_globals() -> None:
    global FLAG
    FLAG = True
    TABLE["bias"] = 0.5


def probe_calls(rank: int, world_size: int, helper_dir: str, changed: list[str], package_changed: bool) -> dict:
    """Each of `_calls` on a `Probe` sharded and compiled with `compile_cache`, from the state its earlier calls
    left, plus a call without grad; each loss and gradient compared with an unsharded copy's. `changed`: what is
    set before the first call (as a relaunch after editing the model would see it: names of `_calls`), and
    `cache_helper` is imported from `helper_dir` (a test may edit it between launches). `package_changed`: this
    package's source digest as if its code had changed. Returns the calls whose result differed and the events."""
    torch._dynamo.config.recompile_limit = 64  # this process's: every call below compiles
    sys.path.insert(0, helper_dir)
    import cache_helper

    global HELPER
    HELPER = importlib.reload(cache_helper)
    if package_changed:
        from fsdp2_compile.compiler import compile_cache

        compile_cache.package_digest.cache_clear()
        digest = compile_cache.package_digest()
        compile_cache.package_digest = lambda: "changed " + digest
    _reset_globals()
    torch.manual_seed(0)
    ref = Probe()
    model = copy.deepcopy(ref)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    calls = _calls(x)
    for name, _, change in calls:
        if name in changed:
            change(ref)
            change(model)
    fc.shard_compile(model, compile_config=fc.CompileConfig(compile_cache=True))
    wrong = []
    before = len(cache_events())
    for name, kwargs, change in [*calls, ("no grad", {}, None)]:
        if change is not None:
            change(ref)
            change(model)
        with torch.set_grad_enabled(name != "no grad"):
            expected, got = ref(x, **kwargs), model(x, **kwargs)
        if name != "no grad":
            expected.backward()
            got.backward()
        if not torch.equal(expected.detach(), got.detach()):
            wrong.append(f"{name}: {got.item()} instead of {expected.item()}")
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            if q.grad is not None and not torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-7):
                wrong.append(f"{name}: gradient of {n}")
        model.zero_grad()
        ref.zero_grad()
    _reset_globals()
    return {"wrong": wrong, "events": cache_events()[before:]}


def output_dtype_call(rank: int, world_size: int, output_dtype: str | None) -> dict:
    """A sharded MLP with `MixedPrecisionPolicy(output_dtype=...)` and `compile_cache`: its output's dtype."""
    policy = fc.MixedPrecisionPolicy(output_dtype=getattr(torch, output_dtype) if output_dtype else None)
    model = fc.shard_compile(make_model("mlp"), mp_policy=policy, compile_config=fc.CompileConfig(compile_cache=True))
    before = len(cache_events())
    out = model(batch("mlp", 0)[0])
    return {"dtype": str(out.dtype), "events": cache_events()[before:]}


def train_cached(
    rank: int,
    world_size: int,
    name: str = "gpt",
    steps: int = 2,
    accumulate: bool = False,
    hsdp: bool = False,
    tp: bool = False,
) -> dict:
    """The test model `name` (a GPT's blocks sharded first) trained `steps` steps with `compile_cache`; with
    `accumulate`, each step in two micro-batches, gradient sync off for the first. Each rank keeps its cache in a
    directory of its own; $EMPTIED_RANK names a rank whose directory is emptied first. `hsdp`: on a (replicate,
    shard) mesh of 2 x world_size / 2; `tp`: the GPT's MLPs tensor parallel over the "tp" dimension of a (dp, tp)
    mesh of world_size / 2 x 2, sharded over "dp". Returns the losses, the local shards and the cache events."""
    from torch.distributed.device_mesh import init_device_mesh

    own = os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], f"rank{rank}")
    if os.environ.get("EMPTIED_RANK") == str(rank):  # as on a machine replaced since the last launch
        shutil.rmtree(own, ignore_errors=True)
    mesh, data_rank, data_size = None, rank, world_size
    if hsdp:  # 2 replicas of 2 shards
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    model = make_model(name)
    if tp:
        from torch.distributed.tensor.parallel import parallelize_module
        from tp_workers import GPT_PLAN

        tp_mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        mesh, data_rank, data_size = tp_mesh["dp"], tp_mesh["dp"].get_local_rank(), tp_mesh["dp"].size()
        for block in model.blocks:
            parallelize_module(block, tp_mesh["tp"], GPT_PLAN)
    for block in getattr(model, "blocks", []):
        fc.shard(block, mesh)
    fc.shard_compile(model, mesh, compile_config=fc.CompileConfig(compile_cache=True))
    opt = make_optimizer(model)
    before = len(cache_events())
    losses = []
    for step in range(steps):
        x, y = (local_slice(t, data_rank, data_size) for t in batch(name, step))
        for micro in (slice(0, None, 2), slice(1, None, 2)) if accumulate else (slice(None),):
            model.set_requires_gradient_sync(micro.start != 0)
            loss = loss_fn(name, model(x[micro]), y[micro])
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    shards = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    out = {"losses": losses, "shards": shards, "events": cache_events()[before:]}
    x, y = (local_slice(t, data_rank, data_size) for t in batch(name, 0))
    loss = loss_fn(name, model(x), y)
    model.set_requires_gradient_sync(False)  # between a forward and its backward
    try:
        loss.backward()
    except RuntimeError as e:
        out["flip_error"] = str(e)
    model.set_requires_gradient_sync(True)
    return out


def first_call(rank: int, world_size: int, compile_caches: list[bool]) -> dict:
    """One step of a `shard_compile`d MLP, rank r with `compile_caches[r]`: the error its first call raised (or
    None) and whether the link of its process group was measured."""
    from fsdp2_compile.runtime.link_profile import measured_profile
    from fsdp2_compile.runtime.param_state import infos_of

    config = fc.CompileConfig(compile_cache=compile_caches[rank])
    model = fc.shard_compile(make_model("mlp"), compile_config=config)
    group_name = next(info.group_name for m in model.modules() for info in infos_of(m).values())
    error = None
    try:
        x, y = batch("mlp", 0)
        loss_fn("mlp", model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    except RuntimeError as e:
        error = str(e)
    return {"error": error, "measured": measured_profile(group_name) is not None}
