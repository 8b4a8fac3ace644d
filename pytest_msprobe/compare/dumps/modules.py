"""Where each call of a dump was made in the model: its module path, for the model view of a compare.

At L0 and mix, construct.json (beside dump.json) names each record's parent node: an API call's parent is the
module call it ran in (``Module.layer1.0.conv1.Conv2d.forward.0``: module ``layer1.0.conv1``, a Conv2d), or
``optimizer``, or null (outside any recorded module); a module record names its own module. A backward call
sits where its forward ran (msprobe's backward parents are unreliable: an inplace ReLU re-parents the calls
before it).

At L1 construct.json is ``{}``: the calls are grouped by the module calls in their stacks (stack.json, forward
calls only; a backward call goes where its forward went). A stack, outermost frame first, is cut at the frames
of torch's module call machinery (``_wrapped_call_impl``, ``_call_impl``, ``inner``): the frames before a cut
are the caller's code, whose last frame is the call site (``x = self.layer1(x)``), those after it the called
module's code. The site names the module: ``self.layer1`` gives ``layer1``, ``self.layers[2]`` gives
``layers.2``, a top-level ``model(x)`` gives ``model``. Stacks are text, so a site that does not name the
module is resolved by counting: the k-th module call made from ``for module in self: input = module(input)``
(torch's Sequential) is child ``k``, from ``x = blk(x)`` in a loop ``blk[k]``; on a line that calls several
modules (``self.bn1(self.conv1(x))``) they are taken in the order the calls run, where the count matches.

A module call (an invocation) is told from the next one by the calls' positions in the module's code: a new
one starts where a call comes from another site, from another module's code, or from an earlier line of the
same code than the previous call (a module's forward runs top to bottom; a loop inside it reads as new calls of
the module, which keeps its name). Calls whose stack shows no module call are outside any module (or in the
optimizer, when torch.optim is on the stack); calls without a stack go where nothing is known.
"""

from __future__ import annotations

import ast
import builtins
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pytest_msprobe.compare.dumps.reader import Dump, read_helper_json, read_stack
from pytest_msprobe.format.layout import CONSTRUCT_JSON
from pytest_msprobe.format.names import (
    BACKWARD,
    FORWARD,
    MODULE_PREFIXES,
    OPTIMIZER_NODE,
    is_parameters_grad,
    params_grad_module,
    parse_name,
)
from pytest_msprobe.format.optimizerfile import is_update

ModulePath = tuple[str, ...]

CONSTRUCT, STACKS = "construct.json", "stack.json"  # ModulePlaces.source

# attribute name)
OUTSIDE_MODULES = ("(outside any module)",)  # before, after or between the model's module calls
OPTIMIZER_MODULE = ("(optimizer)",)  # inside optimizer.step()
UNKNOWN_MODULE = ("(no module known)",)  # neither construct.json nor a stack tells


@dataclass(frozen=True)
class Modules:
    """The model's modules that the calls were made in (:attr:`ApiResult.module`): what each is (its class at
    L0/mix, where it is called at L1) and which files told (``construct.json``, ``stack.json``; none: every
    call's module is unknown)."""

    about: dict[tuple[str, ...], str] = field(default_factory=dict)
    sources: tuple[str, ...] = ()


@dataclass
class ModulePlaces:
    """Record name -> module path of one dump, what each module is (``Conv2d``; or at L1 where it is called,
    ``resnet.py:146 out = self.conv1(x)``), and what told (:data:`CONSTRUCT`, :data:`STACKS`, or "")."""

    paths: dict[str, ModulePath] = field(default_factory=dict)
    about: dict[ModulePath, str] = field(default_factory=dict)
    source: str = ""

    def of(self, name: str) -> ModulePath:
        if is_update(name):  # a parameter's update (optimizer.json, or made of the optimizer's calls)
            return OPTIMIZER_MODULE
        return self.paths.get(name, UNKNOWN_MODULE)


def place_calls(dump: Dump) -> ModulePlaces:
    """Where each record of ``dump`` was made: from its construct.json where that names parents (L0, mix),
    from its stack.json otherwise (L1). Neither file is needed: without them every call is unknown."""
    names = [entry.name for entry in dump.entries]
    construct = read_construct(dump.path.parent / CONSTRUCT_JSON)
    if construct:
        return from_construct(names, construct)
    stacks = read_stack(dump.path)
    if stacks:
        return from_stacks(names, stacks)
    return ModulePlaces()


def read_construct(path: Path) -> dict[str, Any]:
    """construct.json's node -> parent mapping; {} where the file is absent or unusable (the view of the model
    is a help: a compare does not fail for it)."""
    doc = read_helper_json(path)
    return doc if isinstance(doc, dict) else {}


# ------------------------------------------------------------------------------------------ construct.json
def module_of(name: str) -> tuple[ModulePath, str] | None:
    """The module path and class of a module record or module node name (``Module.layer1.0.conv1.Conv2d.
    forward.0`` -> ``(("layer1", "0", "conv1"), "Conv2d")``), None for any other name."""
    if not name.startswith(MODULE_PREFIXES):
        return None
    base = parse_name(name).base
    if is_parameters_grad(name):
        base = params_grad_module(base)
    dotted = base.split(".", 1)[1] if "." in base else ""
    path, _, cls = dotted.rpartition(".")
    if not cls:
        return None
    # the model itself (never recorded by msprobe, nor by us): its class stands for it
    return (tuple(path.split(".")) if path else (f"({cls})",)), cls


def from_construct(names: Sequence[str], construct: dict[str, Any]) -> ModulePlaces:
    """Module paths of records from construct.json's parents (see the module's docstring)."""
    places = ModulePlaces(source=CONSTRUCT)
    for name in names:
        module = module_of(name)
        if module is not None:
            places.paths[name] = module[0]
            places.about.setdefault(module[0], module[1])
            continue
        parts = parse_name(name)
        forward = parts.with_direction(FORWARD) if parts.direction == BACKWARD else name
        key = forward if forward in construct else name
        if key not in construct:
            continue  # unknown
        parent = construct[key]
        if parent is None:
            places.paths[name] = OUTSIDE_MODULES
        elif parent == OPTIMIZER_NODE:
            places.paths[name] = OPTIMIZER_MODULE
        elif isinstance(parent, str) and (found := module_of(parent)) is not None:
            places.paths[name] = found[0]
            places.about.setdefault(found[0], found[1])
    return places


# ---------------------------------------------------------------------------------------------- stack.json
class Frame(NamedTuple):
    """One frame of a stack.json stack: ``File {file}, line {line}, in {func}, \\n {code}``."""

    file: str
    line: int
    func: str
    code: str


_FRAME = re.compile(
    r"File (?P<file>.*?), line (?P<line>\d+), in (?P<func>[^,\n]*),?\s*\n?\s?(?P<code>.*)", re.S
)
# frames of the recording tools themselves (msprobe's API wrappers, ours never reach stack.json)
_TOOL_FRAME = re.compile(r"/(?:msprobe/(?:core|pytorch|mindspore)|pytest_msprobe)/")
_MACHINERY = "torch/nn/modules/module.py"  # where a module call runs its hooks and forward
_SEQUENTIAL = "torch/nn/modules/container.py"  # Sequential.forward: for module in self: input = module(input)
_OPTIMIZER_CODE = "torch/optim/"


_CLIP_CODE = "torch/nn/utils/clip_grad.py"  # clip_grad_norm_ / clip_grad_value_
_ZERO_GRAD = "zero_grad"


def _in_optimizer(segs: Sequence[Segment]) -> bool:
    return any(_OPTIMIZER_CODE in f.file for seg in segs for f in seg)


def optimizer_step_call(stack: Sequence[str]) -> bool:
    """Whether a call with this stack (stack.json's frames) ran inside an optimizer's ``step()``: torch.optim's
    code on its stack, outside any module call, and not in ``zero_grad`` (see :func:`gradient_housekeeping`)."""
    segs = segments(stack)
    if len(segs) != 1 or not _in_optimizer(segs):
        return False
    return not any(f.func == _ZERO_GRAD and _OPTIMIZER_CODE in f.file for f in segs[0])


def gradient_housekeeping(stack: Sequence[str]) -> str | None:
    """``clip_grad`` or ``zero_grad`` for a call made by gradient clipping (torch.nn.utils.clip_grad) or an
    optimizer's ``zero_grad``, which also run over lists on CUDA and one tensor at a time on the CPU; else None."""
    for text in stack:
        frame = parse_frame(text)
        if frame is None:
            continue
        if frame.file.endswith(_CLIP_CODE):
            return "clip_grad"
        if frame.func == _ZERO_GRAD and _OPTIMIZER_CODE in frame.file:
            return "zero_grad"
    return None


@functools.lru_cache(maxsize=65536)
def parse_frame(text: str) -> Frame | None:
    m = _FRAME.match(text.strip())
    if m is None:
        return None
    return Frame(
        m.group("file").replace("\\", "/"), int(m.group("line")), m.group("func"), m.group("code").strip()
    )


Segment = tuple[Frame, ...]


def segments(stack: Sequence[str]) -> tuple[Segment, ...]:
    """A stack (innermost frame first, as stack.json has it) cut into the caller's code and the code of each
    module called, outermost first: ``[program, model, layer1, conv1]``; the tools' own frames left out."""
    parts: list[list[Frame]] = [[]]
    machinery = False
    for text in reversed(stack):
        frame = parse_frame(text)
        if frame is None or _TOOL_FRAME.search(frame.file):
            continue
        if frame.file.endswith(_MACHINERY):
            machinery = True
            continue
        if machinery and parts[-1]:
            parts.append([])
        machinery = False
        parts[-1].append(frame)
    return tuple(tuple(p) for p in parts if p)


class Callee(NamedTuple):
    """A module a line of code may call: ``self.conv1`` -> ("conv1", ATTR); ``model`` -> ("model", NAME);
    ``self.layers[i].fc1`` -> ("layers.<slot>.fc1", INDEX), the slot filled by the count of calls."""

    name: str
    kind: str


ATTR, NAME, INDEX = "attr", "name", "index"
_LONGEST_LINE = 2000  # a longer line of source is no call site a person wrote
_BUILTINS = frozenset(dir(builtins)) | {"super"}


@functools.lru_cache(maxsize=16384)
def callees(code: str) -> tuple[Callee, ...]:
    """The modules a line of code may call, in the order the calls run (arguments before the call that takes
    them: ``self.bn1(self.conv1(x))`` -> conv1, bn1). A line cut short (a call spread over lines) is closed
    first; a line that does not parse calls nothing known."""
    text = code.strip()
    if len(text) > _LONGEST_LINE:
        return ()
    if text.endswith(":"):
        text += " pass"
    tree = None
    for tail in ("", ")", "))", ")))", "]", ")]"):
        try:
            tree = ast.parse(text + tail)
            break
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # (a NUL byte, nesting too deep)
            continue
    if tree is None:
        return ()
    found: list[Callee] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Call):
            visit(node.func)
            for arg in node.args:
                visit(arg)
            for kw in node.keywords:
                visit(kw.value)
            callee = _callee(node.func)
            if callee is not None:
                found.append(callee)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    try:
        visit(tree)
    except RecursionError:  # a line of 10,000 additions: no module call to be read off it
        return ()
    return tuple(found)


_SLOT = "\x00"  # where a subscript that only the count can tell stands in a name (self.layers[i])


def _callee(func: ast.expr) -> Callee | None:
    parts: list[str] = []
    slots = 0
    node = func
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            index = node.slice
            if isinstance(index, ast.Constant) and isinstance(index.value, int | str):
                parts.append(str(index.value))
            else:  # self.layers[i](x), self.layers[i].fc1(x): which one, only the count can tell
                parts.append(_SLOT)
                slots += 1
            node = node.value
        else:
            break
    if not isinstance(node, ast.Name) or slots > 1:
        return None
    if node.id == "self":
        return Callee(".".join(reversed(parts)), INDEX if slots else ATTR) if parts else None
    if parts or node.id in _BUILTINS:
        return None  # F.relu(x), torch.cat(...), x.view(...), len(x): functions and methods, no modules
    return Callee(node.id, NAME)


@dataclass
class _Call:
    """One module call (invocation) seen in the stacks."""

    parent: int  # index of the enclosing invocation, -1 for the program
    site: Frame  # the line that made it, in the parent's code
    ordinal: int  # how many calls the parent made from this site before it
    body: Segment  # the module's frames of the latest record made in it
    op: str | None  # the API of that record, when the record was made right in this module's code


def from_stacks(names: Sequence[str], stacks: dict[str, list[str]]) -> ModulePlaces:
    """Module paths of records (in execution order) from their stacks (see the module's docstring)."""
    places = ModulePlaces(source=STACKS)
    calls: list[_Call] = []
    counts: dict[tuple[int, Frame], int] = {}
    chains: dict[str, list[int]] = {}  # record name -> its invocations, outermost first
    outside: dict[str, ModulePath] = {}
    previous: list[int] = []
    for name in names:
        module = module_of(name)
        if module is not None:  # (a dump with module records has its construct.json: this one lost it)
            places.paths[name] = module[0]
            places.about.setdefault(module[0], module[1])
            continue
        stack = stacks.get(name)
        if not stack:
            continue
        segs = segments(stack)
        if not segs:
            continue  # no frame could be read: unknown
        if len(segs) < 2:
            outside[name] = OPTIMIZER_MODULE if _in_optimizer(segs) else OUTSIDE_MODULES
            continue
        op = parse_name(name).base
        chain: list[int] = []
        same = True
        for depth in range(1, len(segs)):
            site, body = segs[depth - 1][-1], segs[depth]
            innermost = depth == len(segs) - 1
            prev = calls[previous[depth - 1]] if same and depth - 1 < len(previous) else None
            if prev is not None and prev.site == site and _continues(prev, body, op if innermost else None):
                index = previous[depth - 1]
            else:
                same = False
                parent = chain[-1] if chain else -1
                ordinal = counts.get((parent, site), 0)
                counts[(parent, site)] = ordinal + 1
                calls.append(_Call(parent, site, ordinal, body, None))
                index = len(calls) - 1
            call = calls[index]
            call.body, call.op = body, (op if innermost else None)
            chain.append(index)
        chains[name] = chain
        previous = chain
    labels = _labels(calls, counts)
    paths: list[ModulePath] = []
    for call, label in zip(calls, labels):  # (a parent comes before its calls)
        paths.append((() if call.parent < 0 else paths[call.parent]) + label)
        places.about.setdefault(paths[-1], _where(call.site))
    for name in names:
        if name in chains:
            places.paths[name] = paths[chains[name][-1]]
        elif name in outside:
            places.paths[name] = outside[name]
    for name in names:  # a backward call (no stack of its own) goes where its forward went
        parts = parse_name(name)
        if name not in places.paths and parts.direction == BACKWARD:
            forward = places.paths.get(parts.with_direction(FORWARD))
            if forward is not None:
                places.paths[name] = forward
    return places


def _continues(call: _Call, body: Segment, op: str | None) -> bool:
    """Whether a record made at ``body`` (from ``op``, when made right in this module's code) belongs to the
    module call that made the previous one: its code goes on from where that record was made."""
    prev = call.body
    if not body or not prev or (body[0].file, body[0].func) != (prev[0].file, prev[0].func):
        return False  # another module's code (file and function of its forward differ)
    for mine, theirs in zip(body, prev):
        if (mine.file, mine.func) != (theirs.file, theirs.func):
            return True  # one line calling two helpers
        if mine.line != theirs.line:
            return mine.line > theirs.line
    # the same API again from the very same place: the module was called again
    return not (len(body) == len(prev) and op is not None and op == call.op)


def _labels(calls: Sequence[_Call], counts: dict[tuple[int, Frame], int]) -> list[ModulePath]:
    """Each invocation's name under its parent (see the module's docstring)."""
    labels: list[ModulePath] = []
    for call in calls:
        found = callees(call.site.code)
        total = counts[(call.parent, call.site)]
        if len(found) == 1:
            callee, ordinal = found[0], call.ordinal
        elif found and total % len(found) == 0:  # several on one line, each called (in a loop or not)
            callee, ordinal = found[call.ordinal % len(found)], call.ordinal // len(found)
        elif found:
            labels.append((" | ".join(dict.fromkeys(c.name for c in found)),))
            continue
        else:
            labels.append((f"{Path(call.site.file).name}:{call.site.line}",))
            continue
        if callee.kind == ATTR:
            labels.append(tuple(callee.name.split(".")))
        elif callee.kind == INDEX:
            labels.append(tuple(callee.name.replace(_SLOT, str(ordinal)).split(".")))
        elif call.parent < 0:  # a top-level model(x): the model
            labels.append((callee.name,))
        elif call.site.file.endswith(_SEQUENTIAL):
            labels.append((str(ordinal),))
        else:
            labels.append((f"{callee.name}[{ordinal}]",))
    return labels


def _where(site: Frame) -> str:
    return f"called at {Path(site.file).name}:{site.line}: {site.code}"
