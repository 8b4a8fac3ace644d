"""The plugin's version, in a module of its own: the manifest, the session summary and the CLI record it, and
they sit below the package's public face (``pytest_msprobe.__version__`` hands it on)."""

from __future__ import annotations

__version__ = "0.1.0"  # as pyproject.toml's
