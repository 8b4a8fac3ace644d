"""torch's numeric switches as the checklist reads them and as the msprobe fixture switches them off and back:
the legacy TF32 switches and torch's fp32_precision names, which torch refuses to mix on reading."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pytest_msprobe.dump import switches
from pytest_msprobe.format.numerics import (
    CUDA_MATMUL_PRECISION,
    CUDNN_TF32,
    MATMUL_PRECISION,
    TF32,
    policy_from_switches,
)

NAMES = hasattr(torch.backends.cuda.matmul, "fp32_precision")  # torch >= 2.9
needs_names = pytest.mark.skipif(not NAMES, reason="this torch has no fp32_precision names")


@pytest.fixture(autouse=True)
def defaults() -> Iterator[None]:
    """Each test starts from torch's defaults and leaves them (through the legacy switches, which torch reads
    back whatever was set before)."""

    def reset() -> None:
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("highest")
        if NAMES:
            torch.backends.mkldnn.conv.fp32_precision = "none"

    reset()
    yield
    reset()
    assert torch.backends.cuda.matmul.allow_tf32 is False  # readable again


def test_strict_float32_switches_tf32_off_and_puts_every_switch_back() -> None:
    torch.set_float32_matmul_precision("high")
    restore = switches.strict_float32()
    assert torch.backends.cudnn.allow_tf32 is False
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.get_float32_matmul_precision() == "highest"
    restore()
    assert torch.backends.cudnn.allow_tf32 is True
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.allow_tf32 is True


def test_a_medium_matmul_precision_comes_back_medium() -> None:
    # allow_tf32 follows the precision: setting it after the precision turned "medium" into another state
    torch.set_float32_matmul_precision("medium")
    switches.strict_float32()()
    assert torch.get_float32_matmul_precision() == "medium"


@needs_names
def test_switches_set_through_fp32_precision_names_are_read_and_put_back() -> None:
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # torch now refuses to read allow_tf32
    found = switches.switches()
    assert found["cuda.matmul.allow_tf32"] is None and found["float32_matmul_precision"] is None
    assert found["cuda.matmul.fp32_precision"] == "tf32"
    policy = policy_from_switches("cuda", found)
    assert (policy.matmul, policy.matmul_setting) == (TF32, (CUDA_MATMUL_PRECISION, "tf32"))
    restore = switches.strict_float32()
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
    assert switches.switches()["cuda.matmul.fp32_precision"] != "tf32"
    restore()
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"


@needs_names
def test_a_reduced_onednn_convolution_is_switched_off_and_back() -> None:
    torch.backends.mkldnn.conv.fp32_precision = "bf16"
    assert policy_from_switches("cpu", switches.switches()).conv == "bfloat16"
    restore = switches.strict_float32()
    assert policy_from_switches("cpu", switches.switches()).conv == "float32"
    restore()
    assert torch.backends.mkldnn.conv.fp32_precision == "bf16"


def test_the_policy_of_legacy_switches_names_the_switch_that_chose_it() -> None:
    cuda = {"cudnn.allow_tf32": True, "cuda.matmul.allow_tf32": False, "float32_matmul_precision": "high"}
    policy = policy_from_switches("cuda:0 (NVIDIA H200)", cuda)
    assert policy.conv_setting == (CUDNN_TF32, "True")
    assert policy.matmul_setting == (MATMUL_PRECISION, "high")
    # the same switches on a CPU change nothing
    assert not policy_from_switches("cpu", cuda).reduced
