"""Whether W&B can start a run here without asking for an API key.

``trackers_from_names(ctx, "all", ...)`` leaves W&B out when it cannot:
``wandb.init`` with no key and no offline mode fails (``No API key configured``)
only after starting its service, seconds into the run and on the main process
alone. The answer is read from the places wandb itself reads, without importing
it or reaching the network:

- the mode: ``WANDB_MODE``, else ``mode`` in the global settings file, is
  ``offline``, ``dryrun`` or ``disabled``;
- a key: ``WANDB_API_KEY`` or ``WANDB_IDENTITY_TOKEN_FILE``; ``api_key`` in the
  global settings file; or the netrc entry ``wandb login`` writes for the W&B
  host (``WANDB_BASE_URL``, else ``base_url`` in the settings file, else
  ``https://api.wandb.ai``), in ``$NETRC``, ``~/.netrc`` or ``~/_netrc``.

The global settings file is ``$WANDB_SETTINGS_SYSTEM``, else
``$WANDB_CONFIG_DIR/settings``, else ``~/.config/wandb/settings``. ``~`` is the
``HOME`` of the mapping given; without one, only the variables count.

>>> wandb_can_start({"WANDB_MODE": "offline"}), wandb_can_start({})
(True, False)
"""

from __future__ import annotations

import configparser
import netrc
from collections.abc import Mapping
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

__all__ = ["wandb_can_start"]

_LOCAL_MODES: Final = ("offline", "dryrun", "disabled")
_DEFAULT_HOST: Final = "https://api.wandb.ai"
_KEYS: Final = ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE")


def wandb_can_start(environ: Mapping[str, str]) -> bool:
    """Return whether ``wandb.init`` finds a key or a local mode in ``environ``."""
    home = environ.get("HOME")
    settings = _settings(environ, home)
    mode = environ.get("WANDB_MODE") or settings.get("mode", "")
    if mode.strip().lower() in _LOCAL_MODES:
        return True
    if any(environ.get(name) for name in _KEYS) or settings.get("api_key"):
        return True
    base_url = (
        environ.get("WANDB_BASE_URL") or settings.get("base_url") or _DEFAULT_HOST
    )
    return _netrc_has(environ, home, urlsplit(base_url).netloc)


def _settings(environ: Mapping[str, str], home: str | None) -> dict[str, str]:
    """The ``[default]`` section of wandb's global settings file, or nothing."""
    if environ.get("WANDB_SETTINGS_SYSTEM"):
        path = Path(environ["WANDB_SETTINGS_SYSTEM"])
    elif environ.get("WANDB_CONFIG_DIR"):
        path = Path(environ["WANDB_CONFIG_DIR"]) / "settings"
    elif home:
        path = Path(home) / ".config" / "wandb" / "settings"
    else:
        return {}
    parser = configparser.ConfigParser()
    try:
        parser.read(path, encoding="utf-8")
    except (configparser.Error, OSError, UnicodeDecodeError):
        return {}  # wandb warns and ignores an unreadable file too
    return dict(parser["default"]) if parser.has_section("default") else {}


def _netrc_has(environ: Mapping[str, str], home: str | None, host: str) -> bool:
    if environ.get("NETRC"):
        candidates = [Path(environ["NETRC"])]
    elif home:
        candidates = [Path(home) / ".netrc", Path(home) / "_netrc"]
    else:
        return False
    path = next((c for c in candidates if c.is_file()), None)
    if path is None or not host:
        return False
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (netrc.NetrcParseError, OSError, UnicodeDecodeError):
        return False
    return entry is not None and bool(entry[2])
