"""The HTML view of a compare for pytest-html: advisor text, the failing rows, a plot, links to the files.

The plot shows, for every API call in execution order, how far its worst row is from its threshold (error /
allowed, log scale; 1 is the threshold), forward and backward calls in two colours, one marker per rank when
there are several, with the first divergence marked (and its rank named): where the error enters is the first
point above the line whose inputs were still below it.
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any

from pytest_msprobe.compare.judging import ERROR
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.compare.trend import TrendResult
from pytest_msprobe.report.links import Links
from pytest_msprobe.report.own_error_table import own_error_html
from pytest_msprobe.report.text import divergence_site, place, row_what

_FLOOR = 1e-6  # ratios below this are drawn at the floor (exactly equal rows have ratio 0)
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")  # one per rank, in rank order


def api_ratios(result: CompareResult) -> list[float | None]:
    """Per API call (``result.apis`` order): the largest error/allowed of its rows, None when none was measured."""
    ratios: list[float | None] = []
    for api in result.apis:
        best: float | None = None
        for i in api.rows:
            row = result.rows[i]
            if row.error is None or row.allowed is None or math.isnan(row.error):
                continue
            ratio = (
                math.inf
                if row.allowed == 0 and row.error > 0
                else row.error / row.allowed
                if row.allowed
                else 0.0
            )
            best = ratio if best is None else max(best, ratio)
        ratios.append(best)
    return ratios


def plot_title(result: CompareResult) -> str:
    """The plot's title: the verdict, and in a multi-rank compare the ranks and the first divergence's rank."""
    title = f"{result.mode} compare: {'passed' if result.verdict.passed else 'FAILED'}"
    ranks = sorted({a.rank for a in result.apis if a.rank is not None})
    if len(ranks) > 1:
        title += f", ranks {', '.join(map(str, ranks))}"
        fd = result.first_divergence
        if fd is not None and fd.rank is not None:
            title += f"; first divergence on rank {fd.rank}"
    return title


def error_plot_png(result: CompareResult) -> bytes | None:
    """A PNG of each API's error/allowed along execution order, or None without matplotlib or data."""
    try:
        import matplotlib.pyplot as plt
    except Exception:
        return None
    fig = error_plot_figure(result)
    if fig is None:
        return None
    try:
        return _png(fig)
    finally:
        plt.close(fig)


STEP_BOUNDARY = "step-boundary"  # the gid of the plot's lines where a new step starts


def step_starts(result: CompareResult, order: list[int]) -> list[tuple[int, int | None]]:
    """(position in ``order``, step) where each step starts along the execution order, when there are several."""
    starts: list[tuple[int, int | None]] = []
    for pos, i in enumerate(order):
        step = result.apis[i].step
        if not starts or step != starts[-1][1]:
            starts.append((pos, step))
    return starts if len(starts) > 1 else []


def error_plot_figure(result: CompareResult) -> Any:
    """The matplotlib figure of :func:`error_plot_png`, laid out (None without matplotlib or data): the
    caller closes it. Steps are marked where each starts; the legend sits outside the axes, so that it covers
    no point and never the first divergence's marker."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except Exception:
        return None
    ratios = api_ratios(result)
    order = sorted(range(len(result.apis)), key=lambda i: result.apis[i].order)
    points = [(pos, i, ratios[i]) for pos, i in enumerate(order) if ratios[i] is not None]
    if not points:
        return None
    ranks = sorted({a.rank for a in result.apis if a.rank is not None})
    several = len(ranks) > 1
    fig, ax = plt.subplots(figsize=(11, 3.6), dpi=100)
    try:
        # colour: direction; marker: rank (when there are several)
        for direction, colour in (("forward", "#1f77b4"), ("backward", "#ff7f0e")):
            for rank in ranks if several else [None]:
                chosen = [
                    (p, r)
                    for p, i, r in points
                    if (result.apis[i].direction or "forward") == direction
                    and (rank is None or result.apis[i].rank == rank)
                ]
                if not chosen:
                    continue
                label = direction if rank is None else f"{direction}, rank {rank}"
                marker = "o" if rank is None else _MARKERS[ranks.index(rank) % len(_MARKERS)]
                ax.scatter(
                    [p for p, _ in chosen],
                    [max(min(r or 0.0, 1e12), _FLOOR) for _, r in chosen],
                    s=9 if rank is None else 14,
                    c=colour,
                    marker=marker,
                    label=label,
                    zorder=3,
                )
        ax.axhline(1.0, color="#d62728", linewidth=1, linestyle="--", label="threshold")
        for pos, step in step_starts(result, order):
            if pos:
                ax.axvline(pos - 0.5, color="#555555", linewidth=0.8, linestyle=":", gid=STEP_BOUNDARY)
            ax.annotate(
                f"step {step}",
                xy=(pos, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -3),
                textcoords="offset points",
                va="top",
                fontsize=7,
                color="#555555",
            )
        fd = result.first_divergence
        if fd is not None:
            pos = order.index(fd.api_index)
            ax.axvline(pos, color="#d62728", linewidth=1.2)
            divergence_label(
                ax,
                pos,
                f"first divergence\n{fd.api}" + (f" (rank {fd.rank})" if several else ""),
                right=pos <= 0.6 * max(len(order) - 1, 1),
            )
        ax.set_yscale("log")
        ax.set_xlabel("API call, execution order (steps; forward, backward; ranks side by side)")
        ax.set_ylabel("error / allowed")
        ax.set_title(plot_title(result), fontsize=10, pad=LABEL_PAD if fd is not None else 6.0)
        # outside the axes, right of them: no point, and no first-divergence marker, is ever under it
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8, frameon=False)
        ax.grid(True, which="major", axis="y", alpha=0.3)
        fig.tight_layout()
        return fig
    except BaseException:
        plt.close(fig)
        raise


DIVERGENCE_LABEL = "first-divergence-label"  # the gid of the first divergence's label in the plots
LABEL_PAD = 30.0  # points between the axes and their title, where the first divergence's label sits


def divergence_label(ax: Any, x: float, text: str, right: bool = True) -> None:
    """The first divergence's label, above the axes at its line's top: out of the plotted area, so that it
    covers no point whatever the data; to the right of the line where there is room, else to its left (the
    title is raised by :data:`LABEL_PAD` to make room)."""
    ax.annotate(
        text,
        xy=(x, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(-2 if right else 2, 2),
        textcoords="offset points",
        ha="left" if right else "right",
        va="bottom",
        fontsize=8,
        color="#d62728",
        annotation_clip=False,
        gid=DIVERGENCE_LABEL,
    )


def _png(fig: Any) -> bytes:
    """A figure laid out and saved as PNG bytes."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def trend_plot_png(trend: TrendResult) -> bytes | None:
    """A PNG of both runs' loss and gradient norm per step, side by side, the first divergent step marked; None
    without matplotlib or steps."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except Exception:
        return None
    if not trend.rows:
        return None
    steps = [r.step for r in trend.rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2), dpi=100)
    try:
        panels = (
            ("loss", [r.target_loss for r in trend.rows], [r.baseline_loss for r in trend.rows]),
            (
                "gradient norm",
                [r.target_grad_norm for r in trend.rows],
                [r.baseline_grad_norm for r in trend.rows],
            ),
        )
        for ax, (name, target, baseline) in zip(axes, panels):
            nan = float("nan")
            ax.plot(steps, [nan if v is None else v for v in baseline], color="#1f77b4", label="baseline")
            ax.plot(
                steps,
                [nan if v is None else v for v in target],
                color="#ff7f0e",
                linestyle="--",
                label="target",
            )
            if trend.first_step is not None:
                ax.axvline(trend.first_step, color="#d62728", linewidth=1.2)
                divergence_label(
                    ax,
                    trend.first_step,
                    f"first divergence\nstep {trend.first_step}",
                    right=trend.first_step <= (min(steps) + max(steps)) / 2,
                )
            ax.set_xlabel("step")
            ax.set_title(name, fontsize=10, pad=LABEL_PAD if trend.first_step is not None else 6.0)
            ax.legend(loc="upper right", fontsize=8, frameon=False)
            ax.grid(True, alpha=0.3)
        return _png(fig)
    finally:
        plt.close(fig)


def trend_html(trend: TrendResult | None) -> str:
    """The trend's part of the fragment: its verdict and its plot (empty without a trend)."""
    if trend is None:
        return ""
    parts = [f'<p class="msprobe-trend">Trend: {html.escape(trend.headline)}</p>']
    png = trend_plot_png(trend)
    if png is not None:
        data = base64.b64encode(png).decode("ascii")
        parts.append(
            f'<img class="msprobe-trend-plot" alt="loss and gradient norm per step" '
            f'src="data:image/png;base64,{data}"/>'
        )
    return "\n".join(parts)


def checklist_html(result: CompareResult) -> str:
    """A table of the checklist's differences (failures, then context), empty when there are none."""
    checklist = result.checklist
    if checklist is None or not checklist.differences:
        return ""
    rows = [
        '<table class="msprobe-checklist" border="1" cellpadding="3" style="border-collapse: collapse">',
        "<tr><th>checklist</th><th>name</th><th>where</th><th>target</th><th>baseline</th><th>what</th></tr>",
    ]
    for d in checklist.differences[:40]:
        kind = d.kind if d.failing else f"{d.kind} (context{', expected' if d.expected else ''})"
        rows.append(
            f"<tr><td>{html.escape(kind)}</td><td><code>{html.escape(d.name)}</code></td>"
            f"<td>{html.escape(d.where)}</td><td>{html.escape(d.target)}</td><td>{html.escape(d.baseline)}</td>"
            f"<td>{html.escape(d.detail)}</td></tr>"
        )
    rows.append("</table>")
    return "\n".join(rows)


# Our block's look inside pytest-html, whose page sets small grey text: the block reads as prose, in the page's
# own size and black. A failed compare's log (pytest's failure text) is shown whole: pytest-html cuts every log at
# 230px behind an "expand" button; the rule reaches only the rows that hold a failed block of ours.
FRAGMENT_STYLE = """<style>
.msprobe { color: #222; font: 13px/1.45 system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; }
.msprobe p, .msprobe li, .msprobe td, .msprobe th { color: #222; }
.msprobe-advisor h4 { font-size: 14px; margin: 12px 0 4px 0; color: #000; }
.msprobe-advisor p { margin: 4px 0; max-width: 72em; overflow-wrap: break-word; }
.msprobe-advisor ul { margin: 2px 0 6px 0; padding-left: 1.5em; }
.msprobe-advisor .msprobe-line { color: #555; }
.extraHTML:has(.msprobe-failed) ~ .logwrapper { max-height: none; overflow-y: visible; }
.extraHTML:has(.msprobe-failed) ~ .logwrapper > .logexpander { display: none; }
.extraHTML:has(.msprobe-failed) ~ .logwrapper > .log { top: 0; height: auto; }
</style>"""


def advisor_html(advisor: str) -> str:
    """The advisor's text as a titled block of paragraphs (its indented lines as lists). Its first line,
    msprobe's bare ``Line: N``, is said in words: the suspect row's index in the comparison table, counted
    from 0 under the header as msprobe counts it, and so the xlsx sheet's row N + 2; ``Line: N/A`` says nothing
    and is left out. The advisor's file keeps msprobe's layout."""
    parts = ['<div class="msprobe-advisor">', "<h4>Advisor: where the error enters and what to try</h4>"]
    items: list[str] = []

    def flush() -> None:
        if items:
            parts.append("<ul>" + "".join(f"<li>{item}</li>" for item in items) + "</ul>")
            items.clear()

    for line in advisor.splitlines():
        if not line.strip():
            flush()
            continue
        if line.startswith("  "):
            items.append(html.escape(line.strip()))
            continue
        flush()
        if line.startswith("Line: "):
            index = line.removeprefix("Line: ").strip()
            if index.isdigit():
                parts.append(
                    f'<p class="msprobe-line">Line {index}: row {index} of the comparison table, counted from 0 '
                    f"under its header as msprobe does (row {int(index) + 2} of the xlsx's compare_result "
                    "sheet).</p>"
                )
            continue
        parts.append(f"<p>{html.escape(line)}</p>")
    flush()
    parts.append("</div>")
    return "\n".join(parts)


REPORT_LABELS = {
    "xlsx": "compare result (xlsx)",
    "csv": "compare result (csv)",
    "advisor": "advisor",
    "summary": "summary.json",
    "own_errors": "own errors (csv)",
    "model": "model view (html)",
}


def html_fragment(
    result: CompareResult,
    reports: dict[str, str],
    advisor: str,
    max_rows: int = 20,
    links: Links | None = None,
    report_only: bool = False,
) -> str:
    """The block pytest-html shows under an msprobe test: verdict, advisor, failing rows, plot, links.

    ``links`` says how the report files are linked (relative to the HTML report's folder, or embedded in a
    self-contained report); ``report_only``: the verdict does not fail the test, and the block says so.
    """
    c = result.counts()
    failed = not result.verdict.passed and not report_only  # (the test fails: its log is the failure text)
    parts = [FRAGMENT_STYLE, f'<div class="msprobe{" msprobe-failed" if failed else ""}">']
    verdict = "passed" if result.verdict.passed else "FAILED"
    if report_only and not result.verdict.passed:
        verdict += " (report-only: not failing the test)"
    parts.append(
        f"<p><b>msprobe {html.escape(result.mode)} compare {verdict}</b>: {c['apis_error']} of {c['apis']} API "
        f"calls breach; {c['rows']} rows ({c['error']} error, {c['warning']} warning, {c['unmatched']} unmatched)</p>"
    )
    if result.coverage.headline is not None:
        parts.append(f'<p class="msprobe-coverage"><b>{html.escape(result.coverage.headline)}</b></p>')
    fd = result.first_divergence
    first = result.verdict.checklist
    if first is not None:
        parts.append(
            f'<p>First divergence: <b class="msprobe-first-divergence">{html.escape(first.kind)} '
            f"{html.escape(first.name)}</b> ({html.escape(first.where)}): {html.escape(first.detail)}</p>"
        )
        fd = None
    checklist = checklist_html(result)
    if checklist:
        parts.append(checklist)
    if fd is not None:
        site = divergence_site(result)
        called = f"; called from <code>{html.escape(site)}</code>" if site else ""
        parts.append(
            f'<p>First divergence: <b class="msprobe-first-divergence">{html.escape(fd.api)}</b> '
            f"(step {fd.step}, rank {fd.rank}), row <code>{html.escape(fd.row)}</code>{called}: "
            f"{html.escape(fd.reason)}</p>"
        )
    trend = trend_html(result.trend)
    if trend:
        parts.append(trend)
    parts.append(advisor_html(advisor))
    own = own_error_html(result)
    if own:
        parts.append(own)
    failing = [r for r in result.worst_rows(max_rows) if r.status == ERROR]
    if failing:
        parts.append(
            '<table class="msprobe-rows" border="1" cellpadding="3" style="border-collapse: collapse">'
        )
        parts.append(
            "<tr><th>step</th><th>rank</th><th>row</th><th>metric</th><th>value</th><th>allowed</th>"
            "<th>reason</th></tr>"
        )
        for r in failing:
            value = "n/a" if r.error is None else f"{r.error:.3g}"
            allowed = "n/a" if r.allowed is None else f"{r.allowed:.3g}"
            api = result.apis[r.api_index]
            parts.append(
                f"<tr><td>{place(api.step)}</td><td>{place(api.rank)}</td><td><code>{html.escape(r.row)}</code>"
                f"</td><td>{html.escape(row_what(r))}</td><td>{value}</td><td>{allowed}</td>"
                f"<td>{html.escape(r.reason)}</td></tr>"
            )
        parts.append("</table>")
    png = error_plot_png(result)
    if png is not None:
        data = base64.b64encode(png).decode("ascii")
        parts.append(
            f'<img class="msprobe-plot" alt="error per API call" src="data:image/png;base64,{data}"/>'
        )
    if reports:
        links = links or Links()
        anchors = " | ".join(links.anchor(REPORT_LABELS.get(k, k), v) for k, v in reports.items())
        parts.append(f'<p class="msprobe-reports">Reports: {anchors}</p>')
    parts.append("</div>")
    return "\n".join(parts)
