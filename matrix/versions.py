"""Installed package versions, read from the installed distributions' metadata."""

from __future__ import annotations

import importlib.metadata


def installed_versions(packages) -> dict[str, str | None]:
    """name -> version, None where the package is not installed."""
    found = {}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found
