"""torch.compile on CPU: what compiling costs, regional against whole-model, and the step time it buys.

    python benchmarks/compile/bench.py [--steps 30] [--warmup 10] [--repeats 1]

Each job is the command a user runs, a fresh process with an empty inductor cache (the first launch on a
machine) and its own run folder::

    python -m lightning_mlopt fit --config configs/gpt.yaml --config configs/strategies/ddp.yaml \\
        [--config configs/features/compile.yaml [--compile.regions=model]] \\
        --trainer.accelerator=cpu --trainer.devices=1 --trainer.max_steps=STEPS

Arms, in one run: ``eager`` (the baseline), ``blocks`` (the feature file's default: each repeated block, one
graph for the stack), ``model`` (the network whole). Per arm: the compile seconds the run's ``perf/summary.json``
records (``compile.seconds``: dynamo, AOT autograd and inductor, forward and backward), the graphs compiled, and
the mean step time after ``--warmup`` steps (``benchmarks/gpu/span.py``'s clock: compilation happens at step 2,
inside the warm-up), with its ratio to eager. The order of the arms rotates between repeats; medians.

On two CPU cores this measures compile time and that the compiled model runs; the speed that matters is a GPU's
(``benchmarks/gpu/checklist.py``, row ``compile``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import median, publish

REPO = Path(__file__).resolve().parents[2]
ARMS = {
    "eager": [],
    "blocks": ["--config", str(REPO / "configs" / "features" / "compile.yaml")],
    "model": ["--config", str(REPO / "configs" / "features" / "compile.yaml"), "--compile.regions=model"],
}


def _job(arm: str, steps: int, warmup: int) -> dict[str, float | int | None]:
    with tempfile.TemporaryDirectory(prefix="compile_bench_") as root:
        command = [
            sys.executable, "-m", "lightning_mlopt", "fit",
            "--config", str(REPO / "configs" / "gpt.yaml"),
            "--config", str(REPO / "configs" / "strategies" / "ddp.yaml"),
            *ARMS[arm], "--trainer.accelerator=cpu", "--trainer.devices=1", f"--trainer.max_steps={steps}",
            "--trainer.enable_progress_bar=false", "--trainer.logger=false", "--checkpoint.save_on.train_end=false",
            "--trainer.callbacks+=span.SyncedSpan", f"--trainer.callbacks.warmup={warmup}",
            f"--trainer.callbacks.out={root}/span.json", f"--run_dir={root}/run",
        ]  # fmt: skip
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks" / "gpu"), str(REPO)]),
            "TORCHINDUCTOR_CACHE_DIR": f"{root}/inductor",  # empty: the first launch on a machine
        }
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{arm} exited {done.returncode}:\n{done.stderr[-3000:]}")
        compiled = json.loads((Path(root) / "run" / "perf" / "summary.json").read_text())["compile"] or {}
        step_s = json.loads((Path(root) / "span.json").read_text())["step_s"]
        return {"step_s": step_s, "compile_s": compiled.get("seconds"), "graphs": compiled.get("compilations")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for repeat in range(args.repeats):
        order = list(ARMS)[repeat % len(ARMS) :] + list(ARMS)[: repeat % len(ARMS)]
        for arm in order:
            runs[arm].append(_job(arm, args.steps, args.warmup))
            print(f"{arm}, repeat {repeat}: {runs[arm][-1]}", flush=True)
    eager = median([run["step_s"] for run in runs["eager"]])
    rows = []
    for arm, results in runs.items():
        step = median([run["step_s"] for run in results])
        compile_s = [run["compile_s"] for run in results if run["compile_s"] is not None]
        graphs = [run["graphs"] for run in results if run["graphs"] is not None]
        rows.append(
            f"| {arm} | {median(compile_s):.1f} | {median(graphs):.0f} | {step * 1e3:.1f} | {step / eager:.3f} |"
            if compile_s
            else f"| {arm} | - | - | {step * 1e3:.1f} | {step / eager:.3f} |"
        )
    body = (
        f"GPT demo (configs/gpt.yaml: 4 layers, d_model 128), one CPU process, DDP overlay, {args.steps} steps, the "
        f"first {args.warmup} untimed, an empty inductor cache per job, {args.repeats} repeat(s), medians.\n\n"
        "| arm | compile (s) | graphs | step (ms) | step / eager |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    publish("compile", f"cpu-{os.cpu_count()}core", body)


if __name__ == "__main__":
    main()
