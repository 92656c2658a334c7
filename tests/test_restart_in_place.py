"""A job restarted in place by torchrun's agent after a rank died in the middle of a store exchange: the second
attempt trains as a job that never failed, and none of its exchanges uses the keys of the first.

torchrun's agent keeps its store across attempts unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; on that kept store
torch's own gloo `init_process_group` of the second attempt reads the dead attempt's addresses ("Connection
refused") before any code of the library runs, which `shard` warns of. The job therefore runs with a store per
attempt, as that warning advises, and the test checks that the library's keys are scoped by attempt all the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import restart_workers
from harness import run_ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "restart_workers.py")


def _attempt(out: str, attempt: int, rank: int) -> dict:
    with open(os.path.join(out, f"attempt{attempt}-rank{rank}.json")) as f:
        return json.load(f)


def test_a_rank_killed_mid_exchange_is_restarted_in_place_and_trains_as_without_it(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "1"]
    command += ["--nproc-per-node", "2", WORKER, str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "failed (exitcode: 17) local_rank: 1" in done.stderr, done.stderr[-3000:]  # the first attempt's death

    died = _attempt(tmp_path, 0, 1)
    assert "losses" not in died and died["keys"][-1].endswith("/first-call/0"), died  # mid-exchange
    expected = run_ranks(restart_workers.train, 2)
    for rank in (0, 1):
        first, second = _attempt(tmp_path, 0, rank), _attempt(tmp_path, 1, rank)
        assert second["losses"] == expected[rank], (second["losses"], expected[rank])
        assert first["keys"] and not set(first["keys"]) & set(second["keys"]), (first["keys"], second["keys"])
