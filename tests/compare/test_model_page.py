"""The model view's data and page (pytest_msprobe.report.model) and the error plot's steps and legend, on
msprobe's real dumps; the page's behaviour in a browser is checked in tests/plugin/test_model_view.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from compare_helpers import dump_dir, rank_dir

import pytest_msprobe.report.model as model_page
from pytest_msprobe.compare import compare
from pytest_msprobe.compare.judging import PASS
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.report import write_reports
from pytest_msprobe.report.html import (
    DIVERGENCE_LABEL,
    STEP_BOUNDARY,
    api_ratios,
    error_plot_figure,
    html_fragment,
)
from pytest_msprobe.report.model import model_data, model_html


@pytest.fixture(scope="module")
def l1() -> CompareResult:
    """Two steps of msprobe 26.2.0's L1 statistics dumps, the relu of layer1 perturbed."""
    return compare(dump_dir("26.2.0", "npu", "stat_L1"), dump_dir("26.2.0", "bench", "stat_L1"), jobs=1)


def _node_paths(data: dict[str, Any]) -> list[tuple[str, ...]]:
    paths: list[tuple[str, ...]] = [()]
    for label, parent, _ in data["nodes"][1:]:
        paths.append((*paths[parent], label))
    return paths


def test_the_data_holds_every_call_in_its_module_in_execution_order(l1: CompareResult) -> None:
    data = model_data(l1)
    paths = _node_paths(data)
    assert len(set(paths)) == len(paths)
    assert all(data["nodes"][i][1] < i for i in range(1, len(paths)))  # each node after its parent
    by_order = sorted(l1.apis, key=lambda a: a.order)
    assert [c[0] for c in data["calls"]] == [a.api for a in by_order]
    assert [paths[c[1]] for c in data["calls"]] == [a.module for a in by_order]
    assert [(c[2], c[3]) for c in data["calls"]] == [(a.step, a.rank) for a in by_order]
    assert data["steps"] == [0, 1] and data["ranks"] == [0]
    ratios = api_ratios(l1)
    index = {id(a): i for i, a in enumerate(l1.apis)}
    assert [c[6] for c in data["calls"]] == [
        None if ratios[index[id(a)]] is None else pytest.approx(ratios[index[id(a)]], rel=1e-3)
        for a in by_order
    ]
    assert data["sources"] == [model_page.SOURCES["stack.json"]]
    assert (
        data["nodes"][paths.index(("model", "layer1"))][2] == "called at make_dumps.py:78: x = self.layer1(x)"
    )


def test_the_first_divergence_and_its_rows(l1: CompareResult) -> None:
    data = model_data(l1)
    fd = l1.first_divergence
    assert fd is not None
    first = data["first"]
    call = data["calls"][first["call"]]
    assert (call[0], call[2]) == (fd.api, fd.step)
    assert _node_paths(data)[call[1]] == ("model", "layer1")
    strings = data["strings"]
    rows = data["rows"][call[8] : call[8] + call[9]]
    names = [r[0] if not r[0].startswith(".") else fd.api + r[0] for r in rows]
    api = l1.apis[fd.api_index]
    assert names == [l1.rows[i].row for i in api.rows]
    assert names[first["row"]] == fd.row and strings[rows[first["row"]][1]] == "error"
    assert fd.api in first["text"] and "step 0, rank 0" in first["text"]


def test_past_the_row_limit_only_the_rows_of_failing_calls_are_kept(
    l1: CompareResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = model_data(l1)
    assert full["omitted_rows"] == 0 and len(full["rows"]) == len(l1.rows)
    monkeypatch.setattr(model_page, "MAX_ROWS", 100)
    data = model_data(l1)
    kept = sum(c[9] for c in data["calls"])
    assert kept == len(data["rows"]) <= 100 + len(l1.apis[l1.first_divergence.api_index].rows)  # type: ignore[union-attr]
    assert data["omitted_rows"] == len(l1.rows) - kept > 0
    statuses = {data["strings"][c[5]] for c in data["calls"] if c[9]}
    assert PASS not in statuses
    assert data["calls"][data["first"]["call"]][9] > 0  # the first divergence's rows are always there
    assert len(model_html(l1)) < len(json.dumps(full)) + 30_000  # the page is its data and a fixed frame


def test_reports_include_the_page_standalone(l1: CompareResult, tmp_path: Path) -> None:
    paths = write_reports(l1, tmp_path)
    page = Path(paths["model"])
    assert page.name == f"model_{l1.timestamp}.html" and page.parent == tmp_path
    text = page.read_text(encoding="utf-8")
    # one file: nothing fetched (no src/href, no imports, no fonts from anywhere)
    assert not re.search(r"\b(?:src|href)\s*=|@import|url\(", text)
    assert '<script type="application/json" id="data">' in text
    embedded = text.split('id="data">', 1)[1].split("</script>", 1)[0]
    assert json.loads(embedded) == json.loads(json.dumps(model_data(l1)))
    # linked from the pytest-html fragment with the other reports
    fragment = html_fragment(l1, paths, "advice")
    assert "model view (html)" in fragment and page.name in fragment


def test_a_name_that_could_end_the_script_stays_in_the_data(l1: CompareResult) -> None:
    import dataclasses

    api = dataclasses.replace(l1.apis[0], api="</script><b>x")
    result = dataclasses.replace(l1, apis=(api, *l1.apis[1:]))
    text = model_html(result)
    assert text.count("</script>") == 2  # the data's own and the code's
    embedded = text.split('id="data">', 1)[1].split("</script>", 1)[0]
    assert "</script><b>x" in [c[0] for c in json.loads(embedded)["calls"]]


def _ranks(tmp_path: Path, side: str) -> Path:
    """msprobe 26.2.0's mix dumps of both steps copied as two ranks of one run."""
    root = tmp_path / side
    for step in (0, 1):
        for rank in (0, 1):
            shutil.copytree(rank_dir("26.2.0", side, "stat_mix", step), root / f"step{step}" / f"rank{rank}")
    return root


def test_several_ranks_and_steps_are_told_apart(tmp_path: Path) -> None:
    result = compare(_ranks(tmp_path, "npu"), _ranks(tmp_path, "bench"), jobs=2)
    data = model_data(result)
    assert data["steps"] == [0, 1] and data["ranks"] == [0, 1]
    seen = {(c[2], c[3]) for c in data["calls"] if c[0] == "Functional.relu.2.forward"}
    assert seen == {(0, 0), (0, 1), (1, 0), (1, 1)}
    paths = _node_paths(data)
    assert {paths[c[1]] for c in data["calls"] if c[0] == "Functional.relu.2.forward"} == {("layer1",)}
    assert data["nodes"][paths.index(("layer1",))][2] == "BasicBlock"


def test_the_plot_marks_steps_and_keeps_its_legend_off_the_points(l1: CompareResult) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = error_plot_figure(l1)
    try:
        (ax,) = fig.axes
        order = sorted(l1.apis, key=lambda a: a.order)
        first_of_step1 = next(i for i, a in enumerate(order) if a.step == 1)
        boundaries = [line.get_xdata()[0] for line in ax.lines if line.get_gid() == STEP_BOUNDARY]
        assert boundaries == [first_of_step1 - 0.5]
        labels = [t.get_text() for t in ax.texts]
        assert "step 0" in labels and "step 1" in labels
        fig.canvas.draw()
        legend = ax.get_legend().get_window_extent()
        fd = l1.first_divergence
        assert fd is not None
        fd_x, fd_y = ax.transData.transform((order.index(l1.apis[fd.api_index]), 1.0))
        assert not legend.contains(fd_x, fd_y)
        # nowhere over the data: every drawn point is left of it
        for collection in ax.collections:
            xs = ax.transData.transform(collection.get_offsets())[:, 0]
            assert (xs < legend.x0).all()
        # the first divergence's label stays inside the figure
        label = next(t for t in ax.texts if t.get_text().startswith("first divergence"))
        box = label.get_window_extent()
        assert box.x0 >= 0 and box.x1 <= fig.bbox.x1 and not box.overlaps(legend)
    finally:
        plt.close(fig)


def _label_covers_no_point(fig: Any) -> None:
    """Each axes' first-divergence label lies above its plotted area, clear of every drawn point (a marker's
    box, not only its centre), of every line's vertices and of the title."""
    fig.canvas.draw()
    labelled = 0
    for ax in fig.axes:
        for label in [t for t in ax.texts if t.get_gid() == DIVERGENCE_LABEL]:
            labelled += 1
            box = label.get_window_extent()
            assert box.y0 >= ax.get_window_extent().y1  # above the axes, where nothing is plotted
            assert not box.overlaps(ax.title.get_window_extent())
            for collection in ax.collections:
                # a marker's radius in pixels, from its area in points squared
                radius = max(collection.get_sizes()) ** 0.5 / 2 * fig.dpi / 72
                for x, y in ax.transData.transform(collection.get_offsets()):
                    assert not (
                        box.x0 - radius <= x <= box.x1 + radius and box.y0 - radius <= y <= box.y1 + radius
                    ), f"the label covers the point at ({x:.0f}, {y:.0f})"
    assert labelled


def test_the_first_divergence_label_covers_no_point(l1: CompareResult) -> None:
    pytest.importorskip("matplotlib")
    import dataclasses

    import matplotlib.pyplot as plt

    # early, late, and in the middle of the calls: the label is never over the data
    order = sorted(range(len(l1.apis)), key=lambda i: l1.apis[i].order)
    for index in (None, order[-1], order[len(order) // 2]):
        result = l1
        if index is not None:
            fd = dataclasses.replace(l1.first_divergence, api_index=index, api=l1.apis[index].api)  # type: ignore[type-var]
            result = dataclasses.replace(l1, first_divergence=fd)
        fig = error_plot_figure(result)
        try:
            _label_covers_no_point(fig)
        finally:
            plt.close(fig)


def test_a_late_first_divergence_keeps_its_label_inside(l1: CompareResult) -> None:
    pytest.importorskip("matplotlib")
    import dataclasses

    import matplotlib.pyplot as plt

    last = max(range(len(l1.apis)), key=lambda i: l1.apis[i].order)
    fd = dataclasses.replace(l1.first_divergence, api_index=last, api=l1.apis[last].api)  # type: ignore[type-var]
    fig = error_plot_figure(dataclasses.replace(l1, first_divergence=fd))
    try:
        (ax,) = fig.axes
        fig.canvas.draw()
        label = next(t for t in ax.texts if t.get_text().startswith("first divergence"))
        box, axes = label.get_window_extent(), ax.get_window_extent()
        assert box.x0 >= axes.x0 and box.x1 <= axes.x1
    finally:
        plt.close(fig)


@pytest.mark.parametrize("first", [3, 20, 38])
def test_the_trend_plots_label_covers_no_point(monkeypatch: pytest.MonkeyPatch, first: int) -> None:
    """Both panels of the trend plot label the first divergent step above their axes, clear of the curves."""
    pytest.importorskip("matplotlib")
    import pytest_msprobe.report.html as report_html
    from pytest_msprobe.compare.trend.compare import compare_trend
    from pytest_msprobe.format.trendfile import TrendData, TrendStep

    def trend(loss: list[float]) -> TrendData:
        return TrendData(
            "float32", ("fc",), tuple(TrendStep(i, v, v / 2, (v / 4,)) for i, v in enumerate(loss))
        )

    curve = [2.3 - 0.05 * i for i in range(40)]
    drifted = [v * (1.05 if i >= first else 1.0) for i, v in enumerate(curve)]
    result = compare_trend(trend(drifted), trend(curve), 40)
    assert result.first_step == first
    checked: list[Any] = []

    def png(fig: Any) -> bytes:  # the figure, checked before it is saved and closed
        _label_covers_no_point(fig)
        checked.append(fig)
        return b""

    monkeypatch.setattr(report_html, "_png", png)
    report_html.trend_plot_png(result)
    assert len(checked) == 1 and len(checked[0].axes) == 2
