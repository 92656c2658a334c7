"""examples/train_gpt.py on 2 gloo ranks, stopped and relaunched: a SIGTERM to one rank stops both after the same
step with a save and exit 0, and a SIGKILL between two saves loses only the steps since the last commit; the
relaunched runs' losses and final checkpoint are bitwise those of a run never stopped, whether relaunched anew or
restarted in place by torchrun's agent; relaunched at 4 ranks, the losses are within 1e-6 of the 2-rank run's."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import torch
from harness import free_port
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")
STEPS, EVERY = 12, 3


class Run:
    """The example on `world` ranks, launched as torchrun would (env:// rendezvous), each rank's output in a file."""

    def __init__(self, folder, ckpt: str, world: int = 2, steps: int = STEPS, extra: tuple = ()) -> None:
        port, self.logs = free_port(), [f"{folder}rank{r}.log" for r in range(world)]
        args = ["--eager", "--steps", str(steps), "--checkpoint-dir", ckpt, "--checkpoint-every", str(EVERY), *extra]
        self.procs = []
        for rank, log in enumerate(self.logs):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
            env.update(LOCAL_WORLD_SIZE=str(world))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen([sys.executable, EXAMPLE, *args], stdout=out, stderr=out, env=env))

    def output(self) -> str:
        return open(self.logs[0]).read()

    def wait_for(self, text: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            assert all(p.poll() is None for p in self.procs), f"a rank ended before {text!r}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{self.output()}"
            time.sleep(0.05)

    def finish(self, timeout: float = 300) -> list[int]:
        try:
            return [p.wait(timeout=timeout) for p in self.procs]
        finally:
            for p in self.procs:
                p.kill()


def children(pid: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of the processes whose parent is `pid` (torchrun's workers)."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
                found[int(env[b"LOCAL_RANK"])] = int(entry)
        except (OSError, ValueError, IndexError, KeyError):
            continue
    return found


class Elastic:
    """The example under torchrun restarting it in place once (`--max-restarts 1`), with a fresh store per attempt."""

    def __init__(self, log: str, ckpt: str) -> None:
        self.log = log
        args = ["--eager", "--steps", str(STEPS), "--checkpoint-dir", ckpt, "--checkpoint-every", str(EVERY)]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
                + ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", EXAMPLE, *args],
                stdout=out,
                stderr=out,
                env=dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
            )

    def output(self) -> str:
        return open(self.log).read()


def losses(output: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"step +(\d+)  loss (\S+)", output)}


def committed(ckpt: str, out: str) -> dict:
    """The committed checkpoint at `ckpt`, unsharded (model, AdamW state, scheduler, step)."""
    with open(os.path.join(ckpt, "committed.json")) as f:
        dcp_to_torch_save(os.path.join(ckpt, json.load(f)["folder"]), out)
    return torch.load(out, weights_only=False)


def assert_same(a: object, b: object, key: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), key
        for k in a:
            assert_same(a[k], b[k], f"{key}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{key} differs"
    else:
        assert a == b, f"{key}: {a} != {b}"


def test_sigterm_to_one_rank_then_sigkill_of_one_rank_under_torchrun_resume_bitwise_and_at_4_ranks_within_1e6(
    tmp_path,
):
    ckpt = str(tmp_path / "ckpt")
    reference, first = Run(tmp_path / "ref-", str(tmp_path / "ref")), Run(tmp_path / "1-", ckpt)
    # SIGTERM to rank 1 only: rank 0 learns of it through the per-step all-reduce of the stop flag
    first.wait_for("step   1  loss")
    first.procs[1].send_signal(signal.SIGTERM)
    assert first.finish() == [0, 0], first.output()
    saved = int(re.search(r"SIGTERM: saved at step (\d+)", first.output())[1])
    assert 2 <= saved < STEPS - 5 and max(losses(first.output())) == saved - 1, first.output()
    shutil.copytree(ckpt, tmp_path / "ckpt4")

    # relaunched under torchrun; once a save every 3 steps has come after the resumed step, SIGKILL to rank 1: the
    # agent restarts both ranks, which resume from the last commit. Meanwhile 4 ranks resume the SIGTERM's commit.
    elastic = Elastic(str(tmp_path / "elastic.log"), ckpt)
    wider = Run(tmp_path / "4-", str(tmp_path / "ckpt4"), world=4, steps=saved + 3)
    try:
        deadline = time.monotonic() + 300
        while f"step {saved + 4:3d}  loss" not in elastic.output():
            assert elastic.proc.poll() is None and time.monotonic() < deadline, elastic.output()
            time.sleep(0.05)
        os.kill(children(elastic.proc.pid)[1], signal.SIGKILL)
        assert elastic.proc.wait(timeout=300) == 0, elastic.output()
    finally:
        elastic.proc.kill()
    assert wider.finish() == [0] * 4, wider.output()
    assert reference.finish() == [0, 0], reference.output()
    expected = losses(reference.output())
    assert sorted(expected) == list(range(STEPS))

    before, after = elastic.output().split("resumed from")[1:]
    assert before.startswith(f" {ckpt} at step {saved}\n"), elastic.output()
    resumed = int(re.match(r" \S+ at step (\d+)\n", after)[1])
    # the last commit: a save of the every-3-steps schedule, none after the last step rank 0 printed
    assert resumed % EVERY == 0 and saved < resumed <= max(losses(before)) + 1, elastic.output()
    for text, start in ((before, saved), (after, resumed)):
        done = losses(text)
        assert min(done) == start and done == {step: expected[step] for step in done}, (done, expected)
    assert max(losses(after)) == STEPS - 1
    ours = committed(ckpt, str(tmp_path / "ours.pt"))
    assert ours["extra"]["train"]["step"] == STEPS
    assert_same(ours, committed(str(tmp_path / "ref"), str(tmp_path / "ref.pt")))

    # 4 ranks, the same global batch: the same math in another reduction order
    assert f"at step {saved}\n" in wider.output(), wider.output()
    done = losses(wider.output())
    assert sorted(done) == list(range(saved, saved + 3)), wider.output()
    for step, loss in done.items():
        assert abs(float(loss) - float(expected[step])) <= 1e-6, (step, loss, expected[step])


def digest(folder: str) -> str:
    """sha256 of every file's path and bytes under `folder`."""
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            h.update(os.path.relpath(os.path.join(root, name), folder).encode())
            with open(os.path.join(root, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


IN_ONE_PROCESS = """
import contextlib, io, json, os, sys
import torch.distributed as dist
example, cases, port = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
sys.path.insert(0, os.path.dirname(example))
import train_gpt
init, agent = dist.init_process_group, dict(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_MAX_RESTARTS="1")
def init_as_under_torchrun(*args, **kwargs):  # whose agent hosts the store: seen by shard, not by the rendezvous
    for k in agent:
        os.environ.pop(k, None)
    init(*args, **kwargs)
    os.environ.update(agent)
dist.init_process_group = init_as_under_torchrun
results = []
for i, args in enumerate(cases):
    os.environ["MASTER_PORT"] = str(port + i)
    sys.argv[1:] = args
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            train_gpt.main()
        code = 0
    except SystemExit as e:
        code = e.code
    except ValueError as e:
        code, err = 1, io.StringIO(f"ValueError: {e}")
    if dist.is_initialized():
        dist.destroy_process_group()
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def test_relaunch_with_another_model_a_batch_that_does_not_split_or_steps_below_the_checkpoint_fails_clearly(tmp_path):
    ckpt, common = str(tmp_path / "ckpt"), ("--eager", "--checkpoint-dir", str(tmp_path / "ckpt"), "--batch", "3")
    small = ("--layers", "1", "--d-model", "32")
    folder = os.path.join(ckpt, "save-000001")
    cases = {  # one process, one rank: train_gpt's main() once per case
        "save": [*common, *small, "--steps", "3"],
        "deeper": [*common, "--layers", "2", "--d-model", "32"],
        "wider": [*common, "--layers", "1", "--d-model", "64"],
        "steps": [*common, *small, "--steps", "2"],
    }
    expected = {  # exit code, part of what it printed on stderr
        # as if under torchrun --max-restarts 1 on its agent's store: shard names the settings that restart in place
        "save": (0, "(--max-restarts 1) on its agent's store, which keeps the keys of an attempt that dies"),
        "deeper": (1, f"ValueError: checkpoint {folder} has no entry for model parameter/buffer 'blocks.1."),
        "wider": (1, f"ValueError: checkpoint {folder}: 'tok_emb.weight' has shape (512, 32) in the checkpoint but"),
        "steps": (2, f"--steps 2 is below step 3, where the checkpoint in {ckpt} resumes (the data is endless"),
    }
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    one = subprocess.Popen(
        [sys.executable, "-c", IN_ONE_PROCESS, EXAMPLE, json.dumps(list(cases.values())), str(free_port())],
        stdout=subprocess.PIPE,
        env=dict(env, OMP_NUM_THREADS="1"),
        text=True,
    )
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(ckpt, "committed.json")):  # the save is done
        assert one.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    before = digest(ckpt)
    world = Run(tmp_path / "world-", ckpt, world=2, extra=("--batch", "3", *small))  # 2 ranks: 3 does not split
    results = json.loads(one.communicate(timeout=120)[0].splitlines()[-1])
    for case, (got, output) in zip(cases, results):
        assert [got, expected[case][1] in output] == [expected[case][0], True], (case, got, output)
    assert world.finish(timeout=120) == [2, 2], world.output()
    for log in world.logs:  # on every rank, before any collective
        output = open(log).read()
        assert "--batch 3 does not split evenly over 2 ranks x --accumulate 1 micro-batches: run on" in output, output
    assert digest(ckpt) == before


def test_checkpoint_every_below_one_is_an_argument_error():
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--checkpoint-dir", "x", "--checkpoint-every", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "--checkpoint-every: must be 1 or more, got 0" in proc.stderr, proc.stderr
