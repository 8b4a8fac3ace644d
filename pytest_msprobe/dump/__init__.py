"""dump layer of pytest-msprobe."""
