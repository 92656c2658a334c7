"""A graph saved in the compile cache (`CompileConfig.compile_cache`, `compile_cache.py`) runs through the step
watch (`step_watch.py`) as the graphs the backend compiles do, where it is compiled and where it is loaded; where
it is loaded, its schedule is checked with the ranks' as a compiled graph's is (`rank_consistency.py`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from fsdp2_compile.compiler.graph_records import record_owner
from fsdp2_compile.compiler.rank_consistency import check_loaded_schedule
from fsdp2_compile.compiler.step_watch import watched
from fsdp2_compile.runtime.validation import default_device_type

__all__ = ["SavedGraph"]


@dataclasses.dataclass(frozen=True)
class SavedGraph:
    """What a saved graph runs through, pickled with it (`_torch_private.serializable_graph`'s `wrap`): called with
    the graph's boxed call where it is compiled and again where it is loaded, for the model compiled or loaded
    then. `record` is what the ranks agreed on for it (`rank_consistency.schedule_record`, as JSON)."""

    kind: str
    group_names: frozenset[str]
    check_rank_consistency: bool
    record: str

    def __call__(self, run: Callable[[list], Any]) -> Callable[[list], Any]:
        check_loaded_schedule(set(self.group_names), self.kind, json.loads(self.record))
        check = self.check_rank_consistency and default_device_type() == "cpu"
        return watched(run, self.kind, set(self.group_names), record_owner(), check)
