"""Memory safety over many steps: 150 training steps of the default pipeline with glibc filling every
freed byte (MALLOC_PERTURB_) and checking its heap (MALLOC_CHECK_=3), compared bitwise with `fully_shard` under the
same settings. A collective reading a freed buffer would send the pattern (the losses stop matching); a write
after free aborts the rank. The long version is `benchmarks/soak.py` (its figures are in docs/results.md)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import soak  # noqa: E402

STEPS = 150


def test_150_steps_under_malloc_perturb_match_fully_shard_bitwise():
    ours = soak.run("ours", STEPS, malloc_check=True)
    eager = soak.run("fsdp2", STEPS, malloc_check=True)
    assert ours["codes"] == [0, 0], f"a rank of ours died: exit codes {ours['codes']}"
    assert eager["codes"] == [0, 0], f"a fully_shard rank died: exit codes {eager['codes']}"
    mine, ref = ours["result"], eager["result"]
    assert len(mine["losses"]) == len(ref["losses"]) == STEPS
    differ = [i for i, (a, b) in enumerate(zip(mine["losses"], ref["losses"])) if a != b]
    assert not differ, (
        f"losses differ from fully_shard from step {differ[0]}: {mine['losses'][differ[0]]} vs {ref['losses'][differ[0]]}"
    )
    (_, counts_early), (_, counts_end) = mine["marks"][100], mine["marks"][STEPS]
    assert counts_early == counts_end == (1, 1, 0)  # one forward and one backward graph, no recompiles
