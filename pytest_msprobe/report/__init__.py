"""report layer of pytest-msprobe."""
