"""A torch.profiler trace of a window of training steps, written gzip-compressed, one file per rank."""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

MAX_PROFILE_STEPS = 20  # a trace holds every operator of every step: this bounds the file (tens of MB at most)
TOP_OPERATORS = 10


class ProfilerWindow:
    """Records optimizer steps ``[start, stop)`` with torch.profiler and writes ``trace-rank<R>.json.gz``.

    Every rank records the same window, so no rank waits in a collective on a rank slowed by profiling. The
    trace opens in https://ui.perfetto.dev or chrome://tracing (both read gzip). Shapes, stacks and memory
    events are not recorded, and the window is at most ``MAX_PROFILE_STEPS`` steps: the file stays small.

    Example::

        window = ProfilerWindow(5, 8, Path("runs/x/perf"), rank=0)
        # at each batch start: window.batch_starting(global_step); at each batch end: window.batch_ended(step)

    """

    def __init__(self, start: int, stop: int, folder: Path, rank: int) -> None:
        check_window(start, stop)
        self.start, self.stop = start, stop
        self.path = folder / f"trace-rank{rank}.json.gz"
        self.top_operators = ""
        self._profiler: profile | None = None
        self.done = False

    def batch_starting(self, step: int) -> None:
        """Start recording when optimizer step ``start`` begins."""
        if self._profiler is None and not self.done and self.start <= step < self.stop:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._profiler = profile(activities=activities)
            self._profiler.__enter__()

    def batch_ended(self, step: int) -> Path | None:
        """Stop and write the trace once ``stop`` steps are done (or at the end of training); its path."""
        if self._profiler is None or step < self.stop:
            return None
        return self.finish()

    def finish(self) -> Path | None:
        """Stop recording now and write what was recorded; None when nothing was being recorded."""
        if self._profiler is None:
            return None
        profiler, self._profiler, self.done = self._profiler, None, True
        profiler.__exit__(None, None, None)
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        self.top_operators = profiler.key_averages().table(sort_by=sort, row_limit=TOP_OPERATORS)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, raw = tempfile.mkstemp(suffix=".json", dir=self.path.parent)
        os.close(descriptor)
        try:
            profiler.export_chrome_trace(raw)
            partial = self.path.with_name(self.path.name + ".partial")
            with open(raw, "rb") as source, gzip.open(partial, "wb", compresslevel=6) as target:
                shutil.copyfileobj(source, target, 2**20)
            partial.replace(self.path)
        finally:
            Path(raw).unlink(missing_ok=True)
        return self.path


def check_window(start: int, stop: int) -> None:
    """Raise ValueError for a window that is not ``0 <= start < stop`` or longer than ``MAX_PROFILE_STEPS``."""
    if start < 0 or stop <= start:
        raise ValueError(f"profile_steps must be [start, stop] with 0 <= start < stop, got [{start}, {stop}]")
    if stop - start > MAX_PROFILE_STEPS:
        raise ValueError(
            f"profile_steps [{start}, {stop}] spans {stop - start} steps; at most {MAX_PROFILE_STEPS} "
            "(a trace records every operator: a longer window makes files too large to open)"
        )
