"""Where each call was made in the model (pytest_msprobe.compare.dumps.modules): from construct.json at L0/mix, from
the call stacks at L1, on msprobe's real dumps, the ResNet50 example's shipped baseline and our own dumps of a
model built to be awkward; the two sources agree where both exist.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from compare_helpers import VERSIONS, dump_dir, rank_dir

from pytest_msprobe.compare import compare
from pytest_msprobe.compare.dumps import OPTIMIZER_MODULE as OPTIMIZER
from pytest_msprobe.compare.dumps import OUTSIDE_MODULES as OUTSIDE
from pytest_msprobe.compare.dumps import UNKNOWN_MODULE as UNKNOWN
from pytest_msprobe.compare.dumps import read_dump, read_stack
from pytest_msprobe.compare.dumps.modules import (
    callees,
    from_construct,
    from_stacks,
    place_calls,
    read_construct,
    segments,
)
from pytest_msprobe.format.layout import discover
from pytest_msprobe.format.names import MODULE_PREFIX

ROOT = Path(__file__).resolve().parents[2]
RESNET50 = (
    ROOT / "examples/resnet50/baselines/cpu/examples/resnet50/test_resnet50/test_resnet50_training_steps"
)


def _places(folder: Path) -> tuple[list[str], dict[str, tuple[str, ...]], str]:
    """Record names in order, their module paths and what told, for the first dump under ``folder``."""
    dump = read_dump(discover(folder)[0])
    places = place_calls(dump)
    names = [e.name for e in dump.entries]
    return names, {n: places.of(n) for n in names}, places.source


@pytest.mark.parametrize("version", VERSIONS)
def test_l1_stacks_give_the_module_tree_that_construct_json_gives_at_mix(version: str) -> None:
    # the same model and steps dumped at L1 (stacks only, construct.json {}) and at mix (construct.json)
    for step in (0, 1):
        l1_names, l1, l1_source = _places(dump_dir(version, "npu", "stat_L1", step))
        mix_names, mix, mix_source = _places(dump_dir(version, "npu", "stat_mix", step))
        assert (l1_source, mix_source) == ("stack.json", "construct.json")
        assert read_construct(rank_dir(version, "npu", "stat_L1", step) / "construct.json") == {}
        in_modules = [n for n in l1_names if n in mix and not mix[n][0].startswith("(")]
        assert len(in_modules) >= 40
        # the model is called as model(x) at top level: its modules sit under that name at L1
        assert {n: l1[n] for n in in_modules} == {n: ("model", *mix[n]) for n in in_modules}
        assert l1["Functional.relu.2.forward"] == ("model", "layer1")  # layer1 is one BasicBlock here
        assert l1["Functional.relu.2.backward"] == (
            "model",
            "layer1",
        )  # a backward goes where its forward ran
        # x = self.maxpool(self.relu(self.bn1(self.conv1(x)))): four modules on one line, in the order they ran
        assert [
            l1[f"Functional.{api}.0.forward"] for api in ("conv2d", "batch_norm", "relu", "max_pool2d")
        ] == [
            ("model", "conv1"),
            ("model", "bn1"),
            ("model", "relu"),
            ("model", "maxpool"),
        ]
        assert l1["Functional.conv2d.5.forward"] == ("model", "layer2", "downsample", "0")  # in a Sequential
        optimizer = {n for n in l1_names if l1[n] == OPTIMIZER}  # torch.optim on the stack
        assert optimizer and optimizer == {n for n in mix_names if mix[n] == OPTIMIZER}
        assert not [n for n in l1_names if l1[n] == UNKNOWN]


@pytest.mark.parametrize("version", VERSIONS)
def test_construct_json_places_calls_modules_and_parameter_gradients(version: str) -> None:
    names, mix, _ = _places(dump_dir(version, "npu", "stat_mix", 0))
    assert mix["Module.layer2.downsample.0.Conv2d.forward.0"] == ("layer2", "downsample", "0")
    assert mix["Module.layer2.downsample.Sequential.forward.0"] == ("layer2", "downsample")
    assert mix["Functional.conv2d.5.forward"] == ("layer2", "downsample", "0")
    grads = [n for n in names if n.endswith("parameters_grad")]
    assert len(grads) == (13 if version == "8.3.3" else 0)  # (26.2.0 records no parameter gradients here)
    assert all(mix[n] == tuple(n.split(".")[1:-2]) for n in grads)
    # msprobe parents the backward of the calls before an inplace ReLU under that ReLU's backward: a backward
    # call goes where its forward ran instead
    assert mix["Functional.conv2d.0.backward"] == mix["Functional.conv2d.0.forward"] == ("conv1",)
    assert mix["Functional.cross_entropy.0.forward"] == OUTSIDE  # the loss is no module of the model
    assert {mix[n] for n in names if n.startswith("Tensor.add_") and mix[n][0] == "(optimizer)"} == {
        OPTIMIZER
    }
    assert all(mix[n] != UNKNOWN for n in names)


def test_resnet50_baseline_calls_sit_in_torchvisions_modules() -> None:
    torchvision = pytest.importorskip("torchvision")
    import torch

    model = torchvision.models.resnet50(weights=None)
    kinds = {
        "conv2d": torch.nn.Conv2d,
        "batch_norm": torch.nn.BatchNorm2d,
        "linear": torch.nn.Linear,
        "max_pool2d": torch.nn.MaxPool2d,
    }
    for step in (0, 1):
        names, l1, source = _places(RESNET50 / f"step{step}")
        assert source == "stack.json"
        for api, cls in kinds.items():
            modules = [tuple(n.split(".")) for n, m in model.named_modules() if isinstance(m, cls)]
            calls = [n for n in names if n.startswith(f"Functional.{api}.") and n.endswith(".forward")]
            # one call per module, in the order of named_modules (torchvision defines them in call order)
            assert [l1[n] for n in calls] == [("model", *m) for m in modules], api
        relus = {l1[n] for n in names if n.startswith("Functional.relu.") and n.endswith(".forward")}
        blocks = [n for n, m in model.named_modules() if type(m).__name__ == "Bottleneck"]
        assert relus == {("model", "relu")} | {("model", *b.split("."), "relu") for b in blocks}
        backward = [n for n in names if n.startswith("Functional.conv2d.") and n.endswith(".backward")]
        assert all(l1[n] == l1[n.replace(".backward", ".forward")] for n in backward)
        # nn.CrossEntropyLoss is a module too, called at top level
        assert l1["Functional.cross_entropy.0.forward"] == ("criterion",)
        assert l1[names[-1]] == OPTIMIZER  # the step ends in SGD's update
        if step == 0:
            assert {l1[n] for n in names if n.startswith("Tensor.clone.")} == {OPTIMIZER}  # momentum buffers


AWKWARD = """
import sys, torch, torch.nn as nn
from pytest_msprobe import PrecisionDebugger, seed_all

class Block(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.fc1, self.norm, self.act, self.fc2 = nn.Linear(w, w), nn.LayerNorm(w), nn.GELU(), nn.Linear(w, w)

    def forward(self, x):
        h = self.act(self.norm(self.fc1(x)))  # three modules on one line
        h = self.fc2(h)
        return self.act(x + h)  # a module called twice

class Net(nn.Module):
    def __init__(self, w=8):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(4, w), nn.ReLU(), nn.ReLU())  # two alike in a row
        self.blocks = nn.ModuleList([Block(w) for _ in range(3)])
        self.head = nn.Sequential(nn.Sequential(nn.Linear(w, w), nn.Tanh()), nn.Linear(w, 2))

    def forward(self, x):
        x = self.stem(x)
        for blk in self.blocks:
            x = blk(x)
        for i in range(len(self.blocks)):
            x = x + 0.1 * self.blocks[i].fc1(x)
        return self.head(x)

seed_all(0, mode=True)
net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.1)
with PrecisionDebugger(dump_path=sys.argv[1], task="statistics", level=sys.argv[2], step=[0, 1]) as dbg:
    for _ in range(2):
        dbg.start(model=net)
        for _ in range(2):  # two forward passes a step
            out = net(torch.randn(5, 4))
            out.square().mean().backward()
        opt.step()
        dbg.stop()
        dbg.step()
"""


@pytest.fixture(scope="module")
def awkward(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Our own dumps of AWKWARD at L1 and at mix."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("awkward")
    script = root / "awkward.py"
    script.write_text(AWKWARD)
    for level in ("L1", "mix"):
        subprocess.run(
            [sys.executable, str(script), str(root / level), level], check=True, cwd=root, timeout=300
        )
    return root


def test_l1_grouping_of_an_awkward_model_agrees_with_its_construct_json(awkward: Path) -> None:
    for step in (0, 1):
        names, l1, _ = _places(awkward / "L1" / f"step{step}")
        _, mix, _ = _places(awkward / "mix" / f"step{step}")
        compared = 0
        for name in names:
            if mix[name][0].startswith("("):
                assert l1[name] in (mix[name], ("net",)), name  # the model's own code is no module at mix
                continue
            expected = ("net", *mix[name])
            if l1[name] != expected:
                # `for blk in self.blocks: x = blk(x)` names no attribute: the k-th call from it is blk[k]
                assert mix[name][:2] in {("blocks", "0"), ("blocks", "1"), ("blocks", "2")}, name
                assert l1[name] == ("net", f"blk[{mix[name][1]}]", *mix[name][2:]), name
            compared += 1
        assert compared >= 80
        # the two ReLUs of the stem, and self.blocks[i].fc1 of the second loop, each in its own place
        relus = [n for n in names if n.startswith("Functional.relu.") and n.endswith(".forward")]
        assert [l1[n] for n in relus] == [("net", "stem", "1"), ("net", "stem", "2")] * 2
        indexed = [n for n in names if n.endswith(".forward") and mix[n][-1:] == ("fc1",)]
        assert {l1[n] for n in indexed} >= {("net", "blocks", str(k), "fc1") for k in range(3)}


def test_both_forward_passes_of_a_step_land_in_the_same_modules(awkward: Path) -> None:
    names, l1, _ = _places(awkward / "L1" / "step0")
    heads = [n for n in names if l1[n] == ("net", "head", "1")]
    assert heads == [
        "Functional.linear.11.forward",
        "Functional.linear.11.backward",
        "Functional.linear.23.forward",
        "Functional.linear.23.backward",
    ]


def test_calls_without_a_stack_are_unknown_and_module_records_place_themselves() -> None:
    frame = "File /m/model.py, line {}, in forward, \n {}"
    machinery = [
        "File /t/torch/nn/modules/module.py, line 1789, in _call_impl, \n return forward_call(*args, **kwargs)",
        "File /t/torch/nn/modules/module.py, line 1778, in _wrapped_call_impl, \n return self._call_impl(*a)",
    ]
    top = ["File /m/train.py, line 9, in main, \n out = model(x)"]
    stacks = {
        "Functional.relu.0.forward": [frame.format(5, "return F.relu(self.fc(x))"), *machinery, *top],
        "Functional.linear.0.forward": [
            "File /t/torch/nn/modules/linear.py, line 125, in forward, \n return F.linear(input, self.weight)",
            *machinery,
            frame.format(5, "return F.relu(self.fc(x))"),
            *machinery,
            *top,
        ],
    }
    names = [
        "Functional.linear.0.forward",
        "Functional.relu.0.forward",
        "Functional.gelu.0.forward",
        "Module.fc.Linear.forward.0",
        "Functional.relu.0.backward",
    ]
    places = from_stacks(names, stacks)
    assert [places.of(n) for n in names] == [
        ("model", "fc"),
        ("model",),
        UNKNOWN,
        ("fc",),
        ("model",),
    ]
    assert places.about[("model", "fc")] == "called at model.py:5: return F.relu(self.fc(x))"
    assert from_construct(names, {}).of("Functional.relu.0.forward") == UNKNOWN


def test_a_line_that_calls_several_modules_without_a_call_each_is_named_by_all() -> None:
    machinery = ["File /t/torch/nn/modules/module.py, line 1778, in _wrapped_call_impl, \n return x"]
    site = ["File /m/model.py, line 7, in forward, \n x = self.b(self.a(x))", *machinery]
    top = ["File /m/train.py, line 9, in main, \n out = model(x)"]
    # module a makes no recorded call (an identity): the one call seen cannot be told to be b's
    stacks = {
        "Functional.relu.0.forward": [
            "File /m/model.py, line 3, in forward, \n return F.relu(x)",
            *machinery,
            *site,
            *top,
        ]
    }
    assert from_stacks(list(stacks), stacks).of("Functional.relu.0.forward") == ("model", "a | b")


def test_frames_are_cut_at_module_calls_and_tool_frames_dropped() -> None:
    stack = read_stack(rank_dir("8.3.3", "npu", "stat_mix", 0) / "dump.json")["Functional.conv2d.2.forward"]
    parts = segments(stack)
    assert [p[-1].code for p in parts[:-1]] == [
        "out = model(x)",
        "x = self.layer1(x)",
        "out = self.bn2(self.conv2(out))",
    ]
    assert "msprobe" not in parts[-1][0].file and parts[-1][-1].func == "_conv_forward"


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("x = self.maxpool(self.relu(self.bn1(self.conv1(x))))", ["conv1", "bn1", "relu", "maxpool"]),
        ("out = model(images)", ["model"]),
        ("return self.layers[2](x) + len(x)", ["layers.2"]),
        ("layer_outputs = decoder_layer(", ["decoder_layer"]),  # a call spread over lines
        ("return F.relu(x).view(-1)", []),
        ("if self.downsample is not None:", []),
    ],
)
def test_the_modules_a_line_calls(code: str, expected: list[str]) -> None:
    assert [c.name for c in callees(code)] == expected


def test_every_call_of_a_compare_carries_its_module() -> None:
    result = compare(dump_dir("26.2.0", "npu", "stat_mix"), dump_dir("26.2.0", "bench", "stat_mix"), jobs=2)
    assert result.modules.sources == ("construct.json",)
    assert result.modules.about[("layer1",)] == "BasicBlock"
    fd = result.first_divergence
    assert fd is not None and result.apis[fd.api_index].module == ("layer1",)
    by_name = {(a.api, a.step): a.module for a in result.apis}
    assert by_name[("Module.layer2.downsample.0.Conv2d.forward.0", 1)] == ("layer2", "downsample", "0")
    assert all(a.module for a in result.apis)
    # the same in one process as in worker processes
    single = compare(dump_dir("26.2.0", "npu", "stat_mix"), dump_dir("26.2.0", "bench", "stat_mix"), jobs=1)
    assert [a.module for a in single.apis] == [a.module for a in result.apis]


def test_a_call_only_the_baseline_makes_is_placed_by_the_baselines_files(tmp_path: Path) -> None:
    import json
    import shutil

    target = shutil.copytree(rank_dir("8.3.3", "npu", "stat_mix", 0), tmp_path / "t")
    doc = json.loads((target / "dump.json").read_text())
    del doc["data"]["Functional.relu.2.forward"]
    (target / "dump.json").write_text(json.dumps(doc))
    construct = json.loads((target / "construct.json").read_text())
    del construct["Functional.relu.2.forward"]
    (target / "construct.json").write_text(json.dumps(construct))
    result = compare(target, rank_dir("8.3.3", "bench", "stat_mix", 0))
    (only,) = [a for a in result.apis if a.api == "Functional.relu.2.forward" and a.direction == "forward"]
    assert only.module == ("layer1",)
    assert not any(a.api.startswith(MODULE_PREFIX) and not a.module for a in result.apis)


def test_unusable_stack_and_construct_files_leave_the_calls_unknown(tmp_path: Path) -> None:
    import json
    import shutil

    target = shutil.copytree(rank_dir("26.2.0", "npu", "stat_L1", 0), tmp_path / "t")
    long_line = "File /m/model.py, line 3, in forward, \n x = " + "+".join(["a"] * 5000)
    (target / "stack.json").write_text(
        json.dumps(
            {
                "0": [
                    ["Functional.conv2d.0.forward"],
                    [long_line, "File /m/m.py, line 1, in f, \n x = (((("],
                ],
                "1": "not a stack",
                "2": [[1, None], [{"a": 1}]],
                "3": [["Functional.relu.0.forward"], ["no frame at all", 7]],
            }
        )
    )
    (target / "construct.json").write_text("[1, 2]")
    result = compare(target, rank_dir("26.2.0", "bench", "stat_L1", 0))
    modules = {a.api: a.module for a in result.apis}
    assert modules["Functional.conv2d.0.forward"] == OUTSIDE  # frames, but no module call among them
    assert modules["Functional.relu.0.forward"] == UNKNOWN  # no frame that can be read
    assert modules["Functional.relu.2.forward"] == UNKNOWN  # no stack left for it
    assert result.first_divergence is not None and result.first_divergence.api == "Functional.relu.2.forward"
    (tmp_path / "t" / "construct.json").write_bytes(b"\xff\xfe")
    assert compare(target, rank_dir("26.2.0", "bench", "stat_L1", 0)).modules.sources == ("stack.json",)
