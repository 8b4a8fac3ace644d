"""Headless Chromium for the tests that look at a page as a browser draws it (Debian package ``chromium``;
the tests skip without it): the flags, the rendered DOM, a screenshot, and how much of a PNG is drawn."""

from __future__ import annotations

import html
import json
import shutil
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def run_chromium(profile: Path, url: str, *args: str, size: str = "1280,2000", budget: int = 5000) -> str:
    """Chromium's stdout for ``url`` (``--dump-dom`` gives the DOM after the page's scripts ran)."""
    assert CHROMIUM is not None
    return subprocess.run(
        [
            CHROMIUM,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size}",
            f"--virtual-time-budget={budget}",
            *args,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout


PROBE = "probe-result"  # the id of the element a probe script writes its JSON into


def probe(page: Path, script: str, profile: Path, fragment: str = "", **kwargs: Any) -> Any:
    """What ``script`` measures in ``page`` as Chromium lays it out: the script runs a while after the page
    loaded (its own scripts drawn), and returns a JSON-able value; a copy of the page beside it (so that its
    relative links hold) carries the script. For what the DOM alone cannot tell: computed styles, line boxes."""
    runner = (
        '<script>window.addEventListener("load", () => setTimeout(() => {'
        f'const out = document.createElement("pre"); out.id = "{PROBE}";'
        f"out.textContent = JSON.stringify((() => {{ {script} }})()); document.body.appendChild(out);"
        "}, 1000));</script>"
    )
    text = page.read_text(encoding="utf-8")
    at = text.rindex("</body>")
    copy = page.with_name(f"probe-{page.name}")
    copy.write_text(text[:at] + runner + text[at:], encoding="utf-8")
    dom = run_chromium(profile, copy.as_uri() + fragment, "--dump-dom", **kwargs)
    start = dom.index(f'<pre id="{PROBE}">') + len(f'<pre id="{PROBE}">')
    return json.loads(html.unescape(dom[start : dom.index("</pre>", start)]))


def png_size_and_ink(data: bytes) -> tuple[int, int, float]:
    """Width, height and the share of pixels that are not near-white, from a PNG (8-bit RGB/RGBA)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, ctype = 8, b"", 0, 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, _depth, ctype = struct.unpack(">IIBB", body[:10])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    channels = {2: 3, 6: 4}[ctype]
    raw = zlib.decompress(idat)
    stride = width * channels
    ink = 0
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for x in range(stride):  # undo PNG filters
            a = line[x - channels] if x >= channels else 0
            b = prev[x]
            c = prev[x - channels] if x >= channels else 0
            if f == 1:
                line[x] = (line[x] + a) & 0xFF
            elif f == 2:
                line[x] = (line[x] + b) & 0xFF
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        ink += sum(1 for x in range(0, stride, channels) if min(line[x : x + 3]) < 200)
        prev = line
    return width, height, ink / (width * height)
