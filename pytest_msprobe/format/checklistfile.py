"""The training checklist of a dumped step, recorded beside msprobe's files: ``checklist.json`` in the folder
of its dump.json.

msprobe's own files stay as msprobe writes them; this sidecar holds what its guide checks before any operator is
suspected, as it was at the start of the step (the optimizer's settings as its first ``step()`` saw them)::

    {"format": "pytest-msprobe checklist", "version": 1, "step": 0, "rank": 0, "device": "cuda",
     "seed": 1234,
     "environment": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVIDIA_TF32_OVERRIDE": null, ...},
     "versions": {"python": "3.11.9", "torch": "2.4.0", "cuda": "12.1", ...},
     "switches": {"deterministic_algorithms": true, "cudnn.allow_tf32": true, ...},
     "structure": {"modules": [["", "Net"], ["c1", "Conv2d"], ...],
                   "parameters": {"c1.weight": [[8, 3, 3, 3], "float32"], ...}, "buffers": {...}},
     "optimizers": [{"class": "SGD", "groups": [{"lr": 0.01, "momentum": 0.9, ...}]}],
     "parameters": {"c1.weight": {"shape": [8, 3, 3, 3], "dtype": "float32", "crc32": "8d0f3a12",
                                  "min": -0.19, "max": 0.19, "mean": 0.002, "norm": 1.6}, ...},
     "buffers": {...},
     "data": {"source": "the model's forward", "tensors": {"args.0": {...a fingerprint...}}},
     "precision": {"device": "cuda", "conv": "tf32", "matmul": "float32", "autocast": null,
                   "conv_setting": ["torch.backends.cudnn.allow_tf32", "True"], "matmul_setting": null}}

A fingerprint is exact (the CRC32 of the tensor's bytes) plus statistics; non-finite statistics are written as the
strings ``"nan"``, ``"inf"`` and ``"-inf"`` (JSON has no such numbers). This module reads and writes the file and
checks its shape; it knows nothing of torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.files import read_sidecar, write_text

CHECKLIST_JSON = "checklist.json"
FORMAT = "pytest-msprobe checklist"
VERSION = 1
# when the weights were fingerprinted (``taken``): at the step's start, or, when the model was found only through
# its optimizer, at that optimizer's first step (the weights as the step started, the buffers as its forward
# left them)
TAKEN_AT_START, TAKEN_AT_OPTIMIZER = "the step's start", "the first optimizer step"
_SECTIONS = ("environment", "versions", "switches", "structure", "parameters", "buffers", "data", "precision")


def checklist_path(dump_json: Path) -> Path:
    """The checklist beside a dump.json (or in a rank folder)."""
    folder = dump_json if dump_json.is_dir() else dump_json.parent
    return folder / CHECKLIST_JSON


def encode_number(x: float) -> float | str:
    """A float as JSON can hold it: NaN and the infinities as strings."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def decode_number(x: Any) -> float | None:
    """A number read back (``"nan"``, ``"inf"``, ``"-inf"`` included); None for anything else."""
    if isinstance(x, bool):
        return float(x)
    if isinstance(x, (int, float)):
        return float(x)
    if x in ("nan", "inf", "-inf"):
        return float(x)
    return None


def write_checklist(folder: Path, doc: Mapping[str, Any]) -> Path:
    """Write ``folder/checklist.json`` atomically (a reader never sees a partial file)."""
    path = folder / CHECKLIST_JSON
    body = {"format": FORMAT, "version": VERSION, **doc}
    write_text(path, _render(body))
    return path


# the C encoder (json.dumps with indent takes the pure-Python one, ten times slower on a model's fingerprints)
_encode = json.JSONEncoder(allow_nan=False, check_circular=False).encode


def _render(body: Mapping[str, Any]) -> str:
    """The document as JSON, one line per entry of each section (a parameter's fingerprint on one line)."""
    lines = []
    for key, value in body.items():
        if isinstance(value, dict) and value:
            inner = ",\n".join(f"  {_encode(k)}: {_encode(v)}" for k, v in value.items())
            lines.append(f" {_encode(key)}: {{\n{inner}\n }}")
        else:
            lines.append(f" {_encode(key)}: {_encode(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def read_checklist(folder: Path) -> dict[str, Any] | None:
    """The checklist of a rank folder (or of the folder of a dump.json), None when it has none (a plain msprobe
    dump, or one made without a checklist). A file that is there but broken raises DumpFormatError naming it."""
    path = checklist_path(folder)
    doc = read_sidecar(path, FORMAT, "checklist", VERSION)
    if doc is None:
        return None
    for section in _SECTIONS:
        if section in doc and not isinstance(doc[section], dict):
            raise DumpFormatError(path, f"{section!r} must be an object, got {type(doc[section]).__name__}")
    if "optimizers" in doc and not isinstance(doc["optimizers"], list):
        raise DumpFormatError(path, "'optimizers' must be a list")
    return doc
