"""examples/train_gpt.py on 2 gloo ranks, stopped and relaunched: a SIGTERM to one rank stops both after the same
step with a save and exit 0, and a SIGKILL between two saves loses only the steps since the last commit; the
relaunched runs' losses and final checkpoint are bitwise those of a run never stopped."""

from __future__ import annotations

import json
import os
import re
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
    """The example on 2 ranks, launched as torchrun would (env:// rendezvous), each rank's output in a file."""

    def __init__(self, folder, ckpt: str) -> None:
        port, self.logs = free_port(), [f"{folder}rank{r}.log" for r in range(2)]
        args = ["--eager", "--steps", str(STEPS), "--checkpoint-dir", ckpt, "--checkpoint-every", str(EVERY)]
        self.procs = []
        for rank, log in enumerate(self.logs):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
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


def test_sigterm_to_one_rank_then_sigkill_to_both_then_relaunch_is_bitwise_an_uninterrupted_run(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    reference, first = Run(tmp_path / "ref-", str(tmp_path / "ref")), Run(tmp_path / "1-", ckpt)
    # SIGTERM to rank 1 only: rank 0 learns of it through the per-step all-reduce of the stop flag
    first.wait_for("step   1  loss")
    first.procs[1].send_signal(signal.SIGTERM)
    assert first.finish() == [0, 0], first.output()
    saved = int(re.search(r"SIGTERM: saved at step (\d+)", first.output())[1])
    assert 2 <= saved < STEPS - 5 and max(losses(first.output())) == saved - 1, first.output()
    assert reference.finish() == [0, 0], reference.output()
    expected = losses(reference.output())
    assert sorted(expected) == list(range(STEPS))

    # relaunched, then SIGKILL to both once a save every 3 steps has come after the resumed step
    second = Run(tmp_path / "2-", ckpt)
    second.wait_for(f"step {saved + 4:3d}  loss")
    for p in second.procs:
        p.kill()
    assert second.finish() == [-signal.SIGKILL] * 2, second.output()
    assert f"at step {saved}\n" in second.output(), second.output()
    third = Run(tmp_path / "3-", ckpt)
    assert third.finish() == [0, 0], third.output()
    resumed = int(re.search(r"resumed from \S+ at step (\d+)\n", third.output())[1])
    # the last commit: a save of the every-3-steps schedule, none after the last step rank 0 printed
    assert resumed % EVERY == 0 and saved < resumed <= max(losses(second.output())) + 1, third.output()

    for run, start in ((second, saved), (third, resumed)):
        done = losses(run.output())
        assert min(done) == start and done == {step: expected[step] for step in done}, (done, expected)
    assert max(losses(third.output())) == STEPS - 1
    ours = committed(ckpt, str(tmp_path / "ours.pt"))
    assert ours["extra"]["train"]["step"] == STEPS
    assert_same(ours, committed(str(tmp_path / "ref"), str(tmp_path / "ref.pt")))


def test_checkpoint_every_below_one_is_an_argument_error():
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--checkpoint-dir", "x", "--checkpoint-every", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "--checkpoint-every: must be 1 or more, got 0" in proc.stderr, proc.stderr
