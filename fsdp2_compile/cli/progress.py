"""The CLI's progress on stderr while it imports, builds, compiles and writes."""

from __future__ import annotations

import sys
import threading
import time

from fsdp2_compile.cli.arguments import PROG

__all__ = ["Progress"]


class Progress:
    """The CLI's long phases on stderr: a tqdm bar (phase i of n, elapsed time ticking every second) when tqdm is
    installed and stderr is a terminal, else one `[  1.2 s] phase ...` line per phase and `done` at the end;
    nothing when quiet."""

    def __init__(self, total: int | None = None, quiet: bool = False, stream=None):
        self.stream = stream or sys.stderr
        self.quiet, self.start, self.bar = quiet, time.perf_counter(), None
        if not quiet and self.stream.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(
                total=total,
                file=self.stream,
                desc=PROG,
                leave=False,
                mininterval=0,
                bar_format="{desc} [phase {n_fmt}/{total_fmt}, {elapsed}]",
            )
            self.stop = threading.Event()
            threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while not self.stop.wait(1.0):
            self.bar.refresh()

    def step(self, message: str) -> None:
        """A new phase begins (the previous one is done)."""
        if self.bar is not None:
            self.bar.set_description_str(f"{PROG}: {message}", refresh=False)
            self.bar.update(1)
        elif not self.quiet:
            print(f"{PROG}: [{time.perf_counter() - self.start:5.1f} s] {message} ...", file=self.stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if self.bar is not None:
            self.stop.set()
            self.bar.close()
        if not self.quiet and exc_type is None:
            print(f"{PROG}: [{time.perf_counter() - self.start:5.1f} s] done", file=self.stream, flush=True)
