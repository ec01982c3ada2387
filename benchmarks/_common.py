"""Shared benchmark plumbing: environment description, medians, result files (see README.md)."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def hardware() -> str:
    """CPU model and core count (and GPU name when one is present)."""
    model = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import os

    text = f"{model}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            text += f", {torch.cuda.get_device_name()}"
    except ImportError:
        pass
    return text


def versions() -> str:
    """Versions of Python and the libraries the numbers depend on."""
    import deepspeed
    import lightning
    import torch

    import lightning_mlopt

    return (
        f"Python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}, "
        f"deepspeed {deepspeed.__version__}, lightning_mlopt {lightning_mlopt.__version__}"
    )


def median(values: Sequence[float]) -> float:
    """Median of repeats: robust to the one run the OS scheduler disturbed."""
    return statistics.median(values)


def worker_parser(
    description: str | None, repeats: int, steps: int, warmup: int = 10, workers: Sequence[str] | None = None
) -> argparse.ArgumentParser:
    """The arguments every multi-process benchmark takes; ``--worker``/``--out`` are set by ``run_worker``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--worker", choices=workers, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return parser


def run_fresh_job(command: Sequence[str], cwd: Path, what: str, pythonpath: str | None = None, tail: int = 30) -> None:
    """Run one job as from a fresh shell (each launcher chooses its port and threads); raise with its last lines.

    Example::

        run_fresh_job([sys.executable, "-m", "lightning_mlopt", "fit", ...], work, "1f1b m=8")
    """
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    for name in ("MASTER_PORT", "MASTER_ADDR", "OMP_NUM_THREADS"):
        env.pop(name, None)
    done = subprocess.run(list(command), cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        lines = "\n".join((done.stdout + done.stderr).splitlines()[-tail:])
        raise RuntimeError(f"{what} exited {done.returncode}:\n{lines}")


def publish(topic: str, hardware_tag: str, body: str, folder: Path = RESULTS) -> None:
    """Write the dated result file (into ``folder``) and show it."""
    path = write_result(topic, hardware_tag, body, folder)
    print(body)
    print(f"written to {path}")


def write_result(topic: str, hardware_tag: str, body: str, folder: Path = RESULTS) -> Path:
    """Write ``results/<topic>_<hardware>_<yyyymm>.md`` with the environment and the exact command."""
    now = dt.datetime.now(dt.timezone.utc)
    path = folder / f"{topic}_{hardware_tag}_{now:%Y%m}.md"
    folder.mkdir(parents=True, exist_ok=True)
    header = (
        f"# {topic}\n\n"
        f"- Date: {now:%Y-%m-%d %H:%M} UTC\n"
        f"- Hardware: {hardware()}\n"
        f"- Versions: {versions()}\n"
        f"- Command: `python {' '.join(sys.argv)}`\n\n"
    )
    path.write_text(header + body)
    return path


def gpt_step_time(
    strategy: object, callbacks: Sequence[object] = (), steps: int = 60, warmup: int = 10
) -> float | None:
    """Train the GPT demo on 2 CPU processes; rank zero gets the median step time after warm-up, others None.

    Run inside a worker process: Lightning launches the second rank by re-running that command.
    """
    gaps = gpt_step_gaps(strategy, callbacks, steps)
    return None if gaps is None else median([seconds for step, seconds in gaps if step >= warmup])


def gpt_step_gaps(
    strategy: object, callbacks: Sequence[object] = (), steps: int = 60, timer_last: bool = False
) -> list[tuple[int, float]] | None:
    """Like ``gpt_step_time``, but every step's wall time (end to end), with the global step it started at.

    ``timer_last``: the step ends after the callbacks' ``on_train_batch_end`` (theirs counts in its step).
    """
    import os
    import tempfile
    import time

    import lightning.pytorch as pl
    import torch.distributed as dist

    from lightning_mlopt.demos import GPTLanguageModel, TokenDataModule

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[tuple[int, float]] = []
            self.step = 0

        def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
            self.step = trainer.global_step

        def on_train_batch_end(self, *args: object) -> None:
            self.ends.append((self.step, time.perf_counter()))

    pl.seed_everything(0, verbose=False)
    timer = StepTimer()
    # Files callbacks write (PerformanceMonitor's summary) go to a scratch folder, not the current one;
    # the environment carries it to the ranks Lightning starts.
    root = os.environ.get("LIGHTNING_MLOPT_BENCH_ROOT") or tempfile.mkdtemp(prefix="bench_")  # one per job
    os.environ["LIGHTNING_MLOPT_BENCH_ROOT"] = root
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,  # type: ignore[arg-type]
        max_steps=steps,
        default_root_dir=root,
        logger=False,
        # Only a checkpoint callback the caller passes (Lightning's default one would add saves).
        enable_checkpointing=any(isinstance(callback, pl.callbacks.Checkpoint) for callback in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        callbacks=[*callbacks, timer] if timer_last else [timer, *callbacks],  # type: ignore[list-item]
    )
    model = GPTLanguageModel(vocab_size=256, block_size=64, n_layer=4, n_head=4, d_model=128)
    trainer.fit(model, TokenDataModule(num_sequences=steps * 32, batch_size=16))
    # As the CLI does: no rank may exit while another is still inside gloo (its thread would abort it).
    trainer.strategy.barrier()
    dist.destroy_process_group()
    if not trainer.is_global_zero:
        return None
    return [(step, end - previous) for (_, previous), (step, end) in zip(timer.ends, timer.ends[1:], strict=False)]


def run_worker(script: str, mode: str, steps: int, warmup: int, extra: Sequence[str] = ()) -> dict:
    """Run ``script --worker MODE [extra...]`` as a fresh job and return the JSON its rank zero wrote."""
    import json
    import os
    import subprocess

    out = Path(f"/tmp/{Path(script).parent.name}_bench_{os.getpid()}_{mode.replace(':', '-')}.json")
    command = [sys.executable, script, "--worker", mode, "--steps", str(steps), "--warmup", str(warmup), *extra]
    done = subprocess.run(
        [*command, "--out", str(out)], capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}
    )
    if done.returncode != 0:  # say why: a benchmark that fails silently wastes the machine it ran on
        tail = "\n".join(done.stderr.splitlines()[-25:])
        raise RuntimeError(f"worker {mode!r} exited {done.returncode}; its stderr ends:\n{tail}")
    return json.loads(out.read_text())


def interleaved_jobs(script: str, modes: Sequence[str], repeats: int, steps: int, warmup: int) -> dict[str, list[dict]]:
    """Run ``script --worker MODE`` jobs, ``repeats`` per mode, the modes' order alternating between repeats.

    Each job writes ``{"on_s": ..., "off_s": ...}`` (mean step time with and without the thing measured, in
    the same job); progress is printed as the overhead of each job.
    """
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(repeats):
        for mode in modes if repeat % 2 == 0 else list(modes)[::-1]:  # interleaved, so drift hits both
            result = run_worker(script, mode, steps, warmup)
            runs[mode].append(result)
            print(f"every {mode}, repeat {repeat}: {(result['on_s'] / result['off_s'] - 1) * 100:+.2f}%", flush=True)
    return runs


def overhead_table(runs: dict[str, list[dict]], goals: dict[str, float], labels: dict[str, str] | None = None) -> str:
    """``| label | step without | step with | overhead | goal |`` rows (medians over jobs) and the per-job list."""
    lines, details = [], []
    for mode, goal in goals.items():
        overheads = [r["on_s"] / r["off_s"] - 1 for r in runs[mode]]
        overhead = median(overheads)
        lines.append(
            f"| {(labels or {}).get(mode, f'every {mode}')} | {median([r['off_s'] for r in runs[mode]]) * 1e3:.2f} | "
            f"{median([r['on_s'] for r in runs[mode]]) * 1e3:.2f} | "
            f"{overhead * 100:+.2f}% | <= {goal * 100:g}%: {'met' if overhead <= goal else 'NOT met'} |"
        )
        details.append(f"every {mode}: " + ", ".join(f"{o * 100:+.2f}%" for o in overheads))
    return "\n".join(lines) + "\n\nPer job: " + "; ".join(details) + "."
