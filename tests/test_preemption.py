"""examples/train_gpt.py on 2 gloo ranks, stopped and relaunched: a SIGTERM to one rank stops both after the same
step with a save and exit 0, and a SIGKILL between two saves loses only the steps since the last commit; the
relaunched runs' losses and final checkpoint are bitwise those of a run never stopped, whether relaunched anew or
restarted in place by torchrun's agent; relaunched at 4 ranks, the losses are within 1e-6 of the 2-rank run's."""

from __future__ import annotations

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

    def __init__(self, folder, ckpt: str, world: int = 2, steps: int = STEPS) -> None:
        port, self.logs = free_port(), [f"{folder}rank{r}.log" for r in range(world)]
        args = ["--eager", "--steps", str(steps), "--checkpoint-dir", ckpt, "--checkpoint-every", str(EVERY)]
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


def test_checkpoint_every_below_one_is_an_argument_error():
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--checkpoint-dir", "x", "--checkpoint-every", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "--checkpoint-every: must be 1 or more, got 0" in proc.stderr, proc.stderr
