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
    """Twenty models sharded, compiled, trained and deleted in one process: the compiled graphs (Dynamo's cache of
    the module's own code object, the graph records) go with each; no `fx.GraphModule` outlives its model."""
    code = textwrap.dedent(
        """
        import gc, torch
        from torch import fx, nn
        from torch.distributed.device_mesh import init_device_mesh
        import fsdp2_compile as fc
        from fsdp2_compile._torch_private import fake_process_group
        from fsdp2_compile.compiler.graph_records import compiled_graphs

        fake_process_group(rank=0, world_size=2)
        mesh = init_device_mesh("cpu", (2,))

        def graph_modules():
            gc.collect()
            gc.collect()  # the first runs the dead module's finalizer, the second frees what it released
            return sum(isinstance(o, fx.GraphModule) for o in gc.get_objects())

        def train_and_drop():
            model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
            fc.shard(model[0], mesh)
            fc.shard_compile(model, mesh, compile_config=fc.CompileConfig(check_rank_consistency=False))
            opt = torch.optim.AdamW(model.parameters())
            for _ in range(2):
                model(torch.randn(4, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
            assert compiled_graphs()  # recorded while the model lives

        start = graph_modules()
        for _ in range(20):
            train_and_drop()
        print("graph modules", start, graph_modules(), "records", len(compiled_graphs()))
        """
    )
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-4:] == ["0", "0", "records", "0"], done.stdout


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
