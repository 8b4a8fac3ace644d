"""A corpus of broken and hostile dumps, each with the exact error it must get.

Every unusable input must end the same way in all three entry points: ``compare()`` raises
:class:`DumpFormatError` with the right ``.path`` and ``.problem``; the CLI exits 2 with the one line
``pytest-msprobe: error: <path>: <problem>`` and writes nothing into OUT (not even a partial report);
``validate()`` raises the same error. The dumps are built here from copies of msprobe 8.3.3's real dumps
(``tests/data/msprobe``); the baseline is always the untouched real dump.

Steps or ranks present on one side only, and NaN/Inf, are not unusable input: they are compared, and their
verdicts are checked at the end of this file.
"""

from __future__ import annotations

import builtins
import json
import os
import pickle
import shutil
import struct
import subprocess
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from compare_helpers import dump_dir, tensor, write_dump

from pytest_msprobe.cli import main
from pytest_msprobe.compare import compare, validate
from pytest_msprobe.compare.dumps import open_tensor
from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format import files as load_module
from pytest_msprobe.format import tensorfile as tensorfile_module
from pytest_msprobe.report import write_reports

BENCH_STAT = dump_dir("8.3.3", "bench", "stat_L1")
BENCH_TENSOR = dump_dir("8.3.3", "bench", "tensor_L1", 0)
FIRST = "Functional.conv2d.0.forward"  # the first call of both real dumps
FIRST_ROW = f"{FIRST}.input.0"  # its first tensor: [8, 3, 16, 16] float32
FIRST_FILE = f"{FIRST_ROW}.pt"
OTHER_FILE = f"{FIRST}.input.1.pt"  # the conv weight: [8, 3, 3, 3] float32


@dataclass(frozen=True)
class Broken:
    """An unusable target dump and the error every entry point must give for it."""

    target: Path
    path: str | os.PathLike[str]
    problem: str
    baseline: Path = BENCH_STAT


# ------------------------------------------------------------------------------------------------ builders
def stat_copy(tmp: Path) -> tuple[Path, Path]:
    """A copy of the clean statistics dump (both steps): (dump root, step 0's dump.json)."""
    root = tmp / "target"
    shutil.copytree(BENCH_STAT, root)
    return root, root / "step0" / "rank" / "dump.json"


def tensor_copy(tmp: Path) -> tuple[Path, Path]:
    """A copy of the clean tensor dump (step 0): (dump root, its dump.json)."""
    root = tmp / "target"
    shutil.copytree(BENCH_TENSOR, root / "step0")
    return root, root / "step0" / "rank" / "dump.json"


def edit(dump_json: Path, change: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads(dump_json.read_text())
    change(doc)
    dump_json.write_text(json.dumps(doc))


def first_item(doc: dict[str, Any]) -> dict[str, Any]:
    item: dict[str, Any] = doc["data"][FIRST]["input_args"][0]
    return item


def json_case(text: str | bytes, problem: str) -> Callable[[Path], Broken]:
    def make(tmp: Path) -> Broken:
        root, dump_json = stat_copy(tmp)
        dump_json.write_bytes(text if isinstance(text, bytes) else text.encode())
        return Broken(root, dump_json, problem)

    return make


def item_case(change: Callable[[dict[str, Any]], None], problem: str) -> Callable[[Path], Broken]:
    """The first tensor record changed by ``change``: the error names the row."""

    def make(tmp: Path) -> Broken:
        root, dump_json = stat_copy(tmp)
        edit(dump_json, lambda doc: change(first_item(doc)))
        return Broken(root, dump_json, f"{FIRST_ROW}: {problem}")

    return make


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda item: item.__setitem__(key, value)


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda item: item.pop(key)


def tensor_file_case(
    damage: Callable[[Path, Path], tuple[str | os.PathLike[str], str]],
) -> Callable[[Path], Broken]:
    """The first tensor file of the tensor dump damaged by ``damage(file, tmp)``, which returns the error."""

    def make(tmp: Path) -> Broken:
        root, _ = tensor_copy(tmp)
        path, problem = damage(root / "step0" / "rank" / "dump_tensor_data" / FIRST_FILE, tmp)
        return Broken(root, path, problem, BENCH_TENSOR.parent)

    return make


def data_name_case(name: str, problem: str) -> Callable[[Path], Broken]:
    def make(tmp: Path) -> Broken:
        root, dump_json = tensor_copy(tmp)
        edit(dump_json, lambda doc: first_item(doc).__setitem__("data_name", name))
        return Broken(root, dump_json, problem.format(name=name), BENCH_TENSOR.parent)

    return make


def torch_archive(path: Path, pickled: bytes, storage: bytes = b"", name: str = "archive") -> Path:
    """A zip laid out as torch.save lays it out, with the given data.pkl and storage bytes."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/data.pkl", pickled)
        z.writestr(f"{name}/byteorder", "little")
        z.writestr(f"{name}/data/0", storage)
    return path


def _int(n: int) -> bytes:
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    size = (n.bit_length() + 8) // 8
    return b"\x8a" + bytes([size]) + n.to_bytes(size, "little", signed=True)


def _ints(values: tuple[int, ...]) -> bytes:
    return b"(" + b"".join(_int(v) for v in values) + b"t"


def tensor_pickle(numel: int, shape: tuple[int, ...], stride: tuple[int, ...], offset: int = 0) -> bytes:
    """The data.pkl torch.save writes for a float32 tensor, with any storage size, shape and stride."""
    storage = (
        b"(X\x07\x00\x00\x00storage" + b"ctorch\nFloatStorage\n" + b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpu"
    )
    return (
        b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n("
        + storage
        + _int(numel)
        + b"tQ"
        + _int(offset)
        + _ints(shape)
        + _ints(stride)
        + b"\x89ccollections\nOrderedDict\n)Rt"
        + b"R."
    )


class _Payload:
    """Pickles as a call of ``func(*args)``: what a hostile tensor file would run on load."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (self.func, self.args)


def _global(func: Any) -> str:
    return f"{func.__module__}.{func.__qualname__}"


# --------------------------------------------------------------------------------------- the corpus: dump.json
def _symlink_loop(tmp: Path) -> Broken:
    root, dump_json = stat_copy(tmp)
    dump_json.unlink()
    os.symlink(dump_json, dump_json)
    return Broken(root, dump_json, "symbolic link loop")


def _dump_json_is_a_folder(tmp: Path) -> Broken:
    root, dump_json = stat_copy(tmp)
    dump_json.unlink()
    dump_json.mkdir()
    return Broken(root, dump_json, "is a folder, not a file")


def _empty_step_folder(tmp: Path) -> Broken:
    root, _ = stat_copy(tmp)
    shutil.rmtree(root / "step1" / "rank")
    return Broken(
        root, root / "step1", "step folder holds no rank folder with a dump.json (rank, rank{R}, proc{PID})"
    )


def _rank_without_dump_json(tmp: Path) -> Broken:
    root, dump_json = stat_copy(tmp)
    dump_json.unlink()
    return Broken(root, dump_json.parent, "rank folder holds no dump.json (an interrupted dump?)")


def _root_without_steps(tmp: Path) -> Broken:
    root = tmp / "target"
    (root / "logs").mkdir(parents=True)
    return Broken(
        root,
        root,
        "no dump.json found: expected a dump.json, a rank folder (rank, rank{R}, proc{PID}), "
        "a step folder holding rank folders, or a dump root holding step{N} folders",
    )


def _dangling_target(tmp: Path) -> Broken:
    link = tmp / "target"
    os.symlink(tmp / "nowhere", link)
    return Broken(link, link, f"symbolic link to {str(tmp / 'nowhere')!r}, which does not exist")


def _deep_arguments(tmp: Path) -> Broken:
    root, dump_json = stat_copy(tmp)
    nested: Any = None
    for _ in range(70):
        nested = [nested]
    edit(dump_json, lambda doc: doc["data"][FIRST]["input_args"].insert(0, nested))
    suffix = ".input" + ".0" * 65
    return Broken(root, dump_json, f"{FIRST}{suffix}: arguments nested more than 64 levels deep")


def _truncated(tmp: Path) -> Broken:
    root, dump_json = stat_copy(tmp)
    dump_json.write_bytes(dump_json.read_bytes()[:5000])
    return Broken(root, dump_json, "invalid JSON: truncated, the text ends at byte 5000 inside the document")


def _not_utf8(tmp: Path) -> Broken:
    root, dump_json = stat_copy(tmp)
    raw = dump_json.read_bytes()
    at = raw.index(b"Functional.conv2d.0.forward") + 3
    dump_json.write_bytes(raw[:at] + b"\xff" + raw[at + 1 :])
    return Broken(root, dump_json, f"not UTF-8 text (byte 0xff at offset {at})")


CORPUS: dict[str, Callable[[Path], Broken]] = {
    # the file itself
    "truncated": _truncated,
    "not-utf8": _not_utf8,
    "empty-file": json_case(b"", "empty file"),
    "whitespace": json_case(b" \n\t", "holds only whitespace, no JSON"),
    "not-json": json_case("model weights, honest", "invalid JSON at line 1 column 1: Expecting value"),
    "json-garbage-after": json_case('{"data": {}} trailing', "invalid JSON at line 1 column 14: Extra data"),
    "too-deep-to-parse": json_case("[" * 100_000, "invalid JSON: nested too deeply to parse"),
    "huge-integer": json_case(
        '{"data": {"A.b.0.forward": {"output": [1' + "0" * 5000 + "]}}}",
        "invalid JSON (Exceeds the limit (4300 digits) for integer string conversion: value has 5001 digits; "
        "use sys.set_int_max_str_digits() to increase the limit)",
    ),
    "a-folder": _dump_json_is_a_folder,
    "symlink-loop": _symlink_loop,
    # the document
    "array": json_case("[1, 2]", "top level is an array, not an object: not a msprobe dump.json"),
    "string": json_case('"data"', "top level is a string, not an object: not a msprobe dump.json"),
    "no-data": json_case('{"task": "statistics"}', "no 'data' key: not a msprobe dump.json"),
    "data-a-list": json_case('{"data": []}', "'data' is an array, expected an object of API calls"),
    "data-null": json_case('{"data": null}', "'data' is null, expected an object of API calls"),
    "data-empty": json_case(
        '{"task": "statistics", "data": {}}', "'data' is empty: no API call was recorded"
    ),
    "task-unknown": json_case(
        '{"task": "free_benchmark", "data": {"A.b.0.forward": {}}}',
        "unsupported task 'free_benchmark' (expected 'statistics', 'tensor' or 'overflow_check')",
    ),
    "task-a-list": json_case(
        '{"task": ["tensor"], "data": {"A.b.0.forward": {}}}',
        "unsupported task ['tensor'] (expected 'statistics', 'tensor' or 'overflow_check')",
    ),
    "entry-a-string": json_case(
        '{"data": {"A.b.0.forward": "relu"}}', "A.b.0.forward: entry is a string, not an object"
    ),
    "entry-a-list": json_case(
        '{"data": {"A.b.0.forward": [1]}}', "A.b.0.forward: entry is an array, not an object"
    ),
    "deep-arguments": _deep_arguments,
    # a tensor record
    "no-dtype": item_case(_drop("dtype"), "tensor record has no 'dtype'"),
    "no-shape": item_case(_drop("shape"), "tensor record has no 'shape'"),
    "dtype-a-number": item_case(_set("dtype", 5), "dtype 5 is not a string"),
    "shape-a-string": item_case(_set("shape", "8x3"), "shape '8x3' is not a list of sizes"),
    "shape-negative": item_case(_set("shape", [8, -3]), "shape [8, -3] has a negative size"),
    "shape-float": item_case(
        _set("shape", [8, 2.5]), "shape [8, 2.5] has a size that is not a whole number: 2.5"
    ),
    "shape-bool": item_case(
        _set("shape", [True]), "shape [True] has a size that is not a whole number: True"
    ),
    "shape-1e12": item_case(
        _set("shape", [1_000_000, 1_000_000]),
        "shape [1000000, 1000000] of torch.float32 holds 1e+12 elements, more than 1 TiB: no device holds it",
    ),
    "shape-64-dims": item_case(_set("shape", [1] * 64), "shape has 64 dimensions (at most 32)"),
    "max-a-string": item_case(_set("Max", "large"), "Max is 'large', not a number"),
    "norm-a-list": item_case(_set("Norm", [1.0]), "Norm is [1.0], not a number"),
    "mean-overflows": item_case(_set("Mean", 10**400), "Mean " + repr(10**400)[:57] + "... is out of range"),
    "data-name-a-number": item_case(_set("data_name", 7), "data_name 7 is not a file name"),
    # the layout
    "empty-step-folder": _empty_step_folder,
    "rank-without-dump-json": _rank_without_dump_json,
    "root-without-steps": _root_without_steps,
    "dangling-target": _dangling_target,
}


# ------------------------------------------------------------------------------------- the corpus: tensor files
def _missing(file: Path, tmp: Path) -> tuple[Path, str]:
    file.unlink()
    return file, "tensor file named in dump.json is missing"


def _empty(file: Path, tmp: Path) -> tuple[Path, str]:
    file.write_bytes(b"")
    return file, "empty file (0 bytes)"


def _text(file: Path, tmp: Path) -> tuple[Path, str]:
    file.write_text("not a tensor")
    return file, "not a tensor file (neither a torch.save archive nor a .npy file)"


def _truncated_zip(file: Path, tmp: Path) -> tuple[Path, str]:
    file.write_bytes(file.read_bytes()[:1500])
    return file, "corrupt torch archive (File is not a zip file)"


def _data_beyond_the_file(file: Path, tmp: Path) -> tuple[Path, str]:
    """The archive's directory claims more storage bytes than the file holds (a copy cut short and patched,
    or a hostile archive): refused when opened, before any value is read."""
    torch_archive(file, tensor_pickle(6144, (8, 3, 16, 16), (768, 256, 16, 1)), b"\0" * 256)
    raw = bytearray(file.read_bytes())
    with zipfile.ZipFile(file) as z:
        member = z.getinfo("archive/data/0")
    entry = raw.index(b"archive/data/0", raw.index(b"PK\x01\x02")) - 46
    raw[entry + 20 : entry + 28] = struct.pack("<II", 24576, 24576)  # compressed and uncompressed sizes
    file.write_bytes(bytes(raw))
    start = member.header_offset + 30 + len(member.filename) + len(member.extra)
    return (
        file,
        f"tensor data is truncated (its storage needs 24576 bytes from offset {start}, the file has {len(raw)})",
    )


def _data_member_short(file: Path, tmp: Path) -> tuple[Path, str]:
    # the pickle says 6144 floats, the archive stores 64 of them
    torch_archive(file, tensor_pickle(6144, (8, 3, 16, 16), (768, 256, 16, 1)), b"\0" * 256)
    return file, "storage is larger than the bytes stored for it"


def _zip_not_torch(file: Path, tmp: Path) -> tuple[Path, str]:
    with zipfile.ZipFile(file, "w") as z:
        z.writestr("readme.txt", "hello")
    return file, "not a torch.save archive (no <name>/data.pkl)"


def _hostile(func: Any, *args: Any) -> Callable[[Path, Path], tuple[Path, str]]:
    def damage(file: Path, tmp: Path) -> tuple[Path, str]:
        torch_archive(file, pickle.dumps(_Payload(func, *args), protocol=4))
        return file, f"refused to load: refused global {_global(func)} (only plain tensors are loaded)"

    return damage


def _huge_storage(file: Path, tmp: Path) -> tuple[Path, str]:
    torch_archive(file, tensor_pickle(2**50, (8, 3, 16, 16), (768, 256, 16, 1)), b"\0" * 64)
    return file, "storage is larger than the bytes stored for it"


def _negative_storage(file: Path, tmp: Path) -> tuple[Path, str]:
    torch_archive(file, tensor_pickle(-5, (8, 3, 16, 16), (768, 256, 16, 1)), b"\0" * 64)
    return (
        file,
        "refused to load: malformed storage reference ('storage', _StorageClass(dtype='float32'), '0', 'cpu', -5)",
    )


def _bytearray_bomb(file: Path, tmp: Path) -> tuple[Path, str]:
    # protocol 5's BYTEARRAY8 declaring 8 GiB: CPython's unpickler would allocate it before reading
    torch_archive(file, b"\x80\x05\x96" + struct.pack("<Q", 1 << 33) + b"abc.")
    return file, "refused to load: expected 8589934592 bytes in a bytearray8, but only 4 remain"


def _bytearray(file: Path, tmp: Path) -> tuple[Path, str]:
    torch_archive(file, b"\x80\x05\x96" + struct.pack("<Q", 3) + b"abc.")
    return file, "refused to load: refused opcode BYTEARRAY8 at byte 2"


def _short_storage(file: Path, tmp: Path) -> tuple[Path, str]:
    # the pickle is honest about its storage (64 floats) but the tensor needs 6144 of them
    torch_archive(file, tensor_pickle(64, (8, 3, 16, 16), (768, 256, 16, 1)), b"\0" * 256)
    return file, "tensor of shape [8, 3, 16, 16] does not fit its storage of 64 elements"


def _other_shape(file: Path, tmp: Path) -> tuple[Path, str]:
    shutil.copyfile(file.parent / OTHER_FILE, file)
    return (
        file,
        "holds a float32 tensor of shape [8, 3, 3, 3], but dump.json says torch.float32 of shape [8, 3, 16, 16]",
    )


def _npy_with_objects(file: Path, tmp: Path) -> tuple[Path, str]:
    marker = tmp / "pwned"
    array = np.array([_Payload(os.system, f"touch {marker}")], dtype=object)
    with open(file, "wb") as fh:
        np.save(fh, array, allow_pickle=True)
    return file, "not a readable .npy file (Array can't be memory-mapped: Python objects in dtype.)"


def _a_folder(file: Path, tmp: Path) -> tuple[Path, str]:
    file.unlink()
    file.mkdir()
    return file, "is a folder, not a tensor file"


def _fifo(file: Path, tmp: Path) -> tuple[Path, str]:
    file.unlink()
    os.mkfifo(file)  # reading it would block forever
    return file, "not a regular file"


def _link_out(file: Path, tmp: Path) -> tuple[Path, str]:
    outside = tmp / "outside.pt"
    shutil.copyfile(file, outside)
    file.unlink()
    os.symlink(outside, file)
    return file.parents[1] / "dump.json", f"data_name {FIRST_FILE!r} leaves the dump folder (through a link)"


def _tensor_dir_linked_out(file: Path, tmp: Path) -> tuple[Path, str]:
    folder = file.parent
    shutil.move(folder, tmp / "elsewhere")
    os.symlink(tmp / "elsewhere", folder)
    return file.parents[1] / "dump.json", f"data_name {FIRST_FILE!r} leaves the dump folder (through a link)"


def _link_loop(file: Path, tmp: Path) -> tuple[Path, str]:
    file.unlink()
    os.symlink(file.name, file)
    return file, "symbolic link loop"


def _dtype_lie(tmp: Path) -> Broken:
    root, dump_json = tensor_copy(tmp)
    edit(dump_json, lambda doc: first_item(doc).__setitem__("dtype", "torch.float16"))
    file = os.path.realpath(root / "step0" / "rank" / "dump_tensor_data" / FIRST_FILE)
    problem = "holds a float32 tensor of shape [8, 3, 16, 16], but dump.json says torch.float16 of shape [8, 3, 16, 16]"
    return Broken(root, file, problem, BENCH_TENSOR.parent)


TENSOR_CORPUS: dict[str, Callable[[Path], Broken]] = {
    "missing": tensor_file_case(_missing),
    "empty": tensor_file_case(_empty),
    "text": tensor_file_case(_text),
    "truncated-zip": tensor_file_case(_truncated_zip),
    "data-beyond-the-file": tensor_file_case(_data_beyond_the_file),
    "data-member-short": tensor_file_case(_data_member_short),
    "zip-not-torch": tensor_file_case(_zip_not_torch),
    "pickle-os-system": tensor_file_case(_hostile(os.system, "touch pwned-by-os-system")),
    "pickle-eval": tensor_file_case(_hostile(eval, "__import__('os').system('touch pwned-by-eval')")),
    "pickle-subprocess": tensor_file_case(_hostile(subprocess.Popen, ["touch", "pwned-by-popen"])),
    "pickle-huge-storage": tensor_file_case(_huge_storage),
    "pickle-negative-storage": tensor_file_case(_negative_storage),
    "storage-too-short": tensor_file_case(_short_storage),
    "pickle-bytearray-bomb": tensor_file_case(_bytearray_bomb),
    "pickle-bytearray": tensor_file_case(_bytearray),
    "other-shape": tensor_file_case(_other_shape),
    "other-dtype": _dtype_lie,
    "npy-with-objects": tensor_file_case(_npy_with_objects),
    "a-folder": tensor_file_case(_a_folder),
    "fifo": tensor_file_case(_fifo),
    "symlink-out": tensor_file_case(_link_out),
    "tensor-dir-linked-out": tensor_file_case(_tensor_dir_linked_out),
    "symlink-loop": tensor_file_case(_link_loop),
    "data-name-dotdot": data_name_case("../../../../etc/passwd", "data_name {name!r} leaves the dump folder"),
    "data-name-inner-dotdot": data_name_case(
        "sub/../../dump.json", "data_name {name!r} leaves the dump folder"
    ),
    "data-name-absolute": data_name_case(
        "/etc/passwd", "data_name {name!r} is not a file name inside dump_tensor_data"
    ),
    "data-name-nul": data_name_case(
        "x\0.pt", "data_name {name!r} is not a file name inside dump_tensor_data"
    ),
}


# ---------------------------------------------------------------------------------------------------- checks
def assert_unusable(case: Broken, tmp: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> None:
    """compare(), the CLI and validate() all refuse ``case`` with its exact error; OUT stays untouched."""
    path, problem = os.fspath(case.path), case.problem
    with pytest.raises(DumpFormatError) as info:
        compare(case.target, case.baseline)
    assert (info.value.path, info.value.problem) == (path, problem)

    out = tmp / "out"
    code = main(["compare", str(case.target), str(case.baseline), "-o", str(out), *extra])
    stdout, stderr = capsys.readouterr()
    assert (code, stdout) == (2, "")
    assert stderr == f"pytest-msprobe: error: {path}: {problem}\n"
    assert not out.exists()  # no report, not even the folder

    with pytest.raises(DumpFormatError) as info:
        validate(case.target)
    assert (info.value.path, info.value.problem) == (path, problem)


@pytest.mark.parametrize("name", list(CORPUS))
def test_broken_dump(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_unusable(CORPUS[name](tmp_path), tmp_path, capsys)


@pytest.mark.parametrize("name", list(CORPUS) + [f"tensor:{name}" for name in TENSOR_CORPUS])
def test_a_broken_baseline_gets_the_same_error(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same corpus given as the baseline (the target sound): the error names the baseline's file."""
    monkeypatch.chdir(tmp_path)
    broken = TENSOR_CORPUS[name[7:]](tmp_path) if name.startswith("tensor:") else CORPUS[name](tmp_path)
    with pytest.raises(DumpFormatError) as info:
        compare(broken.baseline, broken.target)
    assert (info.value.path, info.value.problem) == (os.fspath(broken.path), broken.problem)
    code = main(["compare", str(broken.baseline), str(broken.target), "-o", str(tmp_path / "out")])
    assert (
        code == 2 and capsys.readouterr().err == f"pytest-msprobe: error: {broken.path}: {broken.problem}\n"
    )
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("pwned*"))


@pytest.mark.parametrize("name", list(TENSOR_CORPUS))
def test_broken_tensor_file(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # where a payload that ran would leave its marker
    case = TENSOR_CORPUS[name](tmp_path)
    assert_unusable(case, tmp_path, capsys)
    assert not list(tmp_path.glob("pwned*"))  # no payload ever ran


@pytest.mark.parametrize("name", ["pickle-os-system", "other-shape", "data-beyond-the-file"])
def test_broken_tensor_file_read_by_worker_processes(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``-j 2`` the files are read in other processes: the error comes back the same."""
    monkeypatch.chdir(tmp_path)
    case = TENSOR_CORPUS[name](tmp_path)
    code = main(["compare", str(case.target), str(case.baseline), "-o", str(tmp_path / "out"), "-j", "2"])
    assert code == 2
    assert capsys.readouterr().err == f"pytest-msprobe: error: {case.path}: {case.problem}\n"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("pwned*"))


@pytest.mark.parametrize(
    "func, arg", [(os.system, "touch pwned"), (eval, "open('pwned', 'w')")], ids=["os-system", "eval"]
)
def test_the_payloads_are_live(func: Any, arg: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The corpus's hostile pickles do run their command under a plain unpickler (so the marker check above
    would see it): only the reader's refusal keeps them from running."""
    monkeypatch.chdir(tmp_path)
    file = tmp_path / "x.pt"
    _hostile(func, arg)(file, tmp_path)
    with zipfile.ZipFile(file) as z:
        pickle.loads(z.read("archive/data.pkl"))
    assert (tmp_path / "pwned").exists()


def test_a_pickle_declaring_gigabytes_allocates_nothing(tmp_path: Path) -> None:
    import tracemalloc

    path = tmp_path / "bomb.pt"
    _bytearray_bomb(path, tmp_path)
    tracemalloc.start()
    try:
        with pytest.raises(DumpFormatError, match="bytearray8"):
            open_tensor(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_the_hand_made_pickle_is_a_real_tensor(tmp_path: Path) -> None:
    """The corpus's hand-assembled archives are what torch.save writes: an honest one reads back."""
    values = np.arange(12, dtype="<f4")
    path = torch_archive(tmp_path / "ok.pt", tensor_pickle(12, (3, 4), (4, 1)), values.tobytes())
    np.testing.assert_array_equal(open_tensor(path, "torch.float32", [3, 4]).read(), values.reshape(3, 4))


def test_a_hostile_dump_runs_no_code_even_via_the_legacy_torch_path(tmp_path: Path) -> None:
    """Torch's pre-zip format goes to torch.load(weights_only=True), which refuses a hostile pickle too; a
    bare pickle without that format's magic number is not a tensor file at all (torch is not even imported)."""
    marker = tmp_path / "pwned"
    hostile = pickle.dumps(_Payload(os.system, f"touch {marker}"), protocol=2)
    path = tmp_path / "legacy.pt"
    for content in (pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + hostile * 4, hostile):
        path.write_bytes(content)
        with pytest.raises(DumpFormatError) as info:
            open_tensor(path)
        assert info.value.path == str(path) and not marker.exists()
        assert info.value.problem.startswith(
            "cannot load tensor" if content != hostile else "not a tensor file"
        )


# --------------------------------------------------------------------------------------------- unreadable files
def _deny(monkeypatch: pytest.MonkeyPatch, module: Any, victim: Path) -> None:
    """Make ``open`` in ``module`` fail on ``victim`` as chmod 000 would (root ignores the mode bits)."""
    real_open = builtins.open

    def fake_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(file) == os.fspath(victim):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(module, "open", fake_open, raising=False)


def test_unreadable_dump_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, dump_json = stat_copy(tmp_path)
    _deny(monkeypatch, load_module, dump_json)
    assert_unusable(Broken(root, dump_json, "cannot read (Permission denied)"), tmp_path, capsys)


def test_unreadable_tensor_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = tensor_copy(tmp_path)
    file = Path(os.path.realpath(root / "step0" / "rank" / "dump_tensor_data" / FIRST_FILE))
    _deny(monkeypatch, tensorfile_module, file)
    case = Broken(root, file, "cannot read tensor file (Permission denied)", BENCH_TENSOR.parent)
    assert_unusable(case, tmp_path, capsys)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads files whatever their mode"
)
def test_chmod_000(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, dump_json = stat_copy(tmp_path)
    dump_json.chmod(0)
    try:
        assert_unusable(Broken(root, dump_json, "cannot read (Permission denied)"), tmp_path, capsys)
    finally:
        dump_json.chmod(0o644)


# ------------------------------------------------------------------------------------------- partial reports
def test_no_partial_report_when_writing_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure after the xlsx is written (disk full at the advisor) leaves no report at all."""
    import pytest_msprobe.report as report

    result = compare(shutil.copytree(BENCH_STAT, tmp_path / "again"), BENCH_STAT)
    real = report.write_text

    def full_disk(path: Any, text: str) -> None:
        if "advisor" in os.fspath(path) or ".txt" in os.fspath(path):
            raise OSError(28, "No space left on device")
        real(path, text)

    monkeypatch.setattr(report, "write_text", full_disk)
    out = tmp_path / "out"
    with pytest.raises(Exception, match="No space left on device") as info:
        write_reports(result, out)
    assert "advisor_" in str(info.value)
    assert list(out.iterdir()) == []  # neither the finished xlsx nor any temporary file


def test_a_folder_of_old_reports_is_left_alone_by_a_refused_compare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text('{"passed": true}')
    root, dump_json = stat_copy(tmp_path)
    dump_json.write_text("{")
    assert main(["compare", str(root), str(BENCH_STAT), "-o", str(out)]) == 2
    capsys.readouterr()
    assert [p.name for p in out.iterdir()] == ["summary.json"]
    assert (out / "summary.json").read_text() == '{"passed": true}'


# ------------------------------------------------------------------------------------------ one side only
def _steps(tmp: Path, name: str, steps: list[int], ranks: list[str]) -> Path:
    root = tmp / name
    for step in steps:
        for rank in ranks:
            shutil.copytree(BENCH_STAT / f"step{step}" / "rank", root / f"step{step}" / rank)
    return root


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert err == "", err
    return code, out


def test_a_step_missing_in_the_target_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The baseline's step 1 is not in the target: the run under test stopped early. Exit 1, step 0 compared."""
    target, baseline = _steps(tmp_path, "t", [0], ["rank"]), _steps(tmp_path, "b", [0, 1], ["rank"])
    result = compare(target, baseline)
    assert not result.passed and result.failures == [] and [p.step for p in result.pairs] == [0]
    note = f"baseline step 1, rank 0 ({baseline / 'step1' / 'rank' / 'dump.json'}): not in the target"
    assert result.missing == (note,) and result.unpaired == (note,)
    code, out = _run(["compare", str(target), str(baseline), "-o", str(tmp_path / "out")], capsys)
    assert code == 1 and f"missing: {note}" in out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["passed"], summary["missing"], summary["counts"]["missing_dumps"]) == (False, [note], 1)


def test_a_step_only_the_target_has_is_reported_not_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, baseline = _steps(tmp_path, "t", [0, 1], ["rank"]), _steps(tmp_path, "b", [0], ["rank"])
    result = compare(target, baseline)
    note = f"target step 1, rank 0 ({target / 'step1' / 'rank' / 'dump.json'}): no baseline"
    assert result.passed and result.unpaired == (note,) and result.missing == ()
    code, out = _run(["compare", str(target), str(baseline), "-o", str(tmp_path / "out")], capsys)
    assert code == 0 and f"not compared: {note}" in out


def test_ranks_present_on_one_side_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    both = _steps(tmp_path, "both", [0], ["rank0", "rank1"])
    one = _steps(tmp_path, "one", [0], ["rank0"])
    lacking = compare(one, both)  # rank 1 died in the run under test
    assert not lacking.passed and len(lacking.missing) == 1 and "rank 1" in lacking.missing[0]
    assert [(p.step, p.rank) for p in lacking.pairs] == [(0, 0)]
    extra = compare(both, one)
    assert extra.passed and extra.missing == () and "rank 1" in extra.unpaired[0]
    assert _run(["compare", str(one), str(both), "-o", str(tmp_path / "o1")], capsys)[0] == 1
    assert _run(["compare", str(both), str(one), "-o", str(tmp_path / "o2")], capsys)[0] == 0


def test_the_failure_message_names_the_missing_step(tmp_path: Path) -> None:
    from pytest_msprobe.report.text import failure_message

    target, baseline = _steps(tmp_path, "t", [0], ["rank"]), _steps(tmp_path, "b", [0, 1], ["rank"])
    message = failure_message(compare(target, baseline), {}, baseline, "pytest x --msprobe-regen-baseline")
    lines = message.splitlines()
    assert lines[0].startswith("msprobe: the target lacks 1 step/rank dump(s) of the baseline; 0 of ")
    assert lines[1] == "missing in the target (1 dump(s) the baseline has):"
    assert (
        lines[2]
        == f"  baseline step 1, rank 0 ({baseline / 'step1' / 'rank' / 'dump.json'}): not in the target"
    )


# ------------------------------------------------------------------------------------------------- NaN / Inf
NAN, INF = float("nan"), float("inf")


def _stat_dump(tmp: Path, name: str, stats: tuple[float, float, float, float]) -> Path:
    data = {
        f"Functional.relu.{i}.forward": {
            "input_args": [tensor([4, 4], *stats[1::-1], *stats[2:])],
            "output": [tensor([4, 4], *stats[1::-1], *stats[2:])],
        }
        for i in range(3)
    }
    return write_dump(tmp / name / "step0" / "rank", data).parent.parent.parent


def test_statistics_nan_on_both_sides_fails_the_baseline_cannot_be_a_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """NaN in the baseline's statistics: the baseline overflowed, the same NaN in the target proves nothing."""
    both = _stat_dump(tmp_path, "t", (NAN, NAN, NAN, INF)), _stat_dump(tmp_path, "b", (NAN, NAN, NAN, INF))
    result = compare(*both)
    assert not result.passed
    assert {(r.status, r.reason) for r in result.rows} == {
        (
            "error",
            "the baseline's Max, Min and Mean are NaN for this non-empty tensor: the baseline itself overflowed, "
            "so it cannot be a reference; regenerate it from a healthy run",
        )
    }
    assert _run(["compare", *map(str, both), "-o", str(tmp_path / "out")], capsys)[0] == 1


def test_statistics_inf_on_both_sides_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same Inf on both sides is reproduced, so it passes; each row is a warning worth a look."""
    both = _stat_dump(tmp_path, "t", (INF, 0.0, INF, INF)), _stat_dump(tmp_path, "b", (INF, 0.0, INF, INF))
    result = compare(*both)
    assert result.passed
    assert {(r.status, r.reason) for r in result.rows} == {
        ("warning", "NaN/Inf in the same statistics on both sides")
    }
    assert _run(["compare", *map(str, both), "-o", str(tmp_path / "out")], capsys)[0] == 0


def test_statistics_nan_on_one_side_is_an_error_with_its_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = _stat_dump(tmp_path, "t", (NAN, NAN, NAN, NAN))
    baseline = _stat_dump(tmp_path, "b", (2.0, -1.0, 0.5, 3.0))
    result = compare(target, baseline)
    assert not result.passed and {r.status for r in result.rows} == {"error"}
    assert (
        result.rows[0].reason
        == "NaN/Inf on one side only (Max, Min, Mean, Norm: nan, nan, nan, nan vs 2, -1, 0.5, 3)"
    )
    assert result.first_divergence is not None and result.first_divergence.api == "Functional.relu.0.forward"
    assert _run(["compare", str(target), str(baseline), "-o", str(tmp_path / "out")], capsys)[0] == 1


def _npy_dump(tmp: Path, name: str, values: np.ndarray) -> Path:
    folder = tmp / name / "step0" / "rank"
    (folder / "dump_tensor_data").mkdir(parents=True)
    data = {}
    for i in range(2):
        file = f"Functional.relu.{i}.forward.output.0.npy"
        np.save(folder / "dump_tensor_data" / file, values)
        data[f"Functional.relu.{i}.forward"] = {
            "output": [tensor(list(values.shape), 0.0, 1.0, 0.5, 1.0, data_name=file)]
        }
    write_dump(folder, data, task="tensor")
    return tmp / name


def test_tensors_nan_at_the_same_positions_pass_and_elsewhere_fail(tmp_path: Path) -> None:
    base = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    same = base.copy()
    same[::3, ::2] = np.nan
    same[1, 1] = np.inf
    moved = same.copy()
    moved[0, 0], moved[0, 1] = moved[0, 1], moved[0, 0]
    a, b, c = (
        _npy_dump(tmp_path, "a", same),
        _npy_dump(tmp_path, "b", same.copy()),
        _npy_dump(tmp_path, "c", moved),
    )

    result = compare(a, b)
    assert result.mode == "tensor" and result.passed
    assert {r.reason for r in result.rows} == {"NaN/Inf at the same positions on both sides (set to 0)"}

    result = compare(c, b)
    assert not result.passed and {r.status for r in result.rows} == {"error"}
    assert {r.reason for r in result.rows} == {"NaN/Inf at different positions (or with other values)"}
    assert all(r.tensor is not None and r.tensor.cosine is None for r in result.rows)


def test_all_nan_tensors_on_both_sides_pass(tmp_path: Path) -> None:
    nan = np.full((4, 4), np.nan, dtype=np.float32)
    result = compare(_npy_dump(tmp_path, "a", nan), _npy_dump(tmp_path, "b", nan))
    assert result.passed and {r.status for r in result.rows} == {"warning"}
