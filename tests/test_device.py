"""Device selection: CPU and CUDA for real, NPU up to the point where a real Ascend device is needed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from pytest_msprobe.errors import ConfigError
from pytest_msprobe.run.device import describe_device, select_device


def test_cpu_and_auto_without_accelerators() -> None:
    assert select_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert select_device("auto") == torch.device("cpu")
    assert describe_device(torch.device("cpu")).startswith("cpu (")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "auto:0", "tpu"])
def test_unknown_device_names_are_refused_with_the_value(bad: str) -> None:
    with pytest.raises(ConfigError, match=repr(bad).replace("(", r"\(")):
        select_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="cuda"):
        select_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_when_available() -> None:
    assert select_device("cuda").type == "cuda"
    assert "cuda" in describe_device(select_device("cuda"))


def test_npu_without_torch_npu_names_the_package() -> None:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="torch_npu"):
            select_device("npu")
    else:  # pragma: no cover - only on Ascend machines
        assert select_device("npu").type == "npu"


def test_npu_selection_imports_transfer_to_npu(tmp_path) -> None:
    # A stand-in torch_npu package: registers the 'npu' device name as torch_npu does and reports one device.
    # Everything up to launching an NPU kernel is exercised; that last step needs real hardware.
    pkg = tmp_path / "torch_npu"
    (pkg / "contrib").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            """
            import types, torch
            torch.utils.rename_privateuse1_backend("npu")
            torch.npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1,
                                             get_device_name=lambda d=None: "Ascend910B (stand-in)")
            """
        )
    )
    (pkg / "contrib" / "__init__.py").write_text("")
    (pkg / "contrib" / "transfer_to_npu.py").write_text(
        "import torch\ntorch.cuda.transferred_to_npu = True\n"
    )
    code = textwrap.dedent(
        """
        import torch
        from pytest_msprobe.run.device import describe_device, select_device
        d = select_device("auto")
        assert d == torch.device("npu", 0), d
        assert getattr(torch.cuda, "transferred_to_npu", False)
        assert select_device("npu:0") == d
        print(describe_device(d))
        """
    )
    env_path = f"{tmp_path}:{':'.join(p for p in sys.path if p)}"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": env_path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Ascend910B (stand-in)" in out.stdout
