"""Repository-level pytest configuration (each test folder keeps its own fixtures in its conftest.py)."""

# the plugin's whole-workflow tests drive real pytest runs
pytest_plugins = ["pytester"]
