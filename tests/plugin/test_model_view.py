"""The model view page as a browser draws it: headless Chromium opens the page from disk (``file://``), runs its
script, and the DOM it dumps and the screenshot it takes are checked: the first divergence highlighted and
opened, a search and a call's rows given by the URL fragment, and a page that is not blank. Also the page of a
test run, linked from its pytest-html row."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pytest
from chromium import CHROMIUM, png_size_and_ink, probe, run_chromium
from plugin_sources import BASE

from pytest_msprobe.compare import compare
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.report import write_reports

DATA = Path(__file__).resolve().parents[1] / "data" / "msprobe" / "msprobe-26.2.0" / "dumps"
RELU = "Functional.relu.2.forward"

needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian package chromium)")


class Dom(HTMLParser):
    """The tree's nodes and calls as drawn (each with its enclosing node), the rows table, the match count."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.nodes: list[dict[str, str]] = []  # li.node: class, data-path, parent path
        self.calls: list[dict[str, str]] = []  # li.call: class, text, node path
        self.rows: list[list[str]] = []
        self.details = ""
        self.matches = ""
        self._stack: list[tuple[str, dict[str, str]]] = []
        self._cell: list[str] | None = None
        self._call: dict[str, str] | None = None
        self._in: str | None = None
        self.feed(text)

    def _node_path(self) -> str:
        return next((a["data-path"] for t, a in reversed(self._stack) if "data-path" in a), "")

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        classes = a.get("class", "").split()
        if tag == "li" and "node" in classes:
            self.nodes.append({"class": a["class"], "path": a["data-path"], "parent": self._node_path()})
        elif tag == "li" and "call" in classes:
            self._call = {"class": a["class"], "text": "", "node": self._node_path()}
            self.calls.append(self._call)
        elif tag == "tr" and self._in == "details":
            self.rows.append([])
        elif tag == "td" and self.rows:
            self._cell = []
        elif a.get("id") in ("details", "matches"):
            self._in = a["id"]
        if tag not in ("br", "input", "meta", "option", "wbr"):
            self._stack.append((tag, a))

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None
        if tag == "li":
            self._call = None
        while self._stack:
            t, a = self._stack.pop()
            if a.get("id") == self._in:
                self._in = None
            if t == tag:
                break

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._call is not None:
            self._call["text"] += data
        if self._in == "details":
            self.details += data
        elif self._in == "matches":
            self.matches += data


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> tuple[CompareResult, Path]:
    """Two steps of msprobe 26.2.0's L1 dumps compared (layer1's relu perturbed), and its model view."""
    result = compare(DATA / "npu" / "stat_L1", DATA / "bench" / "stat_L1", jobs=1)
    return result, Path(write_reports(result, tmp_path_factory.mktemp("reports"))["model"])


@pytest.fixture
def page(compared: tuple[CompareResult, Path]) -> Path:
    return compared[1]


def _dom(page: Path, profile: Path, fragment: str = "") -> Dom:
    return Dom(run_chromium(profile, page.as_uri() + fragment, "--dump-dom"))


@needs_chromium
def test_the_first_divergence_is_highlighted_opened_and_its_rows_shown(page: Path, tmp_path: Path) -> None:
    dom = _dom(page, tmp_path / "profile")
    fd_nodes = [n for n in dom.nodes if "fd" in n["class"].split()]
    assert [n["path"] for n in fd_nodes] == ["model.layer1"]
    assert "open" in fd_nodes[0]["class"].split() and "band-over" in fd_nodes[0]["class"].split()
    opened = {n["path"] for n in dom.nodes if "open" in n["class"].split()}
    assert {"model", "model.layer1"} <= opened and "model.layer2" not in opened  # the rest stays closed
    top = [n["path"] for n in dom.nodes if n["parent"] == ""]
    assert top == ["model", "loss_fn", "(optimizer)"]  # in the order of their first call
    (fd_call,) = [c for c in dom.calls if "fd-call" in c["class"].split()]
    assert (
        fd_call["text"].startswith(RELU) and "step 0" in fd_call["text"] and fd_call["node"] == "model.layer1"
    )
    assert "selected" in fd_call["class"].split()
    # its rows, the divergent output among them
    assert "(first divergence)" in dom.details and "module model.layer1; step 0, rank 0" in dom.details
    rows = {r[0]: r for r in dom.rows if r}
    assert rows[f"{RELU}.output.0"][1:2] == ["error"] and rows[f"{RELU}.output.0"][6:] == ["0", "0"]
    assert rows[f"{RELU}.input.0"][1] == "pass"


@needs_chromium
def test_a_search_in_the_fragment_filters_the_tree(page: Path, tmp_path: Path) -> None:
    dom = _dom(page, tmp_path / "profile", "#search=relu&step=1")
    assert dom.calls and all("relu" in c["text"].lower() and "step 1" in c["text"] for c in dom.calls)
    drawn = {n["path"] for n in dom.nodes}
    assert "model.relu" in drawn and "model.layer1" in drawn
    assert not {p for p in drawn if p.endswith(("conv1", "bn1", "fc"))}  # nothing that does not lead to relu
    assert not [n for n in dom.nodes if n["path"].startswith("(optimizer)")]
    assert dom.matches == f"1 modules and {len(dom.calls)} calls match"


@needs_chromium
def test_a_call_in_the_fragment_opens_its_rows(compared: tuple[CompareResult, Path], tmp_path: Path) -> None:
    result, page = compared
    name = "Functional.conv2d.3.forward"
    (api,) = [a for a in result.apis if a.api == name and a.step == 1]
    dom = _dom(page, tmp_path / "profile", f"#call={name}&step=1")
    (selected,) = [c for c in dom.calls if "selected" in c["class"].split()]
    assert selected["text"].startswith(name) and "step 1" in selected["text"]
    assert selected["node"] == "model.layer2.conv1"
    assert dom.details.startswith(name) and "step 1, rank 0" in dom.details
    rows = [r for r in dom.rows if r]
    assert [r[:2] for r in rows] == [[result.rows[i].row, result.rows[i].status] for i in api.rows]
    assert f"{name}.output.0" in [r[0] for r in rows]
    assert all(r[6:] == ["1", "0"] for r in rows)  # step and rank columns


@needs_chromium
def test_a_node_in_the_fragment_is_opened(page: Path, tmp_path: Path) -> None:
    dom = _dom(page, tmp_path / "profile", "#node=model.layer2.downsample")
    opened = [n["path"] for n in dom.nodes if "open" in n["class"].split()]
    assert {"model.layer2", "model.layer2.downsample"} <= set(opened)
    assert {n["path"] for n in dom.nodes if n["parent"] == "model.layer2.downsample"} == {
        "model.layer2.downsample.0",
        "model.layer2.downsample.1",
    }


# each name of the details pane (row names, the module), as its rendered lines: a new line where a character's
# box drops below the one before it
LINES = """
const range = document.createRange(), out = [];
for (const code of document.querySelectorAll("#details code")) {
  const lines = [""];
  let top = null;
  const walk = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
  for (let n = walk.nextNode(); n; n = walk.nextNode())
    for (let i = 0; i < n.length; i++) {
      range.setStart(n, i);
      range.setEnd(n, i + 1);
      const box = range.getBoundingClientRect();
      if (top !== null && box.top > top + 2) lines.push("");
      top = box.top;
      lines[lines.length - 1] += n.data[i];
    }
  out.push(lines);
}
return out;
"""


@needs_chromium
def test_a_narrow_pane_wraps_names_only_after_a_dot_or_underscore(
    compared: tuple[CompareResult, Path], tmp_path: Path
) -> None:
    result, page = compared
    name = "Functional.batch_norm.2.forward"
    (api,) = [a for a in result.apis if a.api == name and a.step == 0]
    names = probe(page, LINES, tmp_path / "profile", f"#call={name}&step=0", size="560,900")
    rows = {"".join(lines): lines for lines in names}
    assert {result.rows[i].row for i in api.rows} <= set(rows)
    wrapped = [lines for lines in names if len(lines) > 1]
    assert wrapped, f"nothing wrapped at this width: {names}"
    for lines in wrapped:
        assert all(line[-1] in "._" for line in lines[:-1]), f"a name broken inside a word: {lines}"


@needs_chromium
def test_the_page_draws(page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "model.png"
    run_chromium(tmp_path / "profile", page.as_uri(), f"--screenshot={shot}", size="1280,900")
    width, height, ink = png_size_and_ink(shot.read_bytes())
    assert (width, height) == (1280, 900)
    assert ink > 0.02, f"the screenshot is blank ({ink:.4f} of pixels drawn)"


def test_a_test_run_writes_the_page_and_links_it_from_its_html_row(
    pytester: pytest.Pytester, train_test, fault_plugin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train_test()
    pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-regen-baseline").assert_outcomes(passed=1)
    monkeypatch.setenv("FAULT_SCALE", "0.01")
    report = pytester.path / "report.html"
    result = pytester.runpytest(*BASE, "-p", fault_plugin, "--msprobe-baseline=bl", f"--html={report}")
    result.assert_outcomes(failed=1)
    (model,) = (pytester.path / "msprobe-output").rglob("model_*.html")
    assert model.name in report.read_text() and "model view (html)" in report.read_text()
    if CHROMIUM is None:
        return
    dom = _dom(model, tmp_path / "profile")
    (fd_call,) = [c for c in dom.calls if "fd-call" in c["class"].split()]
    assert fd_call["text"].startswith("Functional.relu.1.forward") and fd_call["node"] == "model"
    assert [n["path"] for n in dom.nodes if "fd" in n["class"].split()] == ["model"]
