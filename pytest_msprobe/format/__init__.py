"""msprobe's on-disk format, shared by the dump, the compare and the baseline store.

Record names (built and parsed), the folder layout and its discovery, JSON files and atomic writes, tensor
files. Imports nothing of the package but its errors, and neither torch nor pytest.
"""
