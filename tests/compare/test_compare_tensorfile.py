"""The torch-free tensor reader, checked against torch.load(weights_only=True)."""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from compare_helpers import DATA

from pytest_msprobe.compare.dumps import open_tensor
from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.tensordata import compute_dtype

torch = pytest.importorskip("torch")


def expected(t: Any) -> np.ndarray:
    """What the reader should give for a tensor: its values widened the way the reader widens them."""
    t = t.detach().contiguous()
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16):
        return t.float().numpy()
    if t.is_complex():
        return torch.view_as_real(t).numpy().astype(compute_dtype(str(t.dtype)[6:]))
    if t.dtype == torch.bool:
        return t.numpy().astype(np.float32)
    return t.numpy().astype(compute_dtype(str(t.dtype)[6:]))


def save(tmp_path: Path, t: Any, name: str = "t.pt", **kwargs: Any) -> Path:
    path = tmp_path / name
    torch.save(t, path, **kwargs)
    return path


def test_every_real_dumped_tensor_reads_as_torch_loads_it() -> None:
    files = sorted(DATA.glob("msprobe-*/dumps/*/tensor_L1/step0/*/dump_tensor_data/*.pt"))
    assert len(files) > 800
    for f in files:
        ours = open_tensor(f).read()
        theirs = torch.load(f, weights_only=True)
        np.testing.assert_array_equal(ours, expected(theirs), err_msg=str(f))
        assert ours.shape == tuple(theirs.shape)


DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype(tmp_path: Path, dtype: Any) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g) * 8
    if dtype.is_complex:
        t = torch.complex(base, -base).to(dtype)
    elif dtype == torch.bool:
        t = base > 0
    elif dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        t = base.abs().to(torch.int64).to(dtype)
    else:
        t = base.to(dtype)
    tf = open_tensor(save(tmp_path, t))
    assert tf.dtype == str(dtype).replace("torch.", "")
    assert tf.shape == (3, 5)
    got = tf.read()
    want = expected(t)
    if dtype.is_complex:
        want = want.reshape(3, 5, 2)
    np.testing.assert_array_equal(got, want)


def test_float8_special_values(tmp_path: Path) -> None:
    t = torch.tensor([0.0, -0.0, 448.0, -448.0, float("nan"), 2.0**-9], dtype=torch.float8_e4m3fn)
    np.testing.assert_array_equal(open_tensor(save(tmp_path, t)).read(), t.float().numpy())
    t = torch.tensor([float("inf"), float("-inf"), 57344.0, float("nan"), 2.0**-16], dtype=torch.float8_e5m2)
    np.testing.assert_array_equal(open_tensor(save(tmp_path, t)).read(), t.float().numpy())


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(24.0).reshape(4, 6).t(),  # transposed: strides with gaps
        lambda: torch.arange(24.0).reshape(4, 6)[1:3, 2:],  # storage offset and row gaps
        lambda: torch.arange(24.0)[5:17],  # storage offset, contiguous
        lambda: torch.arange(3.0).expand(4, 3),  # stride 0
        lambda: torch.tensor(2.5),  # 0-d
        lambda: torch.zeros(0, 3),  # empty
        lambda: torch.nn.Parameter(torch.ones(2, 2)),  # a saved Parameter
    ],
    ids=["transposed", "offset-gaps", "offset", "expanded", "0-d", "empty", "parameter"],
)
def test_views_offsets_strides(tmp_path: Path, make: object) -> None:
    t = make()  # type: ignore[operator]
    tf = open_tensor(save(tmp_path, t))
    np.testing.assert_array_equal(tf.read(), expected(t))
    assert tf.shape == tuple(t.shape)


def test_blocks_stream_the_values_in_order(tmp_path: Path) -> None:
    t = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    tf = open_tensor(save(tmp_path, t))
    parts = [b.copy() for b in tf.blocks(64)]
    assert [len(p) for p in parts[:-1]] == [64] * (len(parts) - 1)
    np.testing.assert_array_equal(np.concatenate(parts), t.numpy())


def test_legacy_torch_format_falls_back_to_torch_load(tmp_path: Path) -> None:
    t = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    path = save(tmp_path, t, _use_new_zipfile_serialization=False)
    assert not zipfile.is_zipfile(path)
    np.testing.assert_array_equal(open_tensor(path).read(), t.numpy())


def _rewrite(src: Path, dst: Path, edit: dict[str, bytes | None], compress: int = zipfile.ZIP_STORED) -> Path:
    """Copy a torch archive member by member, replacing (bytes) or dropping (None) some members."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compression=compress) as zout:
        for info in zin.infolist():
            tail = info.filename.split("/", 1)[1]
            if tail in edit:
                if edit[tail] is not None:
                    zout.writestr(info.filename, edit[tail])  # type: ignore[arg-type]
            else:
                zout.writestr(info.filename, zin.read(info.filename))
    return dst


def test_big_endian_archive(tmp_path: Path) -> None:
    t = torch.randn(2, 3, generator=torch.Generator().manual_seed(3))
    src = save(tmp_path, t)
    swapped = t.numpy().astype(">f4").tobytes()
    dst = _rewrite(src, tmp_path / "big.pt", {"byteorder": b"big", "data/0": swapped})
    np.testing.assert_array_equal(open_tensor(dst).read(), t.numpy())


def test_compressed_member(tmp_path: Path) -> None:
    t = torch.arange(10.0)
    dst = _rewrite(save(tmp_path, t), tmp_path / "deflated.pt", {}, compress=zipfile.ZIP_DEFLATED)
    np.testing.assert_array_equal(open_tensor(dst).read(), t.numpy())


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _archive_with_pickle(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", b"\0" * 16)
    return path


def test_hostile_pickle_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = _archive_with_pickle(tmp_path / "evil.pt", pickle.dumps(_Evil(marker), protocol=2))
    with pytest.raises(DumpFormatError) as info:
        open_tensor(path)
    assert "refused" in info.value.problem and "system" in info.value.problem
    assert info.value.path == str(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload",
    [pickle.dumps({"a": 1}), pickle.dumps([1, 2]), pickle.dumps(eval, protocol=2)],
    ids=["dict", "list", "builtin"],
)
def test_pickles_of_other_things_are_refused(tmp_path: Path, payload: bytes) -> None:
    with pytest.raises(DumpFormatError, match="refused"):
        open_tensor(_archive_with_pickle(tmp_path / "x.pt", payload))


def test_shape_larger_than_storage_is_refused(tmp_path: Path) -> None:
    t = torch.zeros(64)
    src = save(tmp_path, t)
    # keep the pickle (64 elements) but store only 16 bytes for the storage
    dst = _rewrite(src, tmp_path / "short.pt", {"data/0": b"\0" * 16})
    with pytest.raises(DumpFormatError, match="larger than the bytes"):
        open_tensor(dst)


def test_view_beyond_its_storage_is_refused(tmp_path: Path) -> None:
    big = torch.zeros(4, 4)
    small = torch.zeros(4)
    src_big, src_small = save(tmp_path, big, "big.pt"), save(tmp_path, small, "small.pt")
    with zipfile.ZipFile(src_big) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    # the 4x4 pickle says numel 16; swap in a 4-element storage and a pickle claiming 4 elements
    pkl = pkl.replace(b"K\x10t", b"K\x04t")
    dst = _rewrite(src_small, tmp_path / "lie.pt", {"data.pkl": pkl})
    with pytest.raises(DumpFormatError, match="does not fit its storage"):
        open_tensor(dst)


def test_missing_storage_member(tmp_path: Path) -> None:
    dst = _rewrite(save(tmp_path, torch.zeros(3)), tmp_path / "nostorage.pt", {"data/0": None})
    with pytest.raises(DumpFormatError, match="missing from the archive"):
        open_tensor(dst)


def test_npy_files(tmp_path: Path) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(tmp_path / "a.npy", a)
    tf = open_tensor(tmp_path / "a.npy")
    assert (tf.dtype, tf.shape) == ("float32", (3, 4))
    np.testing.assert_array_equal(tf.read(), a)
    np.save(tmp_path / "i.npy", np.arange(5, dtype=np.int64))
    np.testing.assert_array_equal(open_tensor(tmp_path / "i.npy").read(), np.arange(5.0))
    np.save(tmp_path / "b.npy", np.arange(5, dtype=">f4"))
    np.testing.assert_array_equal(open_tensor(tmp_path / "b.npy").read(), np.arange(5.0))


def test_object_npy_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(DumpFormatError, match=r"\.npy"):
        open_tensor(tmp_path / "o.npy")


@pytest.mark.parametrize(
    "content", [b"", b"hello world", b"PK\x03\x04garbage"], ids=["empty", "text", "bad-zip"]
)
def test_garbage_files(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "g.pt"
    path.write_bytes(content)
    with pytest.raises(DumpFormatError) as info:
        open_tensor(path)
    assert info.value.path == str(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DumpFormatError, match="cannot read"):
        open_tensor(tmp_path / "absent.pt")
