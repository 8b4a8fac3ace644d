"""Fuzzing of the loader: random mutations of real dump.json and .pt files, bounded in time.

Each test mutates msprobe's real dumps (``tests/data/msprobe``; reduced to their first calls, so that an
iteration takes milliseconds) for ``MSPROBE_FUZZ_SECONDS`` (default 3) and feeds them to ``read_dump``,
``validate``, ``compare`` and ``open_tensor``. The only exception allowed out of them is
:class:`DumpFormatError`; anything else fails with the seed that reproduces it (``MSPROBE_FUZZ_SEED=<seed>``
starts there). The three entry points must also agree: a dump.json that ``read_dump`` refuses gets the same
error from ``validate`` and ``compare``, and a dump that ``validate`` accepts must compare.

Seeds start at 0 unless ``MSPROBE_FUZZ_SEED`` says otherwise (``random`` for a new start each run), so CI
runs are reproducible; the number of iterations depends on the machine.
"""

from __future__ import annotations

import copy
import io
import json
import os
import random
import shutil
import time
import traceback
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from compare_helpers import dump_dir

from pytest_msprobe.compare import compare, validate
from pytest_msprobe.compare.dumps import open_tensor, read_dump
from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.layout import discover

BUDGET = float(os.environ.get("MSPROBE_FUZZ_SECONDS", "3"))
KEEP_CALLS = 12  # calls kept from each real dump: every kind of record, milliseconds per compare


def seeds() -> Iterator[int]:
    start = os.environ.get("MSPROBE_FUZZ_SEED", "0")
    seed = random.SystemRandom().randrange(2**32) if start == "random" else int(start)
    deadline = time.monotonic() + BUDGET
    while True:
        yield seed
        seed += 1
        if time.monotonic() > deadline:
            return


def outcome(call: Callable[[], object]) -> tuple[str, str] | None:
    """None when ``call`` succeeds, (path, problem) when it raises DumpFormatError; anything else propagates."""
    try:
        call()
    except DumpFormatError as exc:
        return (exc.path, exc.problem)
    return None


def fail(seed: int, what: str, exc: BaseException | None = None) -> None:
    detail = "" if exc is None else "\n" + "".join(traceback.format_exception(exc))
    pytest.fail(f"fuzz seed {seed} (reproduce with MSPROBE_FUZZ_SEED={seed}): {what}{detail}", pytrace=False)


# ------------------------------------------------------------------------------------------------- the seeds
def reduced(src_rank: Path, dst_rank: Path) -> dict[str, Any]:
    """A copy of a real rank folder holding only its first calls (and their tensor files)."""
    doc = json.loads((src_rank / "dump.json").read_text())
    doc["data"] = dict(list(doc["data"].items())[:KEEP_CALLS])
    dst_rank.mkdir(parents=True)
    (dst_rank / "dump.json").write_text(json.dumps(doc))
    tensors = src_rank / "dump_tensor_data"
    if tensors.is_dir():
        (dst_rank / "dump_tensor_data").mkdir()
        names = set(_data_names(doc))
        for file in tensors.iterdir():
            if file.name in names:
                shutil.copyfile(file, dst_rank / "dump_tensor_data" / file.name)
    return doc


def _data_names(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("data_name"), str):
            yield node["data_name"]
        for value in node.values():
            yield from _data_names(value)
    elif isinstance(node, list):
        for value in node:
            yield from _data_names(value)


def rank_of(version: str, kind: str) -> Path:
    (only,) = [d for d in dump_dir(version, "bench", kind, 0).iterdir() if d.is_dir()]
    return only


SOURCES = [(v, k) for v in ("8.3.3", "26.2.0") for k in ("stat_L1", "md5_L1", "stat_mix", "tensor_L1")]


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, dict[str, Any]]]:
    """Each source reduced once: (its dump root, its dump.json document)."""
    root = tmp_path_factory.mktemp("fuzz-baselines")
    out = {}
    for version, kind in SOURCES:
        rank = root / f"{version}-{kind}" / "step0" / "rank"
        out[(version, kind)] = (rank.parent.parent, reduced(rank_of(version, kind), rank))
    return out


# -------------------------------------------------------------------------------------------- the mutations
_DEEP: Any = None
for _ in range(200):
    _DEEP = [_DEEP]

VALUES: list[Any] = [
    None, True, False, 0, -1, 7, 2**31, 10**30, -(10**30), 1.5, -0.0, 1e308, float("nan"), float("inf"),
    "", "x", "nan", "-inf", "N/A", "torch.Tensor", "torch.float32", "../../../etc/passwd", "/etc/passwd",
    "a\u0000b", "dump.json", "x" * 5000, "\ud800", [], {}, [[[]]], [1] * 40, [-1, 3], [2**40, 2**40],
    [1.5], ["3"], {"type": "torch.Tensor"}, {"type": 5}, {"type": "torch.Tensor", "dtype": "torch.float32"},
    {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2]}, _DEEP,
]  # fmt: skip
KEYS = ["type", "dtype", "shape", "Max", "Min", "Mean", "Norm", "data_name", "md5", "requires_grad", "value"]
NAMES = ["", ".", "Functional.relu.0.forward", "Functional.relu.99999999999999999999.backward", "x" * 3000,
         "Module.a.B.parameters_grad", "Module.a.B.forward.0", "Tensor.__add__.0.forward"]  # fmt: skip


def _containers(node: Any, out: list[Any]) -> list[Any]:
    if isinstance(node, (dict, list)):
        out.append(node)
        for value in node.values() if isinstance(node, dict) else node:
            _containers(value, out)
    return out


def mutate_doc(doc: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any], list[str]]:
    """1 to 3 structural changes of a dump.json document: deleted keys, values of other types, odd names."""
    doc = copy.deepcopy(doc)
    done = []
    for _ in range(rng.randint(1, 3)):
        places = _containers(doc, [])
        node = rng.choice(places)
        op = rng.randrange(6)
        if isinstance(node, dict) and node and op == 0:
            key = rng.choice(list(node))
            del node[key]
            done.append(f"delete {key!r}")
        elif isinstance(node, dict) and node and op == 1:
            key = rng.choice(list(node))
            node[key] = copy.deepcopy(rng.choice(VALUES))
            done.append(f"{key!r} = {str(node[key])[:40]}")
        elif isinstance(node, dict) and op == 2:
            key = rng.choice(KEYS)
            node[key] = copy.deepcopy(rng.choice(VALUES))
            done.append(f"set {key!r} = {str(node[key])[:40]}")
        elif isinstance(node, list) and node and op == 3:
            i = rng.randrange(len(node))
            node[i] = copy.deepcopy(rng.choice(VALUES))
            done.append(f"item {i} = {str(node[i])[:40]}")
        elif op == 4 and isinstance(doc.get("data"), dict) and doc["data"]:
            data = doc["data"]
            old = rng.choice(list(data))
            data[rng.choice(NAMES)] = data.pop(old)
            done.append(f"rename {old!r}")
        elif isinstance(node, list) and op == 5:
            node.append(copy.deepcopy(rng.choice(VALUES)))
            done.append("append")
        else:
            doc[rng.choice(["task", "data", "level", "framework"])] = copy.deepcopy(rng.choice(VALUES))
            done.append("top-level value")
    return doc, done


def mutate_bytes(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    data = bytearray(raw)
    if not data:
        return rng.randbytes(rng.randint(1, 64)), "random bytes"
    op = rng.randrange(5)
    if op == 0:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data), "flipped bytes"
    if op == 1:
        return bytes(data[: rng.randrange(len(data))]), "truncated"
    if op == 2:
        at = rng.randrange(len(data))
        return bytes(data[:at] + rng.randbytes(rng.randint(1, 64)) + data[at:]), "inserted bytes"
    if op == 3:
        at = rng.randrange(len(data))
        return bytes(data[:at] + data[at + rng.randint(1, 256) :]), "deleted bytes"
    at = rng.randrange(min(len(data), 200))  # the header, where the structure lives
    data[at] = rng.randrange(256)
    return bytes(data), f"flipped header byte {at}"


def mutate_archive(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A torch archive with its pickle or its members changed (the zip itself stays valid)."""
    try:
        src = zipfile.ZipFile(io.BytesIO(raw))
        contents = [(info, src.read(info)) for info in src.infolist()]
    except Exception:  # already broken by an earlier mutation: break it further
        return mutate_bytes(raw, rng)
    out = io.BytesIO()
    op = rng.randrange(4)
    with zipfile.ZipFile(out, "w") as dst:
        for info, content in contents:
            if info.filename.endswith("data.pkl") and op < 2:
                pkl = bytearray(content)
                for _ in range(rng.randint(1, 4)):
                    pkl[rng.randrange(len(pkl))] = rng.randrange(256)
                content = bytes(pkl)
            elif info.filename.endswith("/data/0") and op == 2:
                content = content[: rng.randrange(len(content) + 1)]
            elif info.filename.endswith("/data/0") and op == 3:
                continue  # the storage is gone
            dst.writestr(info, content)
    return out.getvalue(), ["pickle bytes flipped", "pickle bytes flipped", "storage cut", "storage removed"][
        op
    ]


# ----------------------------------------------------------------------------------------------- the checks
def check(seed: int, what: str, target: Path, baseline: Path) -> None:
    """read_dump, validate and compare on a mutated target: DumpFormatError only, and the same one."""
    try:
        parsed = outcome(lambda: [read_dump(loc) for loc in discover(target)])
        checked = outcome(lambda: validate(target))
        compared = outcome(lambda: compare(target, baseline))
    except Exception as exc:
        fail(seed, what, exc)
    if parsed is not None and (checked, compared) != (parsed, parsed):
        fail(seed, f"{what}: read_dump says {parsed}, validate {checked}, compare {compared}")
    if checked is None and compared is not None:
        fail(seed, f"{what}: validate accepts the dump, compare refuses it: {compared}")


def test_fuzz_dump_json(baselines: dict[Any, Any], tmp_path: Path) -> None:
    sources = [(v, k) for v, k in SOURCES if k != "tensor_L1"]
    runs = 0
    for seed in seeds():
        rng = random.Random(seed)
        version, kind = rng.choice(sources)
        baseline, doc = baselines[(version, kind)]
        target = tmp_path / str(seed)
        rank = target / "step0" / "rank"
        rank.mkdir(parents=True)
        if rng.random() < 0.3:
            raw, what = mutate_bytes(json.dumps(doc).encode(), rng)
        else:
            mutated, changes = mutate_doc(doc, rng)
            raw, what = json.dumps(mutated).encode("utf-8", "surrogatepass"), "; ".join(changes)
        (rank / "dump.json").write_bytes(raw)
        check(seed, f"{version} {kind} dump.json: {what}", target, baseline)
        shutil.rmtree(target)
        runs += 1
    print(f"{runs} mutated dump.json files")
    assert runs > 10


def test_fuzz_tensor_dump(baselines: dict[Any, Any], tmp_path: Path) -> None:
    runs = 0
    for seed in seeds():
        rng = random.Random(seed)
        baseline, doc = baselines[(rng.choice(["8.3.3", "26.2.0"]), "tensor_L1")]
        files = sorted((next(baseline.glob("step0/*")) / "dump_tensor_data").iterdir())
        target = tmp_path / str(seed)
        shutil.copytree(baseline, target)
        rank = next(target.glob("step0/*"))
        victim = rank / "dump_tensor_data" / rng.choice(files).name
        choice = rng.randrange(3)
        if choice == 0:
            raw, what = mutate_bytes(victim.read_bytes(), rng)
        elif choice == 1:
            raw, what = mutate_archive(victim.read_bytes(), rng)
        else:
            mutated, changes = mutate_doc(doc, rng)
            (rank / "dump.json").write_text(json.dumps(mutated))
            raw, what = victim.read_bytes(), "dump.json: " + "; ".join(changes)
        victim.write_bytes(raw)
        check(seed, f"{victim.name}: {what}", target, baseline)
        shutil.rmtree(target)
        runs += 1
    print(f"{runs} mutated tensor dumps")
    assert runs > 10


def test_fuzz_tensor_files(baselines: dict[Any, Any], tmp_path: Path) -> None:
    """open_tensor on mutated real .pt files, reading their values too: DumpFormatError or the values."""
    files = [
        f
        for v in ("8.3.3", "26.2.0")
        for f in (baselines[(v, "tensor_L1")][0]).glob("step0/*/dump_tensor_data/*")
    ]
    runs = 0
    for seed in seeds():
        rng = random.Random(seed)
        source = rng.choice(files)
        raw = source.read_bytes()
        for _ in range(rng.randint(1, 2)):
            raw, what = (mutate_archive if rng.random() < 0.5 else mutate_bytes)(raw, rng)
        path = tmp_path / "t.pt"
        path.write_bytes(raw)
        try:
            tensor = open_tensor(path)
            values = tensor.read()
            assert values.size == tensor.numel * (2 if tensor.dtype.startswith("complex") else 1)
        except DumpFormatError as exc:
            if exc.path != str(path):
                fail(seed, f"{source.name}: {what}: the error names {exc.path}, not the file")
        except Exception as exc:
            fail(seed, f"{source.name}: {what}", exc)
        runs += 1
    print(f"{runs} mutated tensor files")
    assert runs > 10
