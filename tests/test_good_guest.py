"""Sharding leaves the user's process as `fully_shard` does (2 gloo ranks)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import torch
from guest_workers import random_draws_after_sharding
from harness import run_ranks


def test_sharding_draws_nothing_from_the_users_random_generator():
    for rank, result in enumerate(run_ranks(random_draws_after_sharding, 2)):
        assert torch.equal(result["ours"], result["fsdp2"]), rank
        assert torch.equal(result["ours_dropout"], result["fsdp2_dropout"]), rank


def test_what_a_compiled_model_leaves_dies_with_it():
    """Twenty models, each of its own class, sharded, compiled, trained and deleted in one process: the compiled
    graphs (Dynamo's cache of the module's own code object, the graph records), the tensors and the user's class go
    with each; no `fx.GraphModule`, `torch.Tensor` or model class outlives its model. Counted from after a first
    model, as torch keeps the last compilation's fake RNG state (`PhiloxStateTracker`, class-level: a constant
    dozen tensors, and the last model's fake parameters). Not counted: the tensors of device meshes, 4 more per
    model here: the meshes of the parameters' DTensorSpecs that Dynamo's DTENSOR_SPEC_MATCH guards deep-copy
    (torch/_dynamo/guards.py, `extract_dtensor_spec`), whose guard functions torch 2.14 keeps alive from C++ after
    the code's cache entries are dropped, even after `torch._dynamo.reset()`: their count is printed, not
    asserted."""
    code = textwrap.dedent(
        """
        import gc, torch
        from torch import fx, nn
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        import fsdp2_compile as fc
        from fsdp2_compile._torch_private import fake_process_group
        from fsdp2_compile.compiler.graph_records import compiled_graphs

        fake_process_group(rank=0, world_size=2)
        mesh = init_device_mesh("cpu", (2,))

        def live():
            for _ in range(3):  # the dead module's finalizer, then what it released, then what that held
                gc.collect()
            objects = gc.get_objects()
            meshes = [o for o in objects if isinstance(o, DeviceMesh)]
            mesh_tensors = {id(t) for m in meshes for t in vars(m).values() if isinstance(t, torch.Tensor)}
            return (
                sum(isinstance(o, fx.GraphModule) for o in objects),
                sum(isinstance(o, torch.Tensor) and id(o) not in mesh_tensors for o in objects),
                sum(isinstance(o, type) and o.__name__ == "Block" for o in objects),
                len(meshes),
            )

        def train_and_drop():
            class Block(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.lin = nn.Linear(16, 16)

                def forward(self, x):
                    return torch.relu(self.lin(x))

            model = nn.Sequential(Block(), nn.Linear(16, 1))
            fc.shard(model[0], mesh)
            fc.shard_compile(model, mesh, compile_config=fc.CompileConfig(check_rank_consistency=False))
            opt = torch.optim.AdamW(model.parameters())
            for _ in range(2):
                model(torch.randn(4, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
            assert compiled_graphs()  # recorded while the model lives

        train_and_drop()
        start = live()
        for _ in range(20):
            train_and_drop()
        end = live()
        print("meshes", start[3], end[3])
        print("graphs", start[0], end[0], "tensors", start[1], end[1], "classes", start[2], end[2])
        print("records", len(compiled_graphs()))
        """
    )
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    _, graphs_start, graphs_end, _, tensors_start, tensors_end, _, classes_start, classes_end = lines[-2].split()
    assert graphs_start == graphs_end == "0", done.stdout
    assert tensors_end == tensors_start, done.stdout
    assert classes_end == classes_start, done.stdout  # the user's class is not kept by `shard`
    assert lines[-1] == "records 0", done.stdout


def test_deferred_full_collections_leave_the_threshold_as_it_was_when_threads_overlap():
    import gc
    import threading

    from fsdp2_compile.compiler.compile_gc import full_collections_deferred

    before = gc.get_threshold()
    a_inside, a_may_leave = threading.Event(), threading.Event()
    seen_by_b_after_a_left = []

    def a():
        with full_collections_deferred():
            a_inside.set()
            a_may_leave.wait(10)

    def b():
        a_inside.wait(10)
        with full_collections_deferred():
            a_may_leave.set()
            time.sleep(0.2)  # a leaves while b is still inside
            seen_by_b_after_a_left.append(gc.get_threshold()[2])

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(seen_by_b_after_a_left) == 1 and seen_by_b_after_a_left[0] > before[2]  # still deferred for b
    assert gc.get_threshold() == before


def test_a_parameter_whose_hooks_were_removed_leaves_no_gradient_receiver():
    import torch.distributed as dist
    from torch import nn

    import fsdp2_compile as fc
    from fsdp2_compile._torch_private import clear_dtensor_caches, fake_process_group
    from fsdp2_compile.core.ops import GRAD_RECEIVERS

    fake_process_group(rank=0, world_size=2)
    try:
        before = set(GRAD_RECEIVERS)
        model = fc.shard_compile(nn.Linear(8, 8), compile_config=fc.CompileConfig(check_rank_consistency=False))
        weight = dict(model.named_parameters())["weight"]  # the sharded parameter (model.weight gathers it)
        handle = weight.register_post_accumulate_grad_hook(lambda p: None)  # an optimizer in backward
        model(torch.randn(2, 8)).sum().backward()
        assert len(set(GRAD_RECEIVERS) - before) == 2  # the weight's receiver, and its after-backward variant
        handle.remove()
        model(torch.randn(2, 8)).sum().backward()
        assert set(GRAD_RECEIVERS) == before
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()
