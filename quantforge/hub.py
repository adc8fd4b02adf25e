"""Whether the Hugging Face Hub can be reached, decided once, quickly.

Without this, every Hub call on a machine with no network spends ~25 s in retries before it falls back to the
cache. When the endpoint does not answer a TCP connect within a few seconds, quantforge switches huggingface_hub
and datasets to offline mode for the rest of the process, so cached models and data sets load at once and uncached
ones fail at once with a clear message.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from urllib.parse import urlparse

_TRUE = {"1", "true", "yes", "on"}


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def _set_offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    # Libraries imported before this point read the variable at import time: update their constants too.
    import sys

    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True
        datasets_config.HF_DATASETS_OFFLINE = True


@lru_cache(maxsize=1)
def hub_offline(timeout: float = 3.0) -> bool:
    """True when the user asked for offline mode or the Hub endpoint does not accept a connection."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
        _set_offline()
        return True
    url = urlparse(_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return False
    except OSError:
        _set_offline()
        return True
