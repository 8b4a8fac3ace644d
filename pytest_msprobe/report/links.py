"""Links from a page to the report files, made to survive the move to a CI artifact.

A CI job uploads the pytest-html report and the msprobe output folder together, and whoever opens them has
them in another folder on another machine: an absolute ``file://`` link points at the runner. A link is
therefore relative to the folder of the page that holds it (URL-quoted: parametrized test folders hold ``[``
and ``]``). A page that must stand alone (pytest-html's ``--self-contained-html``) embeds each file as a
``data:`` link that downloads it, up to :data:`EMBED_LIMIT` per file; a larger file keeps its relative link,
marked as not embedded.
"""

from __future__ import annotations

import base64
import html
import mimetypes
import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

EMBED_LIMIT = (
    4 * 1024 * 1024
)  # bytes of one file embedded in a self-contained page (a base64 link is 4/3 of it)

XLSX_MIME = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"
_MIME = {
    ".xlsx": XLSX_MIME,
    ".txt": "text/plain",
    ".json": "application/json",
    ".csv": "text/csv",
    ".html": "text/html",
}


def relative_href(path: str | os.PathLike[str], base: str | os.PathLike[str]) -> str:
    """The URL of ``path`` relative to the folder ``base``; a ``file://`` URL where no relative path leads
    there (another drive)."""
    try:
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(base))
    except ValueError:
        return Path(path).resolve().as_uri()
    return urllib.parse.quote(Path(rel).as_posix(), safe="/")


def data_href(path: str | os.PathLike[str]) -> str | None:
    """A ``data:`` URL holding the file, None when it is larger than :data:`EMBED_LIMIT` or unreadable."""
    try:
        if os.path.getsize(path) > EMBED_LIMIT:
            return None
        raw = Path(path).read_bytes()
    except OSError:
        return None
    suffix = Path(path).suffix.lower()
    mime = _MIME.get(suffix) or mimetypes.guess_type(Path(path).name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(raw).decode('ascii')}"


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _file_size(path: str | os.PathLike[str]) -> str:
    try:
        return _size(os.path.getsize(path))
    except OSError:
        return "unreadable"


@dataclass(frozen=True)
class Links:
    """How a page links the report files: relative to ``base`` (the page's folder; None: absolute ``file://``
    URLs, for a page that is not saved anywhere), or embedded in the page (``embed``)."""

    base: str | None = None
    embed: bool = False

    def href(self, path: str | os.PathLike[str]) -> str:
        if self.base is None:
            return Path(path).resolve().as_uri()
        return relative_href(path, self.base)

    def anchor(self, label: str, path: str | os.PathLike[str]) -> str:
        """``<a>`` to the file: a download of the embedded file, or a link beside the page."""
        text = html.escape(label)
        if self.embed:
            data = data_href(path)
            if data is not None:
                name = html.escape(Path(path).name)
                return f'<a class="msprobe-embedded" download="{name}" href="{data}">{text}</a>'
            note = (
                f"not embedded ({_file_size(path)}, over the {_size(EMBED_LIMIT)} limit): opens with the "
                "msprobe output folder beside this page"
            )
            return f'<a href="{html.escape(self.href(path))}">{text}</a> <i>({html.escape(note)})</i>'
        return f'<a href="{html.escape(self.href(path))}">{text}</a>'
