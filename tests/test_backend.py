"""The "fsdp2" torch.compile backend reached by name (entry point) and what it does to every compile, in fresh
interpreters."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_backend_by_name_without_importing_the_package():
    # a 1-rank gloo group is a real process group; the module is sharded, then compiled by backend name only
    proc = python(
        """
        import os, torch, torch.distributed as dist
        from torch import nn
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))
        ref = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1)); ref.load_state_dict(model.state_dict())
        import fsdp2_compile
        fsdp2_compile.shard(model)
        # nothing registers "fsdp2" with Dynamo but the package's torch_dynamo_backends entry point
        compiled = torch.compile(model, backend="fsdp2")
        x = torch.randn(3, 4)
        torch.testing.assert_close(compiled(x), ref(x))
        compiled(x).sum().backward(); ref(x).sum().backward()
        grad = dict(model.named_parameters())["0.weight"].grad
        torch.testing.assert_close(grad.full_tensor(), ref[0].weight.grad)
        from fsdp2_compile.compiler.graph_records import compiled_graphs
        print("graphs", sorted(r.kind for r in compiled_graphs()))
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "graphs ['backward', 'forward']" in proc.stdout


def test_backend_on_an_unsharded_module_says_to_call_shard():
    proc = python(
        """
        import torch
        from torch import nn
        torch.compile(nn.Linear(4, 4), backend="fsdp2")(torch.randn(2, 4))
        """
    )
    assert proc.returncode != 0
    assert "not sharded; call fsdp2_compile.shard(model, mesh)" in proc.stderr


def test_every_compiled_module_gets_its_own_dynamo_cache():
    # Dynamo keeps at most 8 graphs per code object; ten modules compiled in one process must all compile
    proc = python(
        """
        import torch
        from torch import nn
        import fsdp2_compile as fc
        from fsdp2_compile._torch_private import fake_process_group
        from fsdp2_compile.compiler.graph_records import compile_counts
        fake_process_group(rank=0, world_size=2)
        for i in range(10):
            model = fc.shard_compile(nn.Linear(4, 4), compile_config=fc.CompileConfig(check_rank_consistency=False))
            model(torch.randn(2, 4)).sum().backward()
            print(i, compile_counts().forward)
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "10", proc.stdout  # one forward graph per module, the tenth included


def test_inductor_keeps_the_collectives_where_the_scheduler_put_them(fake_pg):
    """The code Inductor generates issues every collective and wait in the scheduler's order, with the same number
    of matmuls and block subgraph calls before each. Without the backend's ordering edges, fusion of a gradient's
    copy-in with a later kernel moved a reduce-scatter behind the wait of the next all-gather."""
    import re

    import cli_factories
    from torch._inductor.utils import run_and_get_code

    import fsdp2_compile as fc
    from fsdp2_compile.compiler.graph_records import clear_compiled_graphs, compiled_graphs

    clear_compiled_graphs()
    model, (idx,) = cli_factories.tiny()
    for block in model.blocks:
        fc.shard(block)
    fc.shard_compile(model, compile_config=fc.CompileConfig(compiler="inductor", hardware="cpu-gloo-loopback"))
    _, codes = run_and_get_code(lambda: model(idx).sum().backward())
    comm = re.compile(r"_c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor|wait_tensor)\.default\(")
    matmul = re.compile(r"extern_kernels\.(?:mm|addmm|bmm)\(|= partitioned_[fb]w_subgraph_\w+\(")

    def inductor_sequence(code: str) -> list[tuple[str, int]]:
        seq, mms = [], 0
        for line in code[code.index("    def call(self, args):") :].splitlines():  # the subgraphs are defined above
            if matmul.search(line):
                mms += 1
            elif (m := comm.search(line)) and not line.lstrip().startswith("assert"):
                seq.append((m.group(1), mms))
        return seq

    def scheduled_sequence(gm) -> list[tuple[str, int]]:
        seq, mms = [], 0
        for n in gm.graph.nodes:
            name = getattr(n.target, "_opname", getattr(n.target, "__name__", ""))
            if name in ("mm", "addmm", "bmm", "invoke_subgraph"):
                mms += 1
            elif name in ("all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor"):
                seq.append((name, mms))
        return seq

    records = compiled_graphs()
    assert [r.kind for r in records] == ["forward", "backward"] and len(codes) == 2
    for record, code in zip(records, codes):
        expected = scheduled_sequence(record.gm)
        assert sum(k == "reduce_scatter_tensor" for k, _ in expected) == (3 if record.kind == "backward" else 0)
        assert inductor_sequence(code) == expected, record.kind
    clear_compiled_graphs()


def test_a_sharded_model_trains_under_another_backend_with_a_warning():
    """`torch.compile(model)` with a backend not ours (aot_eager here; inductor and eager alike), as a
    `fully_shard` user would write it: the blocks are traced inline (torch 2.13 cannot run a nested compile region
    whose inputs are DTensors), every unshard runs as its op; the losses and parameters match one process's, and
    a warning names the backend and the way to the compiler's passes."""
    import torch
    from harness import run_ranks
    from models import reference_train
    from workers import other_backend

    ref_losses, ref_params = reference_train("gpt", 3)
    for r in run_ranks(other_backend, 2, "aot_eager"):
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
        for k, p in ref_params.items():
            torch.testing.assert_close(r["params"][k], p, rtol=1e-4, atol=3e-4)
        assert len(r["warnings"]) == 1 and "backend 'aot_eager'" in r["warnings"][0], r["warnings"]
        assert 'backend="fsdp2"' in r["warnings"][0] and "shard_compile" in r["warnings"][0]


def test_full_collections_wait_only_while_the_fsdp2_backend_compiles():
    # Python's full (generation-2) collections wait while our backend compiles a graph (forward, and the backward
    # compiled at its first run), also after torch._dynamo.reset(); the threshold is restored afterwards, raising or
    # not; another backend's compile, and ours with CompileConfig(defer_full_gc=False), run with it as torch's own
    # compile leaves it (torch 2.15's Dynamo sets its own threshold while it compiles: the baseline)
    proc = python(
        """
        import gc, torch
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        import fsdp2_compile as fc
        import fsdp2_compile.compiler.backend as backend
        from fsdp2_compile._torch_private import fake_process_group

        gc.set_threshold(700, 10, 25)
        seen = []
        run_pipeline = backend.run_pipeline

        def recording(gm, ctx, **kwargs):  # our passes, run inside the backend's compile of each graph
            seen.append(gc.get_threshold()[2])
            return run_pipeline(gm, ctx, **kwargs)

        backend.run_pipeline = recording

        def other(gm, example_inputs):
            seen.append(gc.get_threshold()[2])
            return gm

        def show(what):
            print(what, seen, gc.get_threshold())
            seen.clear()

        fake_process_group(rank=0, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        x = torch.randn(2, 8)

        def step(**config):
            model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
            fc.shard_compile(model, mesh, compile_config=fc.CompileConfig(**config))
            model(x).sum().backward()

        torch.compile(lambda t: t * 2, backend=other)(x)
        show("baseline")
        step()
        show("fsdp2")
        torch.compile(lambda t: t * 3, backend=other)(x)
        show("other")
        torch._dynamo.reset()
        step()
        show("reset")
        step(defer_full_gc=False)
        show("off")
        try:
            torch.compile(nn.Linear(8, 4), backend="fsdp2")(x)
        except Exception as e:
            print("raised", type(e).__name__, gc.get_threshold())
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    never = 2**31 - 1
    lines = proc.stdout.splitlines()
    baseline = lines[0].split("[")[1].split("]")[0]  # what another backend sees: 25, or torch's own setting
    assert lines[0] == f"baseline [{baseline}] (700, 10, 25)"
    assert lines[1:] == [
        f"fsdp2 [{never}, {never}] (700, 10, 25)",
        f"other [{baseline}] (700, 10, 25)",
        f"reset [{never}, {never}] (700, 10, 25)",
        f"off [{baseline}, {baseline}] (700, 10, 25)",
        "raised BackendCompilerFailed (700, 10, 25)",
    ]


def test_the_compile_profile_benchmark_reports_the_compile_phases():
    # benchmarks/compile_profile.py (where compile time goes) runs a 1-layer GPT in a fresh interpreter
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "benchmarks", "compile_profile.py"),
            "--layers",
            "1",
            "--gc-deferral",
            "both",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [
        [c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines() if line.startswith("| 1 |")
    ]
    assert [cells[1] for cells in rows] == ["on", "off"]
    for cells in rows:
        assert float(cells[2].removesuffix(" s")) > 0 and float(cells[5]) > 0  # first step, Dynamo's tracing
