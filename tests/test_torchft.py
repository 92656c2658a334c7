"""torchft's replica recovery with `shard_compile`, as torchtitan wires it (examples/train_gpt_ft.py): 2 replica
groups x 2 ranks, the lighthouse in this process; one group is lost mid-step and relaunched; the same with
`fully_shard`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
from harness import free_port
from torchft._torchft import LighthouseServer

WORKER = os.path.join(os.path.dirname(__file__), "ft_worker.py")
STEPS, LOST_AT, BACK_AT = 6, 2, 4
"""The job's steps; the step whose backward the lost group never runs; the step the relaunched group joins at."""
SMALL = ["--layers", "1", "--d-model", "32"]


def _launch(replica: int, plan: dict, lighthouse: str, args: list[str]) -> list[subprocess.Popen]:
    port = str(free_port())
    ranks = []
    for rank in range(2):
        env = dict(
            os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
        )
        env["TORCHFT_LIGHTHOUSE"] = lighthouse
        rank_plan = dict(plan, out=f"{plan['out']}.{rank}")
        with open(f"{plan['out']}.{rank}.log", "w") as log:
            command = [sys.executable, WORKER, json.dumps(rank_plan), "--replica-id", str(replica), *args]
            ranks.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    return ranks


def _wait(ranks: list[subprocess.Popen], timeout: float = 300) -> list[int]:
    return [r.wait(timeout=timeout) for r in ranks]


def scenario(tmp, args: list[str], steps=STEPS, lost_at=LOST_AT, back_at=BACK_AT) -> dict:
    """Group 0 trains throughout (holding before step `back_at` until group 1 is back); group 1 exits abruptly in
    step `lost_at` (before its backward), is relaunched at once and joins at `back_at`. Per rank ("live.0",
    "back.1", ...) what `ft_worker.py` saved; "relaunched": the wall time of the relaunch."""
    flags = tmp / "flags"
    flags.mkdir(parents=True)
    args = [*args, "--steps", str(steps)]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10_000, heartbeat_timeout_ms=2_000)
    launched = []
    try:
        both = dict(flags=str(flags), start_with=[0, 1])  # the first quorum holds both groups
        launched += _launch(0, dict(both, out=str(tmp / "live"), hold_at=back_at), lighthouse.address(), args)
        launched += _launch(1, dict(both, out=str(tmp / "lost"), die_at=lost_at), lighthouse.address(), args)
        assert _wait(launched[2:]) == [1, 1]
        relaunched = time.time()
        launched += _launch(
            1, dict(out=str(tmp / "back"), come_back=back_at, flags=str(flags)), lighthouse.address(), args
        )
        assert _wait(launched[:2] + launched[4:]) == [0, 0, 0, 0]
    finally:
        for p in launched:
            p.kill()
        lighthouse.shutdown()
    out = {f"{g}.{r}": torch.load(tmp / f"{g}.{r}") for g in ("live", "back") for r in range(2)}
    return dict(out, relaunched=relaunched)


def test_a_lost_replica_group_is_relaunched_heals_and_rejoins_as_with_fully_shard(tmp_path):
    ours = scenario(tmp_path / "ours", SMALL)
    for rank in range(2):
        live, back = ours[f"live.{rank}"]["rows"], ours[f"back.{rank}"]["rows"]
        # the live group never stopped: each step committed once, the step the other group was lost in run again
        assert [s for s, committed, _, _ in live if committed] == list(range(STEPS))
        assert [(s, c) for s, c, _, _ in live if s == LOST_AT] == [(LOST_AT, False), (LOST_AT, True)]
        assert [n for s, c, n, _ in live if c] == [2] * LOST_AT + [1] * (BACK_AT - LOST_AT) + [2] * (STEPS - BACK_AT)
        # the relaunched group started at the live group's step, with its state, and committed every step after
        assert [(s, c, n) for s, c, n, _ in back] == [(s, True, 2) for s in range(BACK_AT, STEPS)]
        for name, p in ours[f"live.{rank}"]["params"].items():
            assert torch.equal(ours[f"back.{rank}"]["params"][name], p), name
    reference = scenario(tmp_path / "fully_shard", [*SMALL, "--fully-shard"])
    for key in (f"{g}.{r}" for g in ("live", "back") for r in range(2)):
        got = ours[key]
        assert got["rows"] == reference[key]["rows"], key
        for name, p in reference[key]["params"].items():
            assert torch.equal(got["params"][name], p), (key, name)
