"""A local, append-only journal of what a tracker logged, so a kill cannot lose it.

W&B's service buffers an offline run's records in memory; a job killed with SIGKILL (OOM killer, a node lost,
a scheduler's hard kill) left a 7-byte ``.wandb`` file behind, and everything that segment logged was gone
from what ``wandb sync`` uploads. The journal keeps each logged row on disk as it is logged (one line,
flushed: it survives the process, not the machine), and marks a segment closed when its process exits
normally. The next segment of the same run replays the rows of segments never closed, up to where it
starts logging itself (resume is exact, so it logs the later steps again, with the same values).

Example::

    journal = Journal(Path("runs/x/wandb/journal-3f2a9c1e.jsonl"), segment="offline-run-...-3f2a9c1e")
    rows, artifacts = journal.unsynced(before_step=10)
    for row in rows:
        run.log(row)
    journal.record({"train/loss": 2.3}, step=10)
    journal.close("exit")
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class Journal:
    """Rows a run logged, per segment (one launch of the run).

    Args:
        path: the journal file (created on first write).
        segment: this launch's name (for W&B, its ``offline-run-*``/``run-*`` folder).

    """

    def __init__(self, path: Path, segment: str) -> None:
        self.path = path
        self.segment = segment

    def record(self, metrics: Mapping[str, Any], step: int | None) -> None:
        """Append one logged row of this segment."""
        self._append({"segment": self.segment, "step": step, "metrics": dict(metrics)})

    def record_artifact(self, path: Path) -> None:
        """Append that this segment logged the checkpoint folder ``path`` as an artifact."""
        self._append({"segment": self.segment, "artifact": str(path)})

    def close(self, how: str) -> None:
        """Mark this segment closed: its process ends normally, so its tracker flushes what it logged."""
        self._append({"segment": self.segment, "closed": how})

    def unsynced(self, before_step: int | None) -> tuple[list[dict[str, Any]], list[Path]]:
        """Rows and artifact folders of earlier segments that never closed.

        Rows only with a step below ``before_step`` (None: all). They are journaled again as this segment's own,
        so a launch killed after replaying them hands them on (two kills in a row lose nothing); each such
        segment is then marked replayed, so no later launch replays it twice.
        """
        entries = self._read()
        closed = {e["segment"] for e in entries if "closed" in e or "replayed_into" in e}
        lost = {e["segment"] for e in entries if "metrics" in e or "artifact" in e} - closed - {self.segment}
        # Each folder once: one recorded by several segments that never closed is logged again once.
        artifacts = [
            Path(a)
            for a in dict.fromkeys(e["artifact"] for e in entries if e.get("segment") in lost and "artifact" in e)
        ]
        replayed = [
            e
            for e in entries
            if e.get("segment") in lost
            and "metrics" in e
            and (before_step is None or e["step"] is None or e["step"] < before_step)
        ]
        rows = [
            {**e["metrics"], **({"trainer/global_step": e["step"]} if e["step"] is not None else {})} for e in replayed
        ]
        # The replayed rows become this segment's own first (killed too, it hands them on to the next launch; a
        # kill between the two writes replays them twice, never loses them), then their segments are marked.
        for e in replayed:
            self.record(e["metrics"], e["step"])  # (artifacts: journaled again as the tracker logs them again)
        for segment in sorted(lost):
            self._append({"segment": segment, "replayed_into": self.segment})
        return rows, artifacts

    def _read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        entries = []
        for line in self.path.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by the kill
        return entries

    def _append(self, entry: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(json.dumps(entry, default=float) + "\n")
            handle.flush()
