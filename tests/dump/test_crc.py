"""CRC-32 from zlib-ng: the values of zlib's (msprobe's md5 field, zip records), from any buffer."""

from __future__ import annotations

import os
import zlib

import numpy as np
import torch

from pytest_msprobe.format import crc


def test_the_checksum_is_zlib_s_for_every_kind_of_buffer() -> None:
    data = os.urandom(1 << 20)
    assert crc.crc32_hex(data) == f"{zlib.crc32(data):08x}"
    assert crc.crc32_hex(b"") == f"{zlib.crc32(b''):08x}" == "00000000"
    array = np.arange(1000, dtype=np.float32)
    assert crc.crc32_hex(array) == f"{zlib.crc32(array.tobytes()):08x}"
    view = memoryview(data)[17:4099]
    assert crc.crc32_hex(view) == f"{zlib.crc32(bytes(view)):08x}"
    t = torch.arange(12, dtype=torch.int64).view(torch.uint8).numpy()
    assert crc.crc32_hex(t) == f"{zlib.crc32(t.tobytes()):08x}"


def test_zlib_ng_is_used_where_it_is_installed() -> None:
    # a dependency of the plugin: the fast path is the one the test environment runs
    assert crc.FAST


def test_a_large_non_contiguous_tensors_crc_is_of_its_row_major_bytes_taken_a_piece_at_a_time() -> None:
    from pytest_msprobe.dump.checksums import crc32_hex
    from pytest_msprobe.dump.reductions import PIECE, pieces

    t = torch.randn(3000, 1500, generator=torch.Generator().manual_seed(2)).t()  # 4.5M elements, transposed
    assert len(pieces(t)) > 1 and max(p.numel() for p in pieces(t)) <= PIECE
    assert crc32_hex(t) == f"{zlib.crc32(t.contiguous().numpy().tobytes()):08x}"
    assert crc32_hex(t[::2]) == f"{zlib.crc32(t[::2].contiguous().numpy().tobytes()):08x}"
