"""Repository-level pytest configuration (the test suite's fixtures live in tests/conftest.py)."""
