"""What the plugin tests write and pass to their pytester runs, defined once: the arguments every run starts with,
the small CNN their test modules train, the two-step training test and the fault plugin.

Imported by the test modules beside it (module-level constants, since parametrize and module-level sources need
them at import) and by conftest.py, whose fixtures hand them out.
"""

from __future__ import annotations

import re
import textwrap

# No cache written into the pytester folder, no plugin reordering or reseeding the tests of a run, and not
# hypothesis's plugin, which imports the whole of hypothesis at the end of every session (0.8 s in each pytest
# process a test starts: its rank processes and xdist workers too); none of these runs uses it.
NO_HYPOTHESIS = ["-p", "no:hypothesispytest"]
BASE = ["-p", "no:cacheprovider", "-p", "no:randomly", *NO_HYPOTHESIS]


def net_source(*, bn: bool = True, relu_module: bool = False, conv2: bool = True) -> str:
    """The small CNN as source, `class Net(nn.Module)` (the module needs torch, `nn` and `F` imported).

    conv (-> batch norm) -> relu (-> conv2 -> F.relu) -> pool -> linear. The variants are what tests count on:
    `relu_module` makes the first relu an in-place nn.ReLU, so the functional relu after conv2 is the only
    F.relu of a forward (the one the fault plugin breaks); without `bn` there are no buffers; without `conv2`
    one relu per forward. The layers are built in this order whatever the variant, so one seed gives one model.
    """
    init = ["self.conv = nn.Conv2d(3, 6, 3, padding=1, bias=False)"]
    init += ["self.bn = nn.BatchNorm2d(6)"] if bn else []
    init += ["self.relu = nn.ReLU(inplace=True)"] if relu_module else []
    init += ["self.conv2 = nn.Conv2d(6, 6, 3, padding=1, bias=False)"] if conv2 else []
    init += ["self.fc = nn.Linear(6, 4)"]
    first = "self.bn(self.conv(x))" if bn else "self.conv(x)"
    forward = [f"x = self.relu({first})" if relu_module else f"x = F.relu({first})"]
    forward += ["x = F.relu(self.conv2(x))"] if conv2 else []
    forward += ["return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))"]
    lines = [
        "class Net(nn.Module):",
        "    def __init__(self):",
        "        super().__init__()",
        *(f"        {line}" for line in init),
        "",
        "    def forward(self, x):",
        *(f"        {line}" for line in forward),
    ]
    return "\n".join(lines) + "\n"


def with_net(source: str, **variant: bool) -> str:
    """`source` with its line `NET` replaced by :func:`net_source` of the given variant."""
    out, count = re.subn(r"^NET\n", lambda _: net_source(**variant), source, flags=re.MULTILINE)
    assert count == 1, "the source needs exactly one line NET"
    return out


# A small CNN trained for two steps: relu (functional and in-place module), batch_norm, conv, linear, SGD.
TRAIN_TEST = with_net(
    textwrap.dedent(
        """
        import pytest
        import torch
        import torch.nn as nn
        import torch.nn.functional as F


        NET


        def train(msprobe, steps=2):
            model = Net().to(msprobe.device)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            g = torch.Generator().manual_seed(0)
            for _ in range(steps):
                x = torch.randn(4, 3, 8, 8, generator=g).to(msprobe.device)
                y = torch.randint(0, 4, (4,), generator=g).to(msprobe.device)
                with msprobe.step(model):
                    loss = F.cross_entropy(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            return model


        MARKER

        def test_train(msprobe):
            train(msprobe)
        """
    ),
    relu_module=True,
)

# A relu kernel wrong by a relative `scale`, with its own autograd node, as a broken device kernel would be
# (`FaultyRelu.apply(x, scale)`; the module needs torch imported).
FAULTY_RELU = textwrap.dedent(
    """
    class FaultyRelu(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scale):
            out = torch.clamp_min(x, 0) * (1.0 + scale)
            ctx.save_for_backward(out)
            return out

        @staticmethod
        def backward(ctx, grad):
            (out,) = ctx.saved_tensors
            return grad * (out > 0), None
    """
).lstrip("\n")


def with_faulty_relu(source: str) -> str:
    """`source` with its line `FAULTY_RELU` replaced by :data:`FAULTY_RELU`."""
    out, count = re.subn(r"^FAULTY_RELU\n", lambda _: FAULTY_RELU, source, flags=re.MULTILINE)
    assert count == 1, "the source needs exactly one line FAULTY_RELU"
    return out


# Another plugin, loaded before ours with -p, that makes one F.relu call per forward wrong by a relative
# FAULT_SCALE (FaultyRelu).
FAULT_PLUGIN = with_faulty_relu(
    textwrap.dedent(
        """
    import os
    import torch
    import torch.nn.functional as F

    _orig = F.relu
    _calls = {"n": 0}


    FAULTY_RELU


    def _relu(input, inplace=False):
        _calls["n"] += 1
        if _calls["n"] % 2 == 0 and not inplace:  # the functional relu after conv2
            return FaultyRelu.apply(input, float(os.environ.get("FAULT_SCALE", "0.01")))
        return _orig(input, inplace=inplace)


    def pytest_configure(config):
        F.relu = _relu


    def pytest_unconfigure(config):
        F.relu = _orig
    """
    )
)
