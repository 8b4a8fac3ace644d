"""A minimal SpreadsheetML (.xlsx) writer: rows of plain values, a few row styles, a frozen header.

A compare of a real model has 10^5 rows and more; openpyxl takes ~7 µs a cell (and 0.2 s to import), this
writer ~1 µs. It writes only what the reports need: inline strings, numbers, booleans, one style per row
(header, red, yellow, grey, bold red), column widths, a frozen pane and an autofilter. Files are written to a
temporary name and renamed, so a reader never sees half a workbook.
"""

from __future__ import annotations

import functools
import math
import os
import re
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape

from pytest_msprobe.format.files import atomic_path

# style ids (cellXfs indices in styles.xml below)
PLAIN, HEADER, RED, YELLOW, GREY, BOLD_RED, BOLD = 0, 1, 2, 3, 4, 5, 6
RED_RGB, YELLOW_RGB, GREY_RGB = "FFFF0000", "FFFFFF00", "FFD9D9D9"

MAX_ROWS = 1_048_576  # Excel's limit, header included
MAX_CELL = 32_767  # Excel's limit on the characters of a cell

_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")
_NS = 'xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main"'
_NS_R = 'xmlns:r="http://schemas.openxmlformats.org/officeDocument/2006/relationships"'
_HEAD = '<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n'


@dataclass
class Sheet:
    """One worksheet: a header row, data rows with a style each, column widths and frozen panes."""

    name: str
    header: Sequence[str]
    rows: Iterable[Sequence[Any]]
    styles: Iterable[int] = ()  # one per row; missing -> PLAIN
    widths: Sequence[float] = ()
    freeze_cols: int = 0  # columns kept visible left of the frozen pane (the header row is always frozen)
    written: int = field(default=0, init=False)  # data rows written (set by write_xlsx)


def column_letter(index: int) -> str:
    """1 -> A, 27 -> AA."""
    letters = ""
    while index:
        index, rem = divmod(index - 1, 26)
        letters = chr(65 + rem) + letters
    return letters


@functools.lru_cache(maxsize=1 << 16)
def _text(value: str) -> str:
    """A string as the content of an inline-string cell (legal XML characters, escaped, Excel's length)."""
    text = _ILLEGAL.sub("", value)
    if len(text) > MAX_CELL:
        text = text[: MAX_CELL - 3] + "..."
    space = ' xml:space="preserve"' if text[:1].isspace() or text[-1:].isspace() or "\n" in text else ""
    return f"<t{space}>{escape(text)}</t>"


def _cells(refs: Sequence[str], values: Sequence[Any], row: int, style: int) -> str:
    """The <c> elements of one row (the hot loop of a big report: plain type dispatch, cached strings)."""
    s = f' s="{style}"' if style else ""
    parts = []
    for ref, value in zip(refs, values):
        kind = type(value)
        if kind is str:
            parts.append(f'<c r="{ref}{row}"{s} t="inlineStr"><is>{_text(value)}</is></c>')
        elif kind is float:
            if math.isfinite(value):
                parts.append(f'<c r="{ref}{row}"{s}><v>{value!r}</v></c>')
            else:
                word = "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
                parts.append(f'<c r="{ref}{row}"{s} t="inlineStr"><is><t>{word}</t></is></c>')
        elif kind is bool:
            parts.append(f'<c r="{ref}{row}"{s} t="b"><v>{int(value)}</v></c>')
        elif kind is int:
            parts.append(f'<c r="{ref}{row}"{s}><v>{value}</v></c>')
        elif value is None:
            if style:
                parts.append(f'<c r="{ref}{row}"{s}/>')
        else:  # numpy numbers and anything else: as a float if it is one, else as text
            try:
                number = float(value)
            except (TypeError, ValueError):
                parts.append(f'<c r="{ref}{row}"{s} t="inlineStr"><is>{_text(str(value))}</is></c>')
            else:
                parts.append(_cells((ref,), (number,), row, style))
    return "".join(parts)


def _sheet_xml(sheet: Sheet, fh: Any) -> None:
    ncols = len(sheet.header)
    letters = [column_letter(i + 1) for i in range(ncols)]
    fh.write(f"{_HEAD}<worksheet {_NS} {_NS_R}>".encode())
    pane_col = column_letter(sheet.freeze_cols + 1)
    top_left = f"{pane_col}2"
    if sheet.freeze_cols:
        pane = (
            f'<pane xSplit="{sheet.freeze_cols}" ySplit="1" topLeftCell="{top_left}" activePane="bottomRight" '
            f'state="frozen"/><selection pane="topRight"/><selection pane="bottomLeft"/>'
            f'<selection pane="bottomRight" activeCell="{top_left}" sqref="{top_left}"/>'
        )
    else:
        pane = (
            '<pane ySplit="1" topLeftCell="A2" activePane="bottomLeft" state="frozen"/>'
            '<selection pane="bottomLeft" activeCell="A2" sqref="A2"/>'
        )
    fh.write(f'<sheetViews><sheetView workbookViewId="0">{pane}</sheetView></sheetViews>'.encode())
    fh.write(b'<sheetFormatPr defaultRowHeight="15"/>')
    if sheet.widths:
        cols = "".join(
            f'<col min="{i + 1}" max="{i + 1}" width="{w:g}" customWidth="1"/>'
            for i, w in enumerate(sheet.widths)
        )
        fh.write(f"<cols>{cols}</cols>".encode())
    fh.write(b"<sheetData>")
    header = _cells(letters, [str(h) for h in sheet.header], 1, HEADER)
    fh.write(f'<row r="1">{header}</row>'.encode())
    styles = iter(sheet.styles)
    r = 1
    buffer: list[str] = []
    for values in sheet.rows:
        if r + 1 > MAX_ROWS:
            break
        r += 1
        style = next(styles, PLAIN)
        buffer.append(f'<row r="{r}">{_cells(letters, values, r, style)}</row>')
        if len(buffer) >= 512:
            fh.write("".join(buffer).encode())
            buffer.clear()
    fh.write("".join(buffer).encode())
    fh.write(b"</sheetData>")
    last = f"{letters[-1]}{r}" if ncols else "A1"
    fh.write(f'<autoFilter ref="A1:{last}"/>'.encode())
    fh.write(
        b'<pageMargins left="0.75" right="0.75" top="1" bottom="1" header="0.5" footer="0.5"/></worksheet>'
    )
    sheet.written = r - 1


_STYLES = f"""{_HEAD}<styleSheet {_NS}>
<fonts count="2"><font><sz val="11"/><name val="Calibri"/><family val="2"/></font><font><b/><sz val="11"/><name val="Calibri"/><family val="2"/></font></fonts>
<fills count="6"><fill><patternFill patternType="none"/></fill><fill><patternFill patternType="gray125"/></fill><fill><patternFill patternType="solid"><fgColor rgb="{RED_RGB}"/><bgColor indexed="64"/></patternFill></fill><fill><patternFill patternType="solid"><fgColor rgb="{YELLOW_RGB}"/><bgColor indexed="64"/></patternFill></fill><fill><patternFill patternType="solid"><fgColor rgb="{GREY_RGB}"/><bgColor indexed="64"/></patternFill></fill><fill><patternFill patternType="solid"><fgColor rgb="FFDDEBF7"/><bgColor indexed="64"/></patternFill></fill></fills>
<borders count="1"><border><left/><right/><top/><bottom/><diagonal/></border></borders>
<cellStyleXfs count="1"><xf numFmtId="0" fontId="0" fillId="0" borderId="0"/></cellStyleXfs>
<cellXfs count="7"><xf numFmtId="0" fontId="0" fillId="0" borderId="0" xfId="0"/><xf numFmtId="0" fontId="1" fillId="5" borderId="0" xfId="0" applyFont="1" applyFill="1"/><xf numFmtId="0" fontId="0" fillId="2" borderId="0" xfId="0" applyFill="1"/><xf numFmtId="0" fontId="0" fillId="3" borderId="0" xfId="0" applyFill="1"/><xf numFmtId="0" fontId="0" fillId="4" borderId="0" xfId="0" applyFill="1"/><xf numFmtId="0" fontId="1" fillId="2" borderId="0" xfId="0" applyFont="1" applyFill="1"/><xf numFmtId="0" fontId="1" fillId="0" borderId="0" xfId="0" applyFont="1"/></cellXfs>
<cellStyles count="1"><cellStyle name="Normal" xfId="0" builtinId="0"/></cellStyles>
</styleSheet>"""


def write_xlsx(path: str | os.PathLike[str], sheets: Sequence[Sheet]) -> None:
    """Write a workbook atomically (temporary file in the same folder, then rename)."""
    with (
        atomic_path(path) as tmp,
        zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z,
    ):
        sheet_entries = "".join(
            f'<sheet name="{escape(s.name[:31])}" sheetId="{i + 1}" r:id="rId{i + 1}"/>'
            for i, s in enumerate(sheets)
        )
        for i, sheet in enumerate(sheets):
            with z.open(f"xl/worksheets/sheet{i + 1}.xml", "w", force_zip64=True) as fh:
                _sheet_xml(sheet, fh)
        names = "".join(
            f'<definedName name="_xlnm._FilterDatabase" localSheetId="{i}" hidden="1">'
            f"'{escape(s.name[:31])}'!$A$1:${column_letter(len(s.header))}${s.written + 1}</definedName>"
            for i, s in enumerate(sheets)
            if s.header
        )
        z.writestr(
            "xl/workbook.xml",
            f"{_HEAD}<workbook {_NS} {_NS_R}><bookViews><workbookView/></bookViews>"
            f"<sheets>{sheet_entries}</sheets><definedNames>{names}</definedNames></workbook>",
        )
        rels = "".join(
            f'<Relationship Id="rId{i + 1}" Type="http://schemas.openxmlformats.org/officeDocument/2006/'
            f'relationships/worksheet" Target="worksheets/sheet{i + 1}.xml"/>'
            for i in range(len(sheets))
        )
        rels += (
            f'<Relationship Id="rId{len(sheets) + 1}" Type="http://schemas.openxmlformats.org/officeDocument/'
            '2006/relationships/styles" Target="styles.xml"/>'
        )
        z.writestr(
            "xl/_rels/workbook.xml.rels",
            f'{_HEAD}<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
            f"{rels}</Relationships>",
        )
        z.writestr("xl/styles.xml", _STYLES)
        overrides = "".join(
            f'<Override PartName="/xl/worksheets/sheet{i + 1}.xml" ContentType="application/'
            'vnd.openxmlformats-officedocument.spreadsheetml.worksheet+xml"/>'
            for i in range(len(sheets))
        )
        z.writestr(
            "[Content_Types].xml",
            f'{_HEAD}<Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
            '<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
            '<Default Extension="xml" ContentType="application/xml"/>'
            '<Override PartName="/xl/workbook.xml" ContentType="application/'
            'vnd.openxmlformats-officedocument.spreadsheetml.sheet.main+xml"/>'
            '<Override PartName="/xl/styles.xml" ContentType="application/'
            'vnd.openxmlformats-officedocument.spreadsheetml.styles+xml"/>'
            f"{overrides}</Types>",
        )
        z.writestr(
            "_rels/.rels",
            f'{_HEAD}<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
            '<Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/'
            'relationships/officeDocument" Target="xl/workbook.xml"/></Relationships>',
        )
