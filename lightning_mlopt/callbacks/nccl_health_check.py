"""NCCLHealthCheck: pre-flight collective checks, a hang watchdog with stack dumps, stragglers, version skew."""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_mlopt._compat import default_store
from lightning_mlopt._metrics import log_metrics
from lightning_mlopt.callbacks.health_settings import Stragglers, Watchdog, refuse_flat_keys
from lightning_mlopt.callbacks.phase_markers import PhaseMarkers
from lightning_mlopt.distributed.bandwidth import Bandwidth, probe_all_reduce
from lightning_mlopt.distributed.elastic import restart_store_warning
from lightning_mlopt.distributed.fingerprint import collect_fingerprint, fingerprint_mismatches
from lightning_mlopt.distributed.peer_loss import is_peer_loss
from lightning_mlopt.exceptions import HealthCheckError, first_line
from lightning_mlopt.hooks import DescribesOutputs, describe_hang
from lightning_mlopt.process import phase
from lightning_mlopt.process.watchdog import HangWatchdog
from lightning_mlopt.run_dir import HEALTH_DIR
from lightning_mlopt.strategies.contract import contract_of

log = logging.getLogger(__name__)
OnProblem = Literal["warn", "error"]


class NCCLHealthCheck(PhaseMarkers, DescribesOutputs):
    """Checks the collective layer before training, watches for hangs during it, and names stragglers.

    Targets NCCL on GPUs and works the same with gloo on CPU.

    Pre-flight (at setup, every rank): a barrier with a timeout (the error names the ranks that did not arrive, and
    their hosts); an all-reduce of known values, over the world and, for a strategy whose ranks form a 2-D mesh
    (HSDP, FSDP x TP), over each dimension's groups (a failure names the dimension); an environment fingerprint per
    rank (host, torch, CUDA, the NCCL actually loaded, driver, GPU, lightning, deepspeed, lightning_mlopt, Python,
    the NCCL_* and TORCH_NCCL_* variables) compared across ranks; an all-reduce bandwidth probe reported as
    algorithm and bus bandwidth (busbw = algbw x 2(n-1)/n, as nccl-tests). A table at start; the figures go to the
    trainer's logger under ``health/``.

    Hang watchdog: a thread per rank ends the process with ``watchdog.exit_code`` when no step has finished for
    ``watchdog.timeout`` seconds (or, with ``watchdog.adaptive_multiple``, that multiple of the longest step seen
    on any rank, if larger), after writing every thread's stack and the step and phase (data, forward, backward,
    optimizer, checkpoint) to ``<watchdog.dump_dir>/hang-rank<R>.txt``. With CollectiveSequenceCheck on, the
    report's first line says which collective each rank waits in and where the ranks' collectives first
    differ (read through the store, not a collective); the console gets that line and where the stuck thread
    stands, the file every thread's stack. A rank whose collective
    fails because the rank that hung exited first ends the same way once its step has run half the limit. An
    elastic launcher
    (``torchrun --max-restarts``) then restarts the job and FaultTolerantCheckpoint resumes it. On CUDA, the
    NCCL flight recorder is turned on (unless set by the user) so NCCL's own view is dumped on timeout too.

    Stragglers: every ``stragglers.every_n_steps`` steps, each rank's mean forward time (batch start to
    loss; the gradient all-reduce, which makes every rank's backward equally long, is not in it) is gathered
    in one small collective; ranks slower than ``stragglers.factor`` x the median are reported with host.

    Args:
        barrier_timeout: seconds every rank has to reach the pre-flight barrier.
        on_mismatch: ``warn`` or ``error`` when fingerprints differ across ranks.
        probe_mb: size of the bandwidth probe's all-reduce (0 skips the probe).
        probe_iterations: timed all-reduces (after 2 warm-up ones).
        min_busbw_gbps: bus bandwidth below which ``on_slow_bandwidth`` applies; None: no minimum.
        on_slow_bandwidth: ``warn`` or ``error``.
        watchdog: the hang watchdog's limit, exit status and dump folder (:class:`Watchdog`).
        stragglers: how often ranks' forward times are compared, and the threshold (:class:`Stragglers`).

    Raises:
        ValueError: a bad value. TypeError: a flat key of 0.1 (``hang_timeout``, ...), naming the new one.

    Example::

        trainer = Trainer(callbacks=[NCCLHealthCheck(watchdog=Watchdog(timeout=900), min_busbw_gbps=100)])

    """

    def __init__(
        self,
        barrier_timeout: float = 120.0,
        on_mismatch: OnProblem = "warn",
        probe_mb: float = 16.0,
        probe_iterations: int = 5,
        min_busbw_gbps: float | None = None,
        on_slow_bandwidth: OnProblem = "warn",
        watchdog: Watchdog = Watchdog(),
        stragglers: Stragglers = Stragglers(),
        **renamed: Any,
    ) -> None:
        refuse_flat_keys(renamed)
        if barrier_timeout <= 0:
            raise ValueError(f"barrier_timeout must be > 0, got {barrier_timeout}")
        if probe_mb < 0 or probe_iterations < 1:
            raise ValueError(f"probe_mb must be >= 0 and probe_iterations >= 1, got {probe_mb}, {probe_iterations}")
        for name, choice in (("on_mismatch", on_mismatch), ("on_slow_bandwidth", on_slow_bandwidth)):
            if choice not in ("warn", "error"):
                raise ValueError(f"{name} must be warn or error, got {choice!r}")
        self.barrier_timeout = barrier_timeout
        self.on_mismatch = on_mismatch
        self.probe_mb = probe_mb
        self.probe_iterations = probe_iterations
        self.min_busbw_gbps = min_busbw_gbps
        self.on_slow_bandwidth = on_slow_bandwidth
        self.watchdog = watchdog
        self.stragglers = stragglers
        self.hosts: list[str] = []
        self.bandwidth: Bandwidth | None = None
        self.mismatches: list[str] = []
        self.mesh_dimensions: dict[str, int] = {}  # each checked mesh dimension's size (a 2-D mesh only)
        self.straggling_ranks: list[int] = []
        self._watchdog: HangWatchdog | None = None
        self._longest_step = 0.0  # agreed across ranks at each straggler check
        self._local_longest = 0.0
        self._forward_times: list[float] = []
        self._batch_started = 0.0
        self._step_started = 0.0
        if torch.cuda.is_available():
            # The flight recorder must be on before NCCL communicators exist, i.e. before fit: here.
            os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")

    def dump_folder(self, trainer: pl.Trainer) -> Path:
        """Where hang dumps go: ``watchdog.dump_dir``, or ``<trainer.default_root_dir>/health``."""
        return Path(self.watchdog.dump_dir or os.path.join(trainer.default_root_dir, HEALTH_DIR))

    def describe_outputs(self, trainer: pl.Trainer) -> list[str]:
        """Where hang dumps go (the CLI's start-up lines)."""
        return [f"hang dumps   {self.dump_folder(trainer)}"]

    # ------------------------------------------------------------------ pre-flight

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        phase.set_phase("setup", trainer.global_step)
        store_warning = restart_store_warning()
        if store_warning:
            rank_zero_warn(store_warning)
        if dist.is_available() and dist.is_initialized():
            self._preflight(trainer)
        if self.watchdog.timeout is not None:
            folder, exit_code = self.dump_folder(trainer), self.watchdog.exit_code
            self._watchdog = HangWatchdog(
                self._current_timeout,
                folder,
                trainer.global_rank,
                exit_code,
                describe=lambda: describe_hang(trainer),
            )
            self._watchdog.start()

    def _preflight(self, trainer: pl.Trainer) -> None:
        start = time.perf_counter()
        rank, world = dist.get_rank(), dist.get_world_size()
        device = trainer.strategy.root_device
        # A gloo group for the barrier: NCCL has no monitored barrier. On CPU the default group is gloo.
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self._barrier(rank, world, group)
        self._check_all_reduce(device)
        # Each dimension of a 2-D mesh has communicators of its own (FSDP x TP: one per tensor-parallel group,
        # within a node, and one per data-parallel group, across nodes): a bad one shows here, named.
        mesh = contract_of(trainer.strategy).process_mesh
        if mesh is not None and mesh.ndim > 1 and mesh.mesh_dim_names:
            for dim, name in enumerate(mesh.mesh_dim_names):
                if mesh.size(dim) > 1:
                    self._check_all_reduce(device, mesh.get_group(name), name)
                self.mesh_dimensions[name] = mesh.size(dim)
        fingerprints: list[Any] = [None] * world
        dist.all_gather_object(fingerprints, collect_fingerprint())
        self.hosts = [fp["host"] for fp in fingerprints]
        self.mismatches = fingerprint_mismatches(fingerprints)
        if self.probe_mb > 0:
            self.bandwidth = probe_all_reduce(int(self.probe_mb * 2**20), device, iterations=self.probe_iterations)
        seconds = time.perf_counter() - start
        self._report(trainer, world, fingerprints[0], seconds)

    def _barrier(self, rank: int, world: int, group: Any) -> None:
        store = _default_store()
        if store is not None:
            store.set(f"mlopt/health/host/{rank}", socket.gethostname())
        try:
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=self.barrier_timeout), wait_all_ranks=True)
        except RuntimeError as error:
            missing = _missing_ranks(str(error), world, rank)
            where = ", ".join(f"rank {r} ({_host_of(store, r)})" for r in missing) or str(error)
            raise HealthCheckError(
                f"pre-flight barrier: not every rank arrived within {self.barrier_timeout:g} s. Missing: {where}. "
                "Check those hosts (a stuck data loader, a crashed process, a bad node) before relaunching."
            ) from error

    @staticmethod
    def _check_all_reduce(device: torch.device, group: Any = None, dimension: str | None = None) -> None:
        """Sum each rank's ``rank + 1`` over ``group`` (the world, or one mesh dimension's group) and check it."""
        values = torch.full((4,), float(dist.get_rank() + 1), device=device)
        dist.all_reduce(values, group=group)
        expected = float(sum(rank + 1 for rank in dist.get_process_group_ranks(group or dist.group.WORLD)))
        if not torch.allclose(values.cpu(), torch.full((4,), expected)):
            over = f" over the mesh's {dimension!r} dimension" if dimension else ""
            raise HealthCheckError(
                f"pre-flight all-reduce{over} returned {values.tolist()} instead of {expected} on rank "
                f"{dist.get_rank()}: the collective library is giving wrong answers (mixed NCCL versions? a "
                "faulty link?)"
            )

    def _report(self, trainer: pl.Trainer, world: int, fingerprint: dict[str, str], seconds: float) -> None:
        rows = [
            f"NCCLHealthCheck pre-flight ({seconds:.2f} s): {world} ranks on {len(set(self.hosts))} host(s)",
            f"  barrier and all-reduce      ok (backend {dist.get_backend()})",
            *(
                [
                    "  all-reduce per mesh dimension ok: "
                    + ", ".join(f"{n} ({s})" for n, s in self.mesh_dimensions.items())
                ]
                if self.mesh_dimensions
                else []
            ),
            f"  torch {fingerprint['torch']}, CUDA {fingerprint['cuda']}, NCCL {fingerprint['nccl']}, "
            f"GPU {fingerprint['gpu']}, driver {fingerprint['driver']}",
        ]
        if self.bandwidth is not None:
            bw = self.bandwidth
            rows.append(
                f"  all-reduce {bw.size_bytes / 2**20:.0f} MiB: {bw.seconds * 1e3:.2f} ms, "
                f"algbw {bw.algbw_gbps:.2f} GB/s, busbw {bw.busbw_gbps:.2f} GB/s"
            )
        rows.append("  fingerprints identical on every rank" if not self.mismatches else "  fingerprint MISMATCH:")
        rows += [f"    {line}" for line in self.mismatches]
        rank_zero_info("\n".join(rows))
        metrics = {"health/preflight_seconds": seconds, "health/fingerprint_mismatches": float(len(self.mismatches))}
        if self.bandwidth is not None:
            metrics.update(
                {"health/algbw_gbps": self.bandwidth.algbw_gbps, "health/busbw_gbps": self.bandwidth.busbw_gbps}
            )
        log_metrics(trainer, metrics)
        if self.mismatches:
            message = "environment differs across ranks:\n" + "\n".join(self.mismatches)
            if self.on_mismatch == "error":
                raise HealthCheckError(message)
            rank_zero_warn(f"NCCLHealthCheck: {message}")
        bandwidth, minimum = self.bandwidth, self.min_busbw_gbps
        if bandwidth is not None and minimum is not None and bandwidth.busbw_gbps < minimum:
            message = (
                f"all-reduce bus bandwidth {bandwidth.busbw_gbps:.2f} GB/s is below the minimum {minimum:g} GB/s "
                f"(hosts: {', '.join(sorted(set(self.hosts)))})"
            )
            if self.on_slow_bandwidth == "error":
                raise HealthCheckError(message)
            rank_zero_warn(f"NCCLHealthCheck: {message}")

    # ------------------------------------------------------------------ during training

    def _current_timeout(self) -> float:
        timeout, multiple = self.watchdog.timeout, self.watchdog.adaptive_multiple
        assert timeout is not None
        return timeout if multiple is None else max(timeout, multiple * self._longest_step)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        super().on_train_batch_start(trainer, pl_module, *args)
        self._batch_started = time.perf_counter()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        # Forward compute only: DDP's all-reduce overlaps backward and makes it equally long on every rank.
        # (On CUDA the host clock measures launch, not kernels, unless the step syncs; the loss usually does.)
        self._forward_times.append(time.perf_counter() - self._batch_started)
        super().on_before_backward(trainer, pl_module, loss)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        now = time.perf_counter()
        if self._step_started:
            self._local_longest = max(self._local_longest, now - self._step_started)
        self._step_started = now
        if self._watchdog is not None:
            self._watchdog.beat()
        every = self.stragglers.every_n_steps
        if every is not None and trainer.global_step % every == 0 and self._forward_times:
            self._check_stragglers(trainer)
        super().on_train_batch_end(trainer, pl_module, *args)  # the data wait starts after the check above

    def _check_stragglers(self, trainer: pl.Trainer) -> None:
        world = trainer.world_size
        slots = torch.zeros(2 * world, device=trainer.strategy.root_device)
        slots[trainer.global_rank] = statistics.fmean(self._forward_times)
        slots[world + trainer.global_rank] = self._local_longest
        self._forward_times.clear()
        if world > 1:
            dist.all_reduce(slots)  # every rank, every N steps: one small collective
        values = slots.tolist()
        times, longest = values[:world], values[world:]
        self._longest_step = max(longest)
        median = statistics.median(times)
        self.straggling_ranks = [r for r, t in enumerate(times) if median > 0 and t > self.stragglers.factor * median]
        if self.straggling_ranks:
            hosts = self.hosts or ["?"] * world
            detail = ", ".join(f"rank {r} ({hosts[r]}) {times[r] / median:.1f}x" for r in self.straggling_ranks)
            rank_zero_warn(
                f"NCCLHealthCheck: straggler(s) at step {trainer.global_step}: {detail} the median forward time "
                f"({median * 1e3:.1f} ms)"
            )
        log_metrics(trainer, {"health/forward_ms_median": median * 1e3, "health/forward_ms_max": max(times) * 1e3})

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._watchdog is None:
            return
        try:
            if is_peer_loss(exception):
                # The rank that hung exited first (its watchdog fired) and this one's collective failed a moment
                # before its own watchdog would have: end the same way, as a hang, dump and status, not status 1.
                left = first_line(exception, 200)
                self._watchdog.exit_if_stuck(f"a collective failed because a peer left ({left})")
        except Exception as error:  # an exit path: a dump that cannot be written must not hide the exception
            rank_zero_warn(f"NCCLHealthCheck: could not write the hang dump: {error!r}")
        finally:
            self._watchdog.stop()
            self._watchdog = None


def _default_store() -> Any:
    return default_store()


def _host_of(store: Any, rank: int) -> str:
    key = f"mlopt/health/host/{rank}"
    try:
        if store is not None and store.check([key]):
            return store.get(key).decode()
    except RuntimeError:
        pass
    return "host unknown: it never checked in"


def _missing_ranks(message: str, world: int, rank: int) -> list[int]:
    """Ranks named in a monitored_barrier error ("Ranks 1, 3 failed to pass monitoredBarrier")."""
    import re

    match = re.search(r"Ranks? ([\d, ]+) failed to pass", message)
    if match:
        return [int(r) for r in re.findall(r"\d+", match.group(1))]
    return [] if rank == 0 else [0]
