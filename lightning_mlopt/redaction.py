"""Keep secrets out of everything we write or send: logs, fingerprints, checkpoints, the W&B config.

A secret is the value of an environment variable whose name says it holds one (``*_API_KEY``,
``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ...), and the credentials part of a URL
(``https://user:token@host``). :func:`redact` replaces both, wherever they appear in a nested structure.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|PASSPHRASE|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE", re.IGNORECASE)
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s:]+(:[^/@\s]*)?@", re.IGNORECASE)
# Shorter values ("1", "true") would redact ordinary text everywhere they occur.
_MIN_SECRET_LENGTH = 6


def is_secret_name(name: str) -> bool:
    """Whether a variable or key name says it holds a secret.

    Example::

        >>> is_secret_name("WANDB_API_KEY"), is_secret_name("NCCL_DEBUG")
        (True, False)
    """
    return bool(_SECRET_NAME.search(name))


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of the environment's secret-named variables, longest first."""
    environ = os.environ if environ is None else environ
    values = {value for name, value in environ.items() if is_secret_name(name) and len(value) >= _MIN_SECRET_LENGTH}
    return sorted(values, key=len, reverse=True)


def redact(value: Any, secrets: list[str] | None = None) -> Any:
    """A copy of ``value`` with secrets replaced by ``<redacted>``.

    Replaced: the values of secret-named keys, URL credentials, any occurrence of a secret environment value.

    Example::

        >>> redact({"url": "https://me:tok@github.com/x.git", "api_key": "abc", "lr": 0.1}, secrets=[])
        {'url': 'https://<redacted>@github.com/x.git', 'api_key': '<redacted>', 'lr': 0.1}
    """
    secrets = secret_values() if secrets is None else secrets
    if isinstance(value, Mapping):
        return {
            key: REDACTED if isinstance(key, str) and is_secret_name(key) and item else redact(item, secrets)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(redact(item, secrets) for item in value)
    if isinstance(value, str):
        text = _URL_CREDENTIALS.sub(lambda match: f"{match['scheme']}{REDACTED}@", value)
        for secret in secrets:
            text = text.replace(secret, REDACTED)
        return text
    return value
