"""Stop the training of examples/train_gpt.py (the GPT of 4 layers, d 128, compiled, 2 gloo ranks) in five ways and
resume it: what happens, the time from the stop to the first step trained again, and the steps lost (trained again
after the resume).

    .venv/bin/python benchmarks/restarts.py [--runs 1] [--steps 20] [--shared-store-tries 0]

Cases (each launched with torchrun, saving every 5 steps; stopped once step 7 is printed, i.e. 3 steps after the
commit at step 5):
  sigterm        SIGTERM to torchrun (a scheduler's notice), then the same command again
  sigkill        SIGKILL of rank 1, torchrun --max-restarts 0 ends the job, then the same command again
  elastic        SIGKILL of rank 1 under torchrun --max-restarts 1 --rdzv-backend c10d with
                 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the agent restarts both ranks in place
  world          SIGTERM at 2 ranks, relaunched at 4
  async-killed   --async-save; both ranks SIGKILLed just after the save at step 10 began (checked: not committed),
                 then the same command again
--shared-store-tries N also runs the elastic case N times on torchrun's default store (shared by the attempts) and
counts how each try ended.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_preemption import children  # noqa: E402  (torchrun's workers, found as the test finds them)

EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")
EVERY, STOP_AFTER = 5, 7


class Launch:
    """torchrun running the example, its output in a file."""

    def __init__(self, log: str, ckpt: str, steps: int, nproc: int = 2, restarts: int = 0, extra=(), env=None):
        self.log = log
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        cmd += ["--max-restarts", str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
        cmd += [EXAMPLE, "--steps", str(steps), "--checkpoint-dir", ckpt, "--checkpoint-every", str(EVERY), *extra]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=out, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), cwd=ROOT
            )

    def output(self) -> str:
        with open(self.log) as f:
            return f.read()

    def wait_for(self, pattern: str, timeout: float = 300, after: int = 0) -> re.Match | None:
        """The first match of `pattern` in the output past offset `after`; None if torchrun ended or time ran out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if m := re.compile(pattern, re.M).search(self.output(), after):
                return m
            if self.proc.poll() is not None:
                return re.compile(pattern, re.M).search(self.output(), after)
            time.sleep(0.02)
        return None

    def workers(self) -> dict[int, int]:
        """LOCAL_RANK -> pid of torchrun's worker processes."""
        return children(self.proc.pid)

    def end(self, timeout: float = 300) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.proc.kill()
            self.proc.wait()


def last_step(text: str) -> int:
    return max(int(s) for s in re.findall(r"^step +(\d+)  loss", text, re.M))


def resumed(launch: Launch, timeout: float = 300, after: int = 0) -> tuple[float, int, int] | None:
    """(when the first step after a resume was printed, the step resumed at, where its line starts) or None."""
    m = launch.wait_for(r"^resumed from \S+ at step (\d+)\n", timeout, after)
    if m is None or launch.wait_for(r"^step +\d+  loss", timeout, m.end()) is None:
        return None
    return time.monotonic(), int(m[1]), m.start()


def relaunched(tmp: str, name: str, ckpt: str, steps: int, t0: float, done: int, nproc: int = 2) -> dict:
    again = Launch(f"{tmp}/{name}-2.log", ckpt, steps, nproc=nproc)
    r = resumed(again)
    code = again.end()
    if r is None or code != 0:
        return {"ended": f"relaunch failed ({code}): {again.output()[-500:]}"}
    return {"ended": "resumed", "resume_s": r[0] - t0, "lost": done - r[1]}


def case_sigterm(tmp: str, steps: int, nproc_after: int = 2) -> dict:
    ckpt, first = f"{tmp}/ckpt", Launch(f"{tmp}/first.log", f"{tmp}/ckpt", steps)
    first.wait_for(rf"^step +{STOP_AFTER}  loss")
    t0 = time.monotonic()
    first.proc.send_signal(signal.SIGTERM)
    first.end()
    if "SIGTERM: saved at step" not in first.output():
        return {"ended": f"no save on SIGTERM: {first.output()[-500:]}"}
    exit_s, done = time.monotonic() - t0, last_step(first.output()) + 1
    return {**relaunched(tmp, "again", ckpt, steps, t0, done, nproc_after), "exit_s": exit_s}


def case_sigkill(tmp: str, steps: int) -> dict:
    ckpt, first = f"{tmp}/ckpt", Launch(f"{tmp}/first.log", f"{tmp}/ckpt", steps)
    first.wait_for(rf"^step +{STOP_AFTER}  loss")
    t0 = time.monotonic()
    os.kill(first.workers()[1], signal.SIGKILL)
    first.end()
    exit_s, done = time.monotonic() - t0, last_step(first.output()) + 1
    return {**relaunched(tmp, "again", ckpt, steps, t0, done), "exit_s": exit_s}


def case_elastic(tmp: str, steps: int, fresh_store: bool = True, timeout: float = 300) -> dict:
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if fresh_store else {}
    run = Launch(f"{tmp}/elastic.log", f"{tmp}/ckpt", steps, restarts=1, env=env)
    run.wait_for(rf"^step +{STOP_AFTER}  loss")
    t0, offset = time.monotonic(), len(run.output())
    os.kill(run.workers()[1], signal.SIGKILL)
    r = resumed(run, timeout, offset)
    code = run.end(timeout)
    if r is None or code != 0:
        out = run.output()[offset:]
        why = "hung (killed after the timeout)" if code is None else f"failed ({code})"
        if "connectFullMesh failed" in out:
            why += ": init_process_group, Connection refused"
        return {"ended": why, "after_s": time.monotonic() - t0}
    return {"ended": "resumed", "resume_s": r[0] - t0, "lost": last_step(run.output()[: r[2]]) + 1 - r[1]}


def case_async_killed(tmp: str, steps: int) -> dict:
    ckpt = f"{tmp}/ckpt"
    first = Launch(f"{tmp}/first.log", ckpt, steps, extra=["--async-save"])
    first.wait_for(rf"^step +{2 * EVERY - 1}  loss")  # the save at step 10 starts once this step is printed
    time.sleep(0.05)
    t0 = time.monotonic()
    for pid in first.workers().values():
        os.kill(pid, signal.SIGKILL)
    first.end()
    with open(f"{ckpt}/committed.json") as f:
        record = json.load(f)["folder"]
    half = sorted(d for d in os.listdir(ckpt) if d.startswith("save-") and d != record)
    if not half:
        return {"ended": "the kill came after the commit: not mid-write"}
    done = last_step(first.output()) + 1
    return {**relaunched(tmp, "again", ckpt, steps, t0, done), "uncommitted": half}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--shared-store-tries", type=int, default=0)
    parser.add_argument("--cases", default="sigterm,sigkill,elastic,world,async-killed")
    args = parser.parse_args()
    cases = {
        "sigterm": lambda tmp: case_sigterm(tmp, args.steps),
        "sigkill": lambda tmp: case_sigkill(tmp, args.steps),
        "elastic": lambda tmp: case_elastic(tmp, args.steps),
        "world": lambda tmp: case_sigterm(tmp, args.steps, nproc_after=4),
        "async-killed": lambda tmp: case_async_killed(tmp, args.steps),
    }
    results: dict[str, list[dict]] = {}
    for run in range(args.runs):
        for name in args.cases.split(","):
            tmp = tempfile.mkdtemp(prefix=f"restarts-{name}-")
            try:
                results.setdefault(name, []).append(cases[name](tmp))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            print(f"run {run + 1} {name}: {results[name][-1]}", flush=True)
    for i in range(args.shared_store_tries):
        tmp = tempfile.mkdtemp(prefix="restarts-shared-")
        try:
            results.setdefault("elastic-shared-store", []).append(case_elastic(tmp, args.steps, False, timeout=150))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"try {i + 1} elastic on the shared store: {results['elastic-shared-store'][-1]}", flush=True)
    print("\ncase | ended | time to resume (s), median [min, max] | steps lost")
    for name, rs in results.items():
        times = [r["resume_s"] for r in rs if "resume_s" in r]
        spread = f"{statistics.median(times):.1f} [{min(times):.1f}, {max(times):.1f}]" if times else "-"
        ended = ", ".join(sorted({r["ended"] for r in rs}))
        print(f"{name} | {ended} | {spread} | {sorted({r['lost'] for r in rs if 'lost' in r})}")


if __name__ == "__main__":
    main()
