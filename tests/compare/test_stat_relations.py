"""Relations between a call's statistics (a statistics dump's own error) and the first divergence they place."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from model_dumps import dump_model, perturb  # noqa: E402

from pytest_msprobe.compare import compare  # noqa: E402
from pytest_msprobe.compare.dumps.reader import flatten_entry  # noqa: E402
from pytest_msprobe.compare.judging.stat_relations import broken, floor, residuals  # noqa: E402
from pytest_msprobe.report.advisor import advisor_text  # noqa: E402


def _calls(step_dir: Path) -> dict[str, list[Any]]:
    data = json.loads(next(step_dir.rglob("dump.json")).read_text())["data"]
    return {name: flatten_entry(name, body) for name, body in data.items()}


def _dump_ops(path: Path, fn: Any) -> Path:
    from pytest_msprobe import PrecisionDebugger

    debugger = PrecisionDebugger(task="statistics", dump_path=str(path), level="L1", step=[0])
    debugger.start()
    fn()
    debugger.stop()
    debugger.step()
    debugger.close()
    return path / "step0"


def test_real_calls_keep_their_relations(tmp_path: Path) -> None:
    """Each relation holds for torch's own calls on CPU (float32, values of any sign and size), to rounding."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 8, 6, 6, generator=g) * 3
    y = torch.randn(4, 8, 6, 6, generator=g)

    def ops() -> None:
        F.relu(x)
        torch.sigmoid(x)
        torch.tanh(x)
        F.gelu(x)
        F.silu(x)
        x.view(4, -1)
        x.transpose(1, 2).contiguous()
        x * 0.5
        x / -4.0
        x + 2.5
        torch.add(x, y, alpha=-0.05)
        x.clone().add_(y, alpha=0.3)
        x.clone().lerp_(y, 0.1)
        x.clone().mul_(0.9)
        F.softmax(x, dim=-1)
        F.max_pool2d(x, 2)
        F.avg_pool2d(x, 2)
        F.adaptive_avg_pool2d(x, 1)

    calls = _calls(_dump_ops(tmp_path / "d", ops))
    checked = set()
    for name, leaves in calls.items():
        found = residuals(name, leaves)
        for r in found:
            assert r.scaled < floor("torch.float32") / 10, (name, r)
        if found:
            checked.add(name.split(".")[1])
        assert broken(name, leaves, leaves, "torch.float32") is None
    want = {"relu", "sigmoid", "tanh", "gelu", "silu", "view", "contiguous", "__mul__", "__truediv__"}
    want |= {
        "__add__",
        "add",
        "add_",
        "lerp_",
        "mul_",
        "softmax",
        "max_pool2d",
        "avg_pool2d",
        "adaptive_avg_pool2d",
    }
    assert want <= checked, want - checked


def test_a_noisy_relu_breaks_its_relation_and_a_clean_one_does_not(tmp_path: Path) -> None:
    import torch.nn.functional as F

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    name = "Functional.relu.0.forward"
    clean = _calls(_dump_ops(tmp_path / "c", lambda: F.relu(x)))[name]
    # the statistics of a relu whose output carries 1e-3 noise: its Max moved off its input's
    noisy = [leaf._replace(max=leaf.max * (1 + 1e-3)) if leaf.role == "output" else leaf for leaf in clean]
    hit = broken(name, noisy, clean, "torch.float32")
    assert hit is not None and hit.relation == "Max = relu(input's Max)"
    assert hit.target.scaled == pytest.approx(1e-3 * clean[-1].max / abs(clean[0].min), rel=1e-6)
    assert "on the baseline" in hit.reason and broken(name, clean, clean, "torch.float32") is None
    # a relation the baseline breaks as much excuses the target; a bfloat16 output's rounding is no break
    assert broken(name, noisy, noisy, "torch.float32") is None
    assert broken(name, noisy, clean, "torch.bfloat16") is None


def test_unusable_statistics_give_no_relation(tmp_path: Path) -> None:
    calls = _calls(_dump_ops(tmp_path / "d", lambda: torch.relu(torch.tensor([float("nan"), 1.0]))))
    assert all(residuals(n, leaves) == [] for n, leaves in calls.items())
    assert residuals("Functional.conv2d.0.forward", next(iter(calls.values()))) == []  # no relation known
    assert residuals("Functional.relu.0.backward", next(iter(calls.values()))) == []


@pytest.mark.parametrize(
    "api, call, rule", [("softmax", 0, "inconsistent"), ("gelu", 0, "enters"), ("softmax", 1, "enters")]
)
def test_a_fault_from_step_0_is_named_at_a_later_step_of_a_statistics_dump(
    tmp_path: Path, api: str, call: int, rule: str
) -> None:
    """At step 2 the weights already differ, so the first softmax's inputs do: it is the call whose statistics
    break a relation (rule "inconsistent"), not the first to amplify what flows in. Where the faulty call's
    inputs still match, "enters" names it first."""
    options: dict[str, Any] = {"model": "transformer", "task": "statistics", "steps": 3}
    baseline = dump_model(tmp_path / "clean", **options)
    faulty = dump_model(tmp_path / "faulty", variant=lambda: perturb(api, call, 1e-3), **options)
    result = compare(faulty / "step2", baseline / "step2", jobs=1)
    fd = result.first_divergence
    assert not result.passed and fd is not None
    assert (fd.api, fd.rule) == (f"Functional.{api}.{call}.forward", rule), fd.reason
    if rule == "inconsistent":
        assert result.apis[fd.api_index].input_breach  # (errors flow into it)
        assert "break a relation that holds whatever its inputs" in fd.reason
        assert "Errors that flowed in cannot explain a broken relation" in advisor_text(result)


@pytest.mark.parametrize("version", ["8.3.3", "26.2.0"])
def test_real_msprobe_statistics_keep_their_relations_but_the_faulty_relu(version: str) -> None:
    """msprobe's own statistics (float32 on the device) keep every relation to rounding on the bench side; on
    the NPU side, whose relu.2 is 1e-3 noisy, that relu is the only call that breaks one."""
    from compare_helpers import dump_dir

    broken_calls = set()
    checked = 0
    for side in ("bench", "npu"):
        for dump in sorted(dump_dir(version, side, "stat_L1").rglob("dump.json")):
            for name, body in json.loads(dump.read_text())["data"].items():
                for r in residuals(name, flatten_entry(name, body)):
                    checked += 1
                    if r.scaled > floor("torch.float32"):
                        broken_calls.add((side, name))
    assert checked > 100
    assert broken_calls == {("npu", "Functional.relu.2.forward")}
