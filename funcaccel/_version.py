"""The package version, in a leaf module so that no module imports the package."""

from __future__ import annotations

from typing import Final

__version__: Final = "0.1.0"
