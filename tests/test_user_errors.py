"""What a `fully_shard` user gets wrong, and what they are told: each case asserts the message names the module,
parameter or argument and the fix. Validation happens in `shard()`, `shard_compile()`, `CompileConfig` and
`MixedPrecisionPolicy`, before any compilation (CLI argument errors: tests/test_cli.py)."""

from __future__ import annotations

import functools
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from mistake_workers import silent_mistakes
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp2_compile as fc
from fsdp2_compile.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from fsdp2_compile.runtime.free_memory import free_bytes
from fsdp2_compile.runtime.sharding import managed_params


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def raises(exc, *patterns: str):
    """pytest.raises whose message must contain every pattern (plain substrings)."""

    class Check:
        def __enter__(self):
            self.ctx = pytest.raises(exc)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc_info):
            suppressed = self.ctx.__exit__(*exc_info)
            message = str(self.info.value)
            for p in patterns:
                assert p in message, f"{p!r} not in {message!r}"
            return suppressed

    return Check()


# ------------------------------------------------------------------------------------ silently wrong before


def test_optimizer_built_before_shard_is_refused_at_its_first_step(fake_pg):
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    fc.shard(model)
    with raises(RuntimeError, "AdamW holds parameter 'blocks.0.0.weight'", "Build the optimizer after shard"):
        opt.step()
    torch.optim.AdamW(model.parameters()).step()  # the right order steps without a word


def test_a_parameter_shared_with_a_module_outside_the_sharded_one_is_named_at_the_first_step(fake_pg):
    model = Net()
    head = nn.Linear(8, 8)
    head.weight = model.blocks[0][0].weight  # shared with a module that is not sharded
    fc.shard(model)
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()])  # built after shard
    with raises(
        RuntimeError, "AdamW holds parameter 'blocks.0.0.weight'", "Linear.weight, a module outside the sharded"
    ):
        opt.step()


def test_hsdp_mesh_with_dims_named_shard_then_replicate(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate"))
    with raises(ValueError, "('shard', 'replicate')", 'mesh_dim_names=("replicate", "shard")'):
        fc.shard(Net(), mesh)


@pytest.mark.parametrize(
    "value, exc, text",
    [
        (3, ValueError, "must divide the shard group's size 4; use one of [1, 2, 4]"),
        (0, ValueError, "reshard_after_forward=0"),
        ("no", TypeError, "reshard_after_forward='no'"),
    ],
)
def test_reshard_after_forward_must_be_a_bool_or_a_divisor(fake_pg, value, exc, text):
    with raises(exc, text, "True"):
        fc.shard(Net(), reshard_after_forward=value)


def test_ignored_params_must_be_parameters(fake_pg):
    model = Net()
    with raises(TypeError, "item 0 is a LayerNorm", "set(module.parameters())"):
        fc.shard(model, ignored_params=[model.norm])
    with raises(TypeError, "got a single Parameter"):
        fc.shard(model, ignored_params=model.head.weight)
    assert not fc.is_sharded(model)  # nothing half-done


def test_setters_take_bools_only(fake_pg):
    model = fc.shard(Net())
    with raises(TypeError, "set_requires_gradient_sync(requires_gradient_sync='no')", "True or False"):
        model.set_requires_gradient_sync("no")
    with raises(TypeError, "set_reshard_after_forward(reshard_after_forward=1)"):
        model.set_reshard_after_forward(1)
    with raises(TypeError, "set_reshard_after_backward(reshard_after_backward=0)", "True or False"):
        model.set_reshard_after_backward(0)


def test_mp_policy_on_the_root_only_warns_naming_the_blocks(fake_pg):
    model = Net()
    for block in model.blocks:
        fc.shard(block)
    with pytest.warns(UserWarning, match=r"blocks\.0, blocks\.1 were sharded with param_dtype=None.*every shard call"):
        fc.shard(model, mp_policy=fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16))


@functools.cache
def _silent_mistakes() -> list[dict]:
    return run_ranks(silent_mistakes, 2)


@pytest.mark.parametrize(
    "case, words",
    [
        (
            "ignored_param_of_another_model",
            "ValueError: shard(ignored_params=...): item 0 (shape (2, 8)) is not a parameter of Sequential: it "
            "would be ignored while the parameter you meant is sharded",
        ),
        ("aliased_parameters", "ValueError: parameters 'head' and '0.weight' share memory"),
        (
            "step_with_sync_left_off",
            "RuntimeError: AdamW.step(): parameter '0.weight' has gradients that backwards with gradient sync off "
            "kept on this rank and never reduced",
        ),
        (
            "different_initial_weights",
            "ValueError: parameter '0.weight' (and 3 more) has different values on different ranks of the mesh: "
            "sharding would mix the rows of each rank's model. Build the model the same way on every rank",
        ),
        (
            "full_state_dict_loaded",
            "'0.weight', '0.bias' are plain tensors in the state dict, but the sharded model holds DTensors (each rank "
            "its shard). Load a full state dict with torch.distributed.checkpoint.state_dict.set_model_state_dict(model, "
            "state_dict, options=StateDictOptions(full_state_dict=True))",
        ),
    ],
)
def test_mistakes_that_trained_silently_wrong_are_refused_on_every_rank(case, words):
    for rank, result in enumerate(_silent_mistakes()):
        assert result[case] is not None and words in result[case], (rank, result[case])


def test_a_feature_dim_that_differs_between_ranks_is_named_on_every_rank():
    """Rank 1 calls the compiled model with 17 features, rank 0 with 16: rank 1's trace fails in Dynamo, and it
    publishes that failure with its inputs, so rank 0 stops at once naming the input that differs."""
    rank0, rank1 = (r["feature_dim_differs_between_ranks"] for r in _silent_mistakes())
    assert "rank 1 failed to compile its forward graph: RuntimeError: a and b must have same reduction dim" in rank0
    assert (
        "args[0] is float32 (4, 16) on this rank and float32 (4, 17) on rank 1: every rank must call the model with "
        "inputs of the same shapes and dtypes (or with dims marked dynamic that trace alike on every rank)"
    ) in rank0, rank0
    assert "a and b must have same reduction dim" in rank1
    assert "called with args[0] float32 (4, 17). The other ranks were told, with this rank's inputs" in rank1, rank1


def test_the_initial_weights_check_can_be_turned_off():
    assert [r["different_weights_check_off"] for r in _silent_mistakes()] == [None, None]


@pytest.mark.parametrize(
    "case",
    [
        "backward_twice_with_retain_graph",
        "regularised_over_parameters",
        "complex_parameter",
        "clip_grad_norm",
        "frozen_parameter",
        "two_forwards_checkpointed",
        "tied_in_separate_shard_calls",
    ],
)
def test_trains_as_fully_shard(case):
    """Two backwards of one loss (`retain_graph=True`: gradients add up), an L2 term over the parameters made a
    plain tensor with `full_tensor()`, a complex parameter in a group of its own, `clip_grad_norm_` over
    `model.parameters()`, a frozen weight in a trained group, two forwards of checkpointed blocks before one
    backward (up to rounding), tied weights sharded by separate `shard` calls: fully_shard's gradients (parameters
    after three AdamW steps), on 2 gloo ranks."""
    assert [r[case] for r in _silent_mistakes()] == [None, None]


@pytest.mark.parametrize(
    "budget, words",
    [
        (
            dict(memory_budget_bytes=16),
            "CompileConfig.memory_budget_bytes=16 bytes is smaller than the smallest bucket ('<root>': 172 bytes "
            "gathered), so nothing is prefetched or kept gathered, and every all-gather exceeds it. Raise "
            "memory_budget_bytes to at least 172, make buckets smaller",
        ),
        (
            dict(keep_gathered=16),
            "CompileConfig.keep_gathered=16 bytes is smaller than the smallest bucket ('blocks.0': 288 bytes "
            "gathered), so no bucket is kept gathered for backward. Raise keep_gathered to at least 288",
        ),
        (dict(memory_budget_bytes=172), None),
        (dict(keep_gathered=288), None),
    ],
)
def test_a_byte_budget_no_bucket_fits_in_warns(fake_pg, budget, words):
    model = Net()
    for block in model.blocks:
        fc.shard(block)
    fc.shard_compile(model, compile_config=fc.CompileConfig(**budget))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, 8)).sum().backward()
    told = [str(w.message) for w in caught if "CompileConfig" in str(w.message)]
    assert len(told) == (words is not None) and all(words in t for t in told), told
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------ unclear before


def test_a_list_of_modules_is_one_group(fake_pg):
    model = Net()
    for block in model.blocks:
        fc.shard(block)
    group = [model.norm, model.head]
    assert fc.shard(group) is group
    fc.shard(model)
    assert isinstance(model.norm, fc.FSDPModule) and isinstance(model.head, fc.FSDPModule)
    buckets = {name: info.bucket for name, _, info in managed_params(model)}
    assert buckets["norm.weight"] == buckets["head.weight"] == buckets["head.bias"] == "norm"
    assert buckets["blocks.1.0.weight"] == "blocks.1"
    assert not isinstance(model.blocks[0][0], fc.FSDPModule)  # a Linear inside a block is not a group itself
    with raises(ValueError, "empty list"):
        fc.shard([])
    with raises(TypeError, "module [1] is a str"):
        fc.shard([nn.Linear(2, 2), "head"])


def test_offload_policy(fake_pg):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    with raises(TypeError, "takes torch.distributed.fsdp.OffloadPolicy(), got str"):
        fc.shard(Net(), offload_policy="cpu")
    assert fc.is_sharded(fc.shard(Net(), offload_policy=OffloadPolicy()))
    assert fc.is_sharded(fc.shard(Net(), offload_policy=CPUOffloadPolicy()))


def test_a_process_group_is_not_a_mesh(fake_pg):
    with raises(TypeError, "mesh must be a DeviceMesh or None, got", "DeviceMesh.from_group(group, device_type)"):
        fc.shard(Net(), dist.group.WORLD)


def test_not_a_module(fake_pg):
    with raises(TypeError, "module is a str, not an nn.Module"):
        fc.shard("model")


def test_shard_twice(fake_pg):
    model = fc.shard(Net())
    with raises(ValueError, "already sharded", "call shard once per module", 'torch.compile(model, backend="fsdp2")'):
        fc.shard(model)
    with raises(ValueError, "already sharded", 'torch.compile(model, backend="fsdp2")'):
        fc.shard_compile(model)


@pytest.mark.parametrize(
    "placement, exc, text",
    [
        (lambda p: Shard(2), ValueError, "Shard(2) for parameter '0.weight' of shape (8, 8), which has no dim 2"),
        (lambda p: Replicate(), TypeError, "returned Replicate() for parameter '0.weight': return Shard(dim) or None"),
    ],
)
def test_shard_placement_fn_must_name_a_dim_of_the_parameter(fake_pg, placement, exc, text):
    block = Net().blocks[0]
    with raises(exc, text):
        fc.shard(block, shard_placement_fn=placement)
    assert not any(isinstance(p, DTensor) for p in block.parameters())  # refused before anything was sharded


def test_float8_all_gather_on_another_dim_is_refused(fake_pg):
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    block = convert_to_float8_training(
        Net().blocks[0], config=Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
    )
    with raises(ValueError, "'0.weight' is a torchao float8 weight", "Shard(1)", "enable_fsdp_float8_all_gather=False"):
        fc.shard(block, shard_placement_fn=lambda p: Shard(1))
    assert not any(isinstance(p, DTensor) for p in block.parameters())


class _OtherGatherExtension(torch.Tensor):
    def fsdp_pre_all_gather(self, mesh):
        raise AssertionError("never called")


def test_other_all_gather_extensions_are_refused(fake_pg):
    block = Net().blocks[0]
    block[0].weight = nn.Parameter(torch.randn(8, 8).as_subclass(_OtherGatherExtension))
    with raises(TypeError, "'0.weight' is a _OtherGatherExtension with FSDP2's all-gather extensions", "fully_shard"):
        fc.shard(block)


def test_three_d_mesh_must_be_sliced(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "replicate", "shard"))
    with raises(ValueError, "3-D mesh", "mesh['dp']"):
        fc.shard(Net(), mesh)


def test_mp_policy_must_be_a_policy(fake_pg):
    with raises(TypeError, "MixedPrecisionPolicy, got dict"):
        fc.shard(Net(), mp_policy={"param_dtype": torch.bfloat16})
    with raises(ValueError, "param_dtype='bf16' is not a floating-point dtype"):
        fc.MixedPrecisionPolicy(param_dtype="bf16")
    with raises(TypeError, "cast_forward_inputs='yes'"):
        fc.MixedPrecisionPolicy(cast_forward_inputs="yes")


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype"])
def test_a_float8_policy_points_to_torchao(field):
    with raises(ValueError, f"MixedPrecisionPolicy.{field}=torch.float8_e4m3fn", "convert_to_float8_training"):
        fc.MixedPrecisionPolicy(**{field: torch.float8_e4m3fn})


def test_fully_shard_and_shard_in_one_model(fake_pg):
    from torch.distributed.fsdp import fully_shard

    model = Net()
    fully_shard(model.blocks[0])
    with raises(
        ValueError,
        "module Net's submodule 'blocks.0' (FSDPSequential) was sharded by torch's fully_shard",
        "call fsdp2_compile.shard where you called fully_shard",
    ):
        fc.shard(model)
    assert not fc.is_sharded(model)


def test_a_sharded_model_is_not_pickled_or_deep_copied_whole(fake_pg):
    import copy
    import io

    model = fc.shard(Net())
    for attempt in (lambda: torch.save(model, io.BytesIO()), lambda: copy.deepcopy(model)):
        with raises(TypeError, "a sharded module (ShardedNet) cannot be pickled", "fc.save_checkpoint"):
            attempt()
    with fc.sharded_parameters():  # its state is saved as usual
        torch.save(model.state_dict(), io.BytesIO())


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(prefetch_depth=1.5), "prefetch_depth=1.5: use a whole number"),
        (dict(prefetch_depth=-1), "prefetch_depth=-1"),
        (dict(memory_budget_bytes=-100), "memory_budget_bytes=-100: use a positive whole number of bytes"),
        (dict(memory_budget_bytes=0), "memory_budget_bytes=0"),
        (
            dict(memory_budget_bytes=2e9),
            "use a positive whole number of bytes (an int: memory_budget_bytes=2000000000)",
        ),
        (dict(memory_budget_fraction=0.0), "memory_budget_fraction=0.0: use a fraction of the free memory in (0, 1]"),
        (dict(memory_budget_fraction=1.5), "memory_budget_fraction=1.5"),
        (dict(memory_budget_fraction="10%"), "memory_budget_fraction='10%'"),
        (
            dict(memory_budget_fraction=0.2, memory_budget_bytes=1 << 30),
            "set memory_budget_bytes or memory_budget_fraction, not both",
        ),
        (dict(buckets=True), "buckets=True"),
        (dict(buckets=0), "buckets=0"),
        (dict(compiler="xla"), "compiler='xla' is not one of"),
        (dict(prefetch="no"), "prefetch='no': use True or False"),
    ],
)
def test_compile_config_fields(kwargs, text):
    with pytest.raises((ValueError, TypeError)) as info:
        fc.CompileConfig(**kwargs)
    assert text in str(info.value)


def test_a_memory_budget_fraction_needs_shard_compile():
    # torch.compile(model, backend=...) has no mesh to measure and agree the free memory over
    from fsdp2_compile.api import fsdp2_backend

    with raises(ValueError, "memory_budget_fraction is measured and agreed over the ranks by fsdp2_compile.shard_comp"):
        fsdp2_backend(None, [], fc.CompileConfig(memory_budget_fraction=0.2))
    with raises(ValueError, "free memory on 'mps' devices is not known here; use CompileConfig.memory_budget_bytes"):
        free_bytes("mps")
    assert free_bytes("cpu") > 0


def test_compile_config_must_be_a_compile_config(fake_pg):
    model = Net()
    with raises(TypeError, "compile_config=...) must be a fsdp2_compile.CompileConfig, got dict"):
        fc.shard_compile(model, compile_config={"prefetch_depth": 1})
    assert not fc.is_sharded(model)  # refused before anything was sharded


def test_bucket_names_must_name_submodules(fake_pg):
    model = Net()
    with raises(ValueError, "['no_such_module']", "not a submodule of Net", "blocks.0"):
        fc.shard_compile(model, compile_config=fc.CompileConfig(buckets=("blocks.0", "no_such_module")))


def test_meta_parameters_without_to_empty(fake_pg):
    with torch.device("meta"):
        model = Net()
    fc.shard_compile(model)
    with raises(RuntimeError, "parameter 'blocks.0.0.weight' of ShardedNet is on the meta device", "to_empty"):
        model(torch.randn(2, 8))


def test_input_on_another_device(fake_pg):
    model = fc.shard_compile(Net())
    with raises(ValueError, "input args[0] (shape (2, 8), torch.float32) is on device 'meta'", "args[0].to('cpu')"):
        model(torch.empty(2, 8, device="meta"))


def test_parameter_replaced_after_shard(fake_pg):
    model = fc.shard(Net())
    model.head.weight = nn.Parameter(torch.zeros(3, 8))
    with raises(TypeError, "parameter 'head.weight' was replaced by a Parameter after shard()"):
        model(torch.randn(2, 8))


@pytest.mark.parametrize(
    "write, text",
    [
        (lambda m: setattr(m.head.weight, "data", torch.zeros(3, 8)), "setting .data"),
        (lambda m: m.head.weight.data.normal_(), ".normal_()"),
        (lambda m: nn.init.zeros_(m.head.weight), ".zero_()"),
        (lambda m: m.head.weight.copy_(torch.ones(3, 8)), ".copy_()"),
        (lambda m: m.head.weight.__setitem__(0, 1.0), "item assignment"),
        (lambda m: setattr(m.head.weight, "requires_grad", False), "setting .requires_grad"),
    ],
)
def test_writing_a_gathered_parameter_is_refused(fake_pg, write, text):
    """`module.weight` of a sharded module is a gathered copy: a write would be lost silently."""
    model = fc.shard(Net())
    with raises(
        RuntimeError,
        "parameter 'head.weight' of a sharded module is read as a gathered copy",
        text,
        "fsdp2_compile.sharded_parameters()",
    ):
        write(model)
    with fc.sharded_parameters():  # what works: the shards, in place
        nn.init.zeros_(model.head.weight)
        assert float(model.head.weight.to_local().abs().sum()) == 0.0


def test_reading_the_gradient_of_a_gathered_parameter_names_where_it_is(fake_pg):
    """`module.weight.grad` is the gradient with `fully_shard`; here `module.weight` is a gathered copy, whose
    `.grad` would be None (and torch's warning about non-leaf tensors)."""
    model = fc.shard(Net())
    model(torch.randn(2, 8)).sum().backward()
    with raises(
        RuntimeError,
        "parameter 'head.weight' of a sharded module is read as a gathered copy, which never gets a gradient",
        "dict(model.named_parameters())['head.weight'].grad",
        "fsdp2_compile.sharded_parameters()",
    ):
        _ = model.head.weight.grad
    assert isinstance(dict(model.named_parameters())["head.weight"].grad, DTensor)
    with fc.sharded_parameters():
        assert isinstance(model.head.weight.grad, DTensor)


def test_zero_dim_parameter(fake_pg):
    model = Net()
    model.scale = nn.Parameter(torch.tensor(1.0))
    with raises(ValueError, "parameter 'scale' is 0-dimensional", "ignored_params"):
        fc.shard(model)


def test_checkpoint_of_an_empty_folder(tmp_path):
    with raises(FileNotFoundError, str(tmp_path)):
        load_checkpoint(str(tmp_path), Net())


def test_checkpoint_to_an_unwritable_path(tmp_path):
    if os.geteuid() == 0:
        blocked = tmp_path / "file"
        blocked.write_text("a file where the folder should be")
        path = str(blocked / "ckpt")
    else:
        path = str(tmp_path / "ro" / "ckpt")
        os.makedirs(os.path.dirname(path))
        os.chmod(os.path.dirname(path), 0o500)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(path, Net())
    assert "ckpt" in str(info.value) and isinstance(info.value, Exception)


@pytest.mark.parametrize(
    "call, text",
    [
        (lambda d, m, o: save_checkpoint(m, d), "save_checkpoint: path must be a folder path (str), got Net"),
        (lambda d, m, o: load_checkpoint(d, o, m), "load_checkpoint: model must be an nn.Module, got AdamW"),
        (lambda d, m, o: load_checkpoint(d, m.state_dict()), "not its state_dict()"),
        (
            lambda d, m, o: save_checkpoint(d, m, m),
            "save_checkpoint: optimizer must be a torch.optim.Optimizer or None",
        ),
    ],
)
def test_checkpoint_arguments_of_the_wrong_type(tmp_path, call, text):
    model = Net()
    with raises(TypeError, text, "(path, model, optimizer=None)"):
        call(str(tmp_path), model, torch.optim.AdamW(model.parameters()))


def test_an_async_checkpointer_type_of_the_wrong_type_or_without_async_save_or_process_group(tmp_path):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    with raises(
        TypeError, "async_checkpointer_type must be a", "AsyncCheckpointerType (THREAD or PROCESS), got 'process'"
    ):
        save_checkpoint(str(tmp_path), Net(), async_save=True, async_checkpointer_type="process")
    with raises(ValueError, "async_checkpointer_type=PROCESS applies to async saves: pass async_save=True"):
        save_checkpoint(str(tmp_path), Net(), async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    with raises(ValueError, "PROCESS needs the default process group", "call init_process_group first"):
        save_checkpoint(str(tmp_path), Net(), async_save=True, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    assert not os.listdir(tmp_path)  # refused before anything was written


def test_checkpoint_of_another_model_or_optimizer(tmp_path):
    model = Net()
    adamw = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    adamw.step()
    save_checkpoint(str(tmp_path / "adamw"), model, adamw)
    save_checkpoint(str(tmp_path / "plain"), model)
    other = Net()
    other.blocks.append(nn.Linear(8, 8))
    del other.norm
    with raises(
        ValueError,
        "no entry for model parameter/buffer 'blocks.2.weight', 'blocks.2.bias'; it has 'norm.weight', 'norm.bias', "
        "which the model does not",
        "Load it into the model it was saved from",
    ):
        load_checkpoint(str(tmp_path / "adamw"), other)
    sgd = torch.optim.SGD(model.parameters(), momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    sgd.step()
    with raises(
        ValueError, "no optimizer entries 'state.blocks.0.0.weight.momentum_buffer',", "and 8 more that SGD has"
    ):
        load_checkpoint(str(tmp_path / "adamw"), model, sgd)
    with raises(ValueError, "holds no optimizer state", "load it with optimizer=None"):
        load_checkpoint(str(tmp_path / "plain"), model, adamw)
    load_checkpoint(str(tmp_path / "adamw"), model, torch.optim.AdamW(model.parameters()))  # the right one loads


def test_optimizer_in_backward_with_sync_off_through_the_backend_route(fake_pg):
    """`torch.compile(model, backend="fsdp2")` does not see post-accumulate-grad hooks: autograd runs them after the
    backward, which is FSDP2's result while gradients are reduced, but with sync off it would run them with a zero
    gradient (FSDP2 runs none): refused, naming the parameter and `shard_compile`."""
    model = Net()
    for block in model.blocks:
        fc.shard(block)
    fc.shard(model)
    compiled = torch.compile(model, backend="fsdp2")
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: None)
    compiled(torch.randn(2, 8))  # synced: the hooks run after the backward, with the reduced gradient
    model.set_requires_gradient_sync(False)
    with raises(
        Exception,
        "parameter 'blocks.0.0.weight' has post-accumulate-grad hooks",
        "a zero gradient",
        "fsdp2_compile.shard_compile(model)",
    ):
        compiled(torch.randn(2, 8))
    torch._dynamo.reset()


def _compiled_net() -> nn.Module:
    return fc.shard_compile(Net(), compile_config=fc.CompileConfig(check_rank_consistency=False))


@pytest.mark.parametrize(
    "x, torch_words, note",
    [
        (
            torch.randn(2, 8, dtype=torch.float64),
            "mat1 and mat2 must have the same dtype",
            "raised in the compiled step of ShardedNet, called with args[0] float64 (2, 8). args[0] is not float32, "
            "the dtype the parameters compute in: cast the input",
        ),
        (torch.randn(2, 7), "a and b must have same reduction dim", "called with args[0] float32 (2, 7)."),
    ],
)
def test_an_error_inside_the_compiled_step_keeps_torchs_message_and_names_the_call(fake_pg, x, torch_words, note):
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        _compiled_net()(x)
    assert torch_words in str(info.value)
    (added,) = info.value.__notes__
    assert note in added and 'torch.compiler.set_stance("force_eager")' in added, added


class PenalisedNet(Net):
    """A loss with an L2 penalty over `self.parameters()` (DTensor shards) added in forward."""

    def forward(self, x):
        return super().forward(x).pow(2).sum() + 1e-4 * sum(p.pow(2).sum() for p in self.parameters())


@pytest.mark.filterwarnings("ignore:Error detected in PowBackward0")
def test_an_l2_penalty_over_the_parameters_in_a_compiled_step_says_to_make_it_a_plain_tensor(fake_pg):
    """Torch's message with a note, when the penalty is in the compiled forward; added to the loss outside, it is
    raised by `loss.backward()` with torch's message only."""
    torch._dynamo.reset()
    model = fc.shard_compile(PenalisedNet(), compile_config=fc.CompileConfig(check_rank_consistency=False))
    with pytest.raises(Exception, match="got mixed torch.Tensor and DTensor") as info:
        model(torch.randn(2, 8))
    (added,) = info.value.__notes__
    assert (
        "The parameters of ShardedPenalisedNet are DTensor shards outside the gathered reads of its submodules' "
        "forward (module.weight): a value computed from model.parameters() (an L2 penalty summed over them) is a "
        "DTensor; make it a plain tensor before mixing it with others, e.g. "
        "sum(p.pow(2).sum() for p in self.parameters()).full_tensor()"
    ) in added, added


def test_backward_of_an_output_computed_under_no_grad_is_torchs_message(fake_pg):
    """As with `fully_shard`: torch's message, raised by `loss.backward()` (evaluation under no_grad is valid)."""
    torch._dynamo.reset()
    model = _compiled_net()
    with torch.no_grad():
        loss = model(torch.randn(2, 8)).sum()
    with raises(RuntimeError, "element 0 of tensors does not require grad and does not have a grad_fn"):
        loss.backward()


def test_our_own_errors_get_no_note(fake_pg):
    torch._dynamo.reset()
    model = _compiled_net()
    model.head.weight = nn.Parameter(torch.zeros(3, 8))
    with raises(TypeError, "parameter 'head.weight' was replaced by a Parameter after shard()") as info:
        model(torch.randn(2, 8))
    assert not getattr(info.value, "__notes__", None)


def test_a_parameter_added_after_shard_compile(fake_pg):
    torch._dynamo.reset()
    model = _compiled_net()
    model.norm.scale = nn.Parameter(torch.ones(8))
    with raises(
        ValueError, "parameter 'norm.scale' of ShardedNet was added after fsdp2_compile.shard", "Add it before"
    ):
        model(torch.randn(2, 8))


def test_a_sparse_embedding(fake_pg):
    model = nn.Sequential(nn.Embedding(10, 8, sparse=True), nn.Linear(8, 2))
    with raises(ValueError, "module '0' (Embedding) has sparse=True", "Build it with sparse=False"):
        fc.shard(model)
    ignored = nn.Sequential(nn.Embedding(10, 8, sparse=True), nn.Linear(8, 2))
    fc.shard(ignored, ignored_params={ignored[0].weight})  # kept whole: its sparse gradient stays on each rank


@pytest.mark.parametrize("method", ["no_sync", "clip_grad_norm_", "summon_full_params"])
def test_fsdp1_methods_are_not_there_as_with_fully_shard(fake_pg, method):
    """FSDP1's `no_sync()`, `clip_grad_norm_()`, `summon_full_params()` are not FSDP2 methods: the AttributeError
    names the user's class, as `fully_shard`'s does (docs/mistakes.md gives the FSDP2 way)."""
    model = fc.shard(Net())
    with raises(AttributeError, f"'ShardedNet' object has no attribute '{method}'"):
        getattr(model, method)
    assert not hasattr(model, method)  # code that tests for FSDP1 with hasattr takes its other branch


@pytest.mark.parametrize("method", ["unshard", "set_requires_gradient_sync"])
def test_an_fsdp_method_on_a_submodule_not_passed_to_shard_is_torchs_error_as_with_fully_shard(fake_pg, method):
    """Only modules passed to `shard` become `FSDPModule`s (as with `fully_shard`); on the others, torch's
    `nn.Module.__getattr__` raises, and `hasattr` stays False for code that tests for FSDP methods."""
    model = fc.shard(Net())
    with raises(AttributeError, f"'Linear' object has no attribute '{method}'"):
        getattr(model.head, method)
    assert not isinstance(model.head, fc.FSDPModule) and not hasattr(model.head, method)


def test_a_meta_model_moved_with_to_instead_of_to_empty(fake_pg):
    with torch.device("meta"):
        model = Net()
    fc.shard_compile(model)
    with raises(NotImplementedError, "Cannot copy out of meta tensor", "use torch.nn.Module.to_empty()"):
        model.to("cpu")


def test_a_parameter_with_fewer_rows_than_ranks_initialised_on_meta(fake_pg):
    """Rank 3 of 4 holds no rows of a (2, 8) weight: `to_empty` and `reset_parameters` on the shards work."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 2), nn.Linear(2, 3))
    fc.shard(model)
    model.to_empty(device="cpu")
    with fc.sharded_parameters():
        assert model[0].weight.to_local().shape == (0, 8)
        for layer in model:
            layer.reset_parameters()
    model(torch.randn(2, 8)).sum().backward()
    assert dict(model.named_parameters())["0.weight"].grad.to_local().shape == (0, 8)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)

    def generate(self, x):
        return self.proj(self.proj(x))


def test_torchs_register_fsdp_forward_method_on_a_sharded_module(fake_pg):
    from torch.distributed.fsdp import register_fsdp_forward_method

    model = fc.shard(Generator(), mp_policy=fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    register_fsdp_forward_method(model, "generate")
    with raises(
        RuntimeError,
        "ShardedGenerator was sharded by fsdp2_compile.shard",
        "fsdp2_compile.register_fsdp_forward_method(module, method_name)",
    ):
        model.generate(torch.randn(2, 8))
    model = fc.shard(Generator(), mp_policy=fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fc.register_fsdp_forward_method(model, "generate")
    assert model.generate(torch.randn(2, 8)).dtype == torch.bfloat16  # inputs cast, as forward's


@pytest.mark.parametrize("compiled", [False, True])
def test_dataclass_and_namedtuple_inputs_are_cast_as_fully_shard_casts_them(fake_pg, compiled):
    import collections
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        ids: torch.Tensor

    Pair = collections.namedtuple("Pair", "x scale")

    class Takes(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 2)

        def forward(self, batch, pair):
            assert batch.ids.dtype == torch.int64  # only floating tensors are cast
            return self.proj(batch.x + pair.x) * pair.scale

    torch._dynamo.reset()
    model = Takes()
    (fc.shard_compile if compiled else fc.shard)(model, mp_policy=fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    out = model(Batch(torch.randn(2, 8), torch.arange(2)), Pair(torch.randn(2, 8), torch.ones(1)))
    assert out.dtype == torch.bfloat16
    torch._dynamo.reset()


def test_a_float32_buffer_under_a_bf16_param_dtype_is_named(fake_pg):
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.register_buffer("mix", torch.eye(8))

        def forward(self, x):
            return self.proj(x) @ self.mix

    torch._dynamo.reset()
    bf16 = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = fc.shard_compile(Scaled(), mp_policy=bf16, compile_config=fc.CompileConfig(check_rank_consistency=False))
    with pytest.raises(Exception) as info:
        model(torch.randn(2, 8))
    (added,) = info.value.__notes__
    assert "args[0] is not" not in added and "Buffer 'mix' is not bfloat16" in added
    assert "MixedPrecisionPolicy(buffer_dtype=torch.bfloat16)" in added
    torch._dynamo.reset()
    fixed = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = fc.shard_compile(Scaled(), mp_policy=fixed, compile_config=fc.CompileConfig(check_rank_consistency=False))
    assert model(torch.randn(2, 8)).dtype == torch.bfloat16
    torch._dynamo.reset()


def test_a_state_dict_of_other_sizes_keeps_torchs_message_and_says_what_it_means(fake_pg):
    model = fc.shard(Net())
    other = Net()
    other.norm = nn.LayerNorm(4)
    with raises(RuntimeError, "size mismatch for norm.weight") as info:
        model.load_state_dict(other.state_dict())
    assert "a size mismatch means the checkpoint is of a model with other sizes" in "".join(info.value.__notes__)
