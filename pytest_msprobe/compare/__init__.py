"""compare layer of pytest-msprobe."""
