"""Run one benchmark against the code before a change and after it, alternating, and keep both outputs.

A restructuring must not change behaviour or speed. This runs the same benchmark script from two source
trees (a git worktree of the earlier commit, and this checkout), alternating which goes first in each round,
each as a fresh process with ``PYTHONPATH`` set to its tree (so the ranks and subprocesses it launches import
that tree's package), and writes every run's closing lines, side by side, to one dated result file.

    git worktree add /tmp/before <earlier commit>
    python benchmarks/restructure/alternate.py --before /tmp/before --rounds 2 \\
        --topic restructure_ddp -- benchmarks/ddp/bench.py --repeats 3

Each benchmark still measures its own baseline inside each run (e.g. Lightning's ``ddp``); comparing the
ratios of the two trees is what says whether the change moved anything.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import write_result

AFTER = Path(__file__).resolve().parents[2]


def _run(tree: Path, script: str, arguments: list[str], tail: int) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(tree / script), *arguments], cwd=tree, env=env, capture_output=True, text=True
    )
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, time.monotonic() - start, "\n".join(lines[-tail:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="source tree of the code before the change")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--topic", required=True, help="result file name: results/<topic>_cpu-2proc_<yyyymm>.md")
    parser.add_argument("--tail", type=int, default=16, help="closing lines of each run to keep")
    parser.add_argument("script", help="benchmark script, relative to the repository root")
    parser.add_argument("arguments", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    arguments = [a for a in args.arguments if a != "--"]
    trees = {"before": args.before.resolve(), "after": AFTER}
    sections = []
    for round_index in range(args.rounds):
        order = ["before", "after"] if round_index % 2 == 0 else ["after", "before"]
        for label in order:
            code, seconds, tail = _run(trees[label], args.script, arguments, args.tail)
            print(f"round {round_index} {label}: exit {code}, {seconds:.0f} s\n{tail}\n", flush=True)
            sections.append(
                f"### Round {round_index}, {label} (exit {code}, {seconds:.0f} s)\n\n```text\n{tail}\n```\n"
            )
    body = (
        f"`{args.script} {' '.join(arguments)}` from the code before the change ({trees['before']}) and after it "
        f"(this checkout), {args.rounds} rounds, alternating which runs first.\n\n" + "\n".join(sections)
    )
    path = write_result(args.topic, "cpu-2proc", body)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
