"""System metrics of the node a run is on (CPU, memory, GPUs where present), sampled from a daemon thread.

The names are MLflow's own (``cpu_utilization_percentage``, ``system_memory_usage_megabytes``,
``gpu_0_utilization_percentage``, ...), under ``system/<node>/`` as MLflow's ``node_id`` puts them, so a
requeued run that lands on another node shows both nodes apart. Sampling costs one ``psutil`` call and,
with GPUs, one NVML query per device: nothing on the training thread.

Example::

    sampler = SystemMetricsSampler(every_s=10.0, on_sample=lambda values: print(values))
    sampler.start()
    ...
    sampler.stop()
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

_FIRST_SAMPLE_S = 1.0


def node_name() -> str:
    """The short host name of this node, as it appears in the metric names."""
    return socket.gethostname().split(".")[0] or "node"


def sample_system() -> dict[str, float]:
    """One sample of this node: CPU and memory use, and per GPU its memory and (with NVML) its utilization."""
    import psutil

    memory = psutil.virtual_memory()
    values = {
        "cpu_utilization_percentage": float(psutil.cpu_percent(interval=None)),  # since the previous call
        "system_memory_usage_megabytes": (memory.total - memory.available) / 1e6,
        "system_memory_usage_percentage": float(memory.percent),
    }
    values.update(_gpu_sample())
    return values


def _gpu_sample() -> dict[str, float]:
    import torch

    if not torch.cuda.is_available():
        return {}
    values = {}
    for index in range(torch.cuda.device_count()):
        with contextlib.suppress(RuntimeError):  # a device this process may not use
            free, total = torch.cuda.mem_get_info(index)
            values[f"gpu_{index}_memory_usage_megabytes"] = (total - free) / 1e6
            values[f"gpu_{index}_memory_usage_percentage"] = 100.0 * (total - free) / total
        with contextlib.suppress(Exception):  # utilization needs NVML (nvidia-ml-py), which may be absent
            values[f"gpu_{index}_utilization_percentage"] = float(torch.cuda.utilization(index))
    return values


class SystemMetricsSampler:
    """Calls ``on_sample`` with :func:`sample_system`'s values every ``every_s`` seconds, from a daemon thread.

    Args:
        every_s: seconds between samples.
        on_sample: what to do with each sample (the tracker appends it to its outbox).

    """

    def __init__(self, every_s: float, on_sample: Callable[[dict[str, float]], None]) -> None:
        self.every_s = every_s
        self.on_sample = on_sample
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mlopt-system-metrics", daemon=True)

    def start(self) -> None:
        """Start sampling: the first sample a second from now (CPU use is measured since), then every ``every_s``."""
        sample_system()  # primes psutil's CPU counter
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        pause = min(self.every_s, _FIRST_SAMPLE_S)  # a short launch gets its sample too
        while not self._stopping.wait(pause):
            with contextlib.suppress(Exception):  # a failed sample is a gap in a chart, never a failed run
                self.on_sample(sample_system())
            pause = self.every_s
