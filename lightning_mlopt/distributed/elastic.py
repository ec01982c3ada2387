"""torchrun restarts and the shared rendezvous store: what goes wrong, and the setting that avoids it.

By default torchrun's workers create their process group in the agent's rendezvous TCPStore, shared by
every restart of the job, with nothing that isolates one attempt's keys from the next. A restarted worker
can then read the gloo addresses or NCCL unique id of the attempt that died, and connect to a dead port or
wait forever (pytorch/pytorch#135712; seen here as restarted workers stuck in ``init_process_group``).
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, set for the torchrun command, gives each attempt a store of its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# Environment for a torchrun command whose workers may be restarted (--max-restarts > 0).
RESTART_SAFE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def restart_store_warning(environ: Mapping[str, str] | None = None) -> str | None:
    """A warning when this worker's torchrun may restart it on the shared rendezvous store, else None.

    Example::

        >>> restart_store_warning({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"})[:29]
        'torchrun may restart this job'
    """
    environ = os.environ if environ is None else environ
    shared = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if not shared or not restarts.isdigit() or int(restarts) == 0:
        return None
    return (
        "torchrun may restart this job (--max-restarts) but its workers share the rendezvous store across "
        "restarts, so a restarted worker can read the dead attempt's addresses and hang in init_process_group "
        "(pytorch/pytorch#135712). Launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set for torchrun."
    )
