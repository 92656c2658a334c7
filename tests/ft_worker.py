"""One rank of a replica group of examples/train_gpt_ft.py, run by tests/test_torchft.py as its own process:

    python tests/ft_worker.py PLAN_JSON [train_gpt_ft.py arguments]

PLAN_JSON: {"out": file for this rank's rows and full parameters, "die_at": step whose backward the rank never
runs (it exits abruptly, as a lost machine), "hold_at": step before whose quorum the rank writes
`<flags>/at_<step>` and waits for `<flags>/back`, "come_back": write `<flags>/back` once `<flags>/at_<hold_at>`
exists, before the first quorum, "start_with": replica ids whose ranks all reach their first quorum together (each
writes `<flags>/ready_<replica>.<rank>`)}. Saves the rows `train` returns, the full parameters and the wall time
at each step's quorum and at the end (`stamps`: (where, step, time))."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from train_gpt_ft import parse_args, train  # noqa: E402


def wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.05)


def main() -> None:
    plan, args = json.loads(sys.argv[1]), parse_args(sys.argv[2:])
    flags = plan.get("flags", "")

    stamps = []

    def before(where: str, step: int) -> None:
        if where == "quorum":
            stamps.append((where, step, time.time()))
        if where == "quorum" and plan.get("start_with"):
            open(os.path.join(flags, f"ready_{args.replica_id}.{os.environ['RANK']}"), "w").close()
            for replica in plan.pop("start_with"):
                for rank in range(int(os.environ["WORLD_SIZE"])):
                    wait_for(os.path.join(flags, f"ready_{replica}.{rank}"))
        if where == "backward" and step == plan.get("die_at"):
            os._exit(1)
        if where == "quorum" and step == plan.get("hold_at"):
            open(os.path.join(flags, f"at_{step}"), "w").close()
            wait_for(os.path.join(flags, "back"))
            time.sleep(2.0)  # the returning group asks for the quorum first: this one's includes it
        if where == "quorum" and plan.get("come_back") is not None:
            wait_for(os.path.join(flags, f"at_{plan.pop('come_back')}"))
            open(os.path.join(flags, "back"), "w").close()

    rows, model = train(args, before)
    stamps.append(("done", len(rows), time.time()))
    params = {name: p.full_tensor() for name, p in model.named_parameters()}
    torch.save({"rows": rows, "params": params, "stamps": stamps}, plan["out"])


if __name__ == "__main__":
    main()
