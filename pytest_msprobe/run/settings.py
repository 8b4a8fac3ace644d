"""The settings and their checks now live in :mod:`pytest_msprobe.settings`, below the options; this name
still reads them for code that imports it from here."""

from __future__ import annotations

from pytest_msprobe.settings import DEFAULT_RANK_TIMEOUT, SessionSettings, TestSettings

__all__ = ["DEFAULT_RANK_TIMEOUT", "SessionSettings", "TestSettings"]
