"""The keys of 0.1 that 0.2 grouped, for the parser's messages: each old key named with its new one.

Example::

    >>> RENAMED.keys["checkpoint.keep_last"], RENAMED.arguments["MLflowTracker"]["flush_timeout_s"]
    ('checkpoint.keep.last', 'delivery.flush_timeout_s')
"""

from __future__ import annotations

from lightning_mlopt.callbacks.health_settings import RENAMED_KEYS as HEALTH_RENAMED_KEYS
from lightning_mlopt.checkpoint.settings import RENAMED_KEYS
from lightning_mlopt.cli.bad_input import Renamed
from lightning_mlopt.tracking.mlflow_settings import RENAMED_KEYS as MLFLOW_RENAMED_KEYS

RENAMED = Renamed(
    keys={f"checkpoint.{old}": f"checkpoint.{new}" for old, new in RENAMED_KEYS.items()},
    arguments={
        "FaultTolerantCheckpoint": RENAMED_KEYS,
        "NCCLHealthCheck": HEALTH_RENAMED_KEYS,
        "MLflowTracker": MLFLOW_RENAMED_KEYS,
    },
)
