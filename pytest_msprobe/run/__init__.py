"""Running a test: its settings, its run (seed, device, dump, regenerate or compare), the baseline store, the
device and the rank processes of a multi-rank test. Imports no pytest: the pytest layer drives it."""
