"""The torch functions the dump's own computations call, bound once to their C implementations.

While a step is captured the API wrappers stand in ``torch.*`` and ``Tensor.*``: statistics, copies and sums
taken through these never reach them, so they never show in the dump, and each call skips the wrappers' lookup.
Names are torch's (``abs`` and ``sum`` shadow the builtins in this module only); importers bind them under a
leading underscore.
"""

from __future__ import annotations

from typing import Any

import torch

_VF: Any = torch._C._VariableFunctions
_TB: Any = torch._C.TensorBase

abs = _VF.abs
add = _VF.add
amax = _VF.amax
amin = _VF.amin
aminmax = _VF.aminmax
as_tensor = _VF.as_tensor
cat = _VF.cat
clone = _VF.clone
div = _VF.div
empty = _VF.empty
narrow = _VF.narrow
stack = _VF.stack
sum = _VF.sum
unbind = _VF.unbind
view_as_real = _VF.view_as_real
zeros = _VF.zeros
vector_norm = torch._C._linalg.linalg_vector_norm  # type: ignore[attr-defined]

# Tensor methods, called as functions of the tensor
contiguous = _TB.contiguous
copy = _TB.copy_
detach = _TB.detach
reshape = _TB.reshape
to = _TB.to
view = _TB.view
