"""The model view of a compare: one standalone HTML page (no network, no external files; it opens from disk).

It shows the model's module tree (from construct.json at L0/mix, from the call stacks at L1: see
:mod:`pytest_msprobe.compare.dumps.modules`) with every node coloured by the worst error of the calls made in it
(error / allowed of their rows, :func:`pytest_msprobe.report.html.api_ratios`), the first divergence's node
highlighted and opened, a search over nodes and calls, and a call's rows on click; a selector picks the step
and the rank where a compare has several. The data is embedded as JSON and the tree is drawn as it is opened,
so that a model of thousands of calls opens at once; past :data:`MAX_ROWS` rows, the rows of passing calls are
left out (the xlsx has them all).

The page reads its URL fragment, so that a link (or a test) can open it anywhere:
``model_...html#search=relu``, ``#call=Functional.relu.2.forward&step=1&rank=0``, ``#node=layer1.0.conv1``.
"""

from __future__ import annotations

import html
import json
import math
from typing import Any

from pytest_msprobe.compare.dumps import UNKNOWN_MODULE
from pytest_msprobe.compare.judging import PASS, STATUSES, fmt_number, row_metric
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.report.html import api_ratios

MAX_ROWS = 100_000  # rows embedded; beyond it only the rows of calls that do not pass
_INF = 1e300  # a ratio that is infinite (an error where none is allowed), as JSON can hold it

SOURCES = {
    "construct.json": "modules from construct.json (L0/mix: each record's parent module)",
    "stack.json": "modules from the call stacks in stack.json (L1: each call under the module calls on its stack)",
}


def model_data(result: CompareResult) -> dict[str, Any]:
    """What the page shows, as the JSON it embeds: ``nodes`` ``[label, parent, about]`` (node 0 is the root,
    each node after its parent, in the order of their first call), ``calls`` in execution order ``[name, node,
    step, rank, direction, status, ratio, reason, first row, row count]``, ``rows`` ``[name (``.suffix`` of its
    call's name), status, metric, value, allowed, reason]``, ``strings`` (the table that status, metric and
    reason index), and what the header says."""
    strings: dict[str, int] = {}

    def sid(text: str) -> int:
        return strings.setdefault(text, len(strings))

    for status in STATUSES:
        sid(status)
    ratios = api_ratios(result)
    order = sorted(range(len(result.apis)), key=lambda i: result.apis[i].order)
    position = {api_index: n for n, api_index in enumerate(order)}
    nodes: list[list[Any]] = [["", -1, ""]]
    node_of: dict[tuple[str, ...], int] = {(): 0}
    total_rows = sum(len(a.rows) for a in result.apis)
    keep_all = total_rows <= MAX_ROWS
    budget = MAX_ROWS
    calls: list[list[Any]] = []
    rows: list[list[Any]] = []
    omitted = 0
    for i in order:
        api = result.apis[i]
        path = api.module or UNKNOWN_MODULE
        for depth in range(1, len(path) + 1):
            if path[:depth] not in node_of:
                node_of[path[:depth]] = len(nodes)
                nodes.append(
                    [path[depth - 1], node_of[path[: depth - 1]], result.modules.about.get(path[:depth], "")]
                )
        first = len(rows)
        fd_call = result.first_divergence is not None and i == result.first_divergence.api_index
        if keep_all or fd_call or (api.status != PASS and budget >= len(api.rows)):
            for j in api.rows:
                r = result.rows[j]
                name = r.row[len(api.api) :] if r.row.startswith(api.api + ".") else r.row
                rows.append(
                    [
                        name,
                        sid(r.status),
                        sid(row_metric(r)),
                        fmt_number(r.error),
                        fmt_number(r.allowed),
                        sid(r.reason),
                    ]
                )
            budget -= len(api.rows)
        else:
            omitted += len(api.rows)
        ratio = ratios[i]
        calls.append(
            [
                api.api,
                node_of[path],
                api.step,
                api.rank,
                api.direction or "",
                sid(api.status),
                None if ratio is None else (_INF if math.isinf(ratio) else float(f"{ratio:.4g}")),
                sid(api.reason),
                first,
                len(rows) - first,
            ]
        )
    fd = result.first_divergence
    counts = result.counts()
    return {
        "title": f"{result.mode} compare: {'passed' if result.verdict.passed else 'FAILED'}",
        "target": result.target,
        "baseline": result.baseline,
        "headline": (
            f"{counts['apis_error']} of {counts['apis']} API calls breach; {counts['rows']} rows "
            f"({counts['error']} error, {counts['warning']} warning, {counts['unmatched']} unmatched)"
        ),
        "first": None
        if fd is None
        else {
            "call": position[fd.api_index],
            "row": fd.row_index - result.apis[fd.api_index].row_start,  # among its call's rows
            "text": f"{fd.api} (step {fd.step}, rank {fd.rank}), row {fd.row}: {fd.reason}",
        },
        "checklist": _checklist_first(result),
        "sources": [SOURCES.get(s, s) for s in result.modules.sources],
        "steps": sorted({a.step for a in result.apis if a.step is not None}),
        "ranks": sorted({a.rank for a in result.apis if a.rank is not None}),
        "nodes": nodes,
        "calls": calls,
        "rows": rows,
        "omitted_rows": omitted,
        "strings": list(strings),
    }


def _checklist_first(result: CompareResult) -> str | None:
    first = result.verdict.checklist
    if first is None:
        return None
    return f"{first.kind} {first.name} ({first.where}): {first.detail}"


def model_html(result: CompareResult) -> str:
    """The standalone page of :func:`model_data`."""
    data = json.dumps(model_data(result), separators=(",", ":"), allow_nan=False)
    # inside <script>, "</" could end the element early: JSON allows the escaped form
    data = data.replace("</", "<\\/")
    title = html.escape(
        f"msprobe model view: {result.mode} compare {'passed' if result.verdict.passed else 'FAILED'}"
    )
    return _PAGE.replace("__TITLE__", title).replace("__DATA__", data)


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 0; color: #222; display: flex; flex-direction: column; height: 100vh; }
header { padding: 8px 12px; border-bottom: 1px solid #ccc; background: #f7f7f7; }
header h1 { font-size: 16px; margin: 0 0 4px 0; }
header .paths, header .sources { color: #555; font-size: 12px; }
header .first b { color: #b00; }
.controls { margin-top: 6px; display: flex; gap: 12px; align-items: center; flex-wrap: wrap; }
.controls input[type=search] { width: 22em; padding: 2px 4px; }
.legend span { display: inline-block; padding: 0 6px; margin-right: 4px; border-radius: 3px; }
main { display: flex; flex: 1; min-height: 0; }
#tree { flex: 3; overflow: auto; padding: 6px 8px; border-right: 1px solid #ccc; }
#details { flex: 2; overflow: auto; padding: 6px 10px; }
ul { list-style: none; margin: 0; padding-left: 16px; }
#tree > ul { padding-left: 0; }
.head { cursor: pointer; white-space: nowrap; padding: 1px 2px; border-radius: 3px; }
.head:hover { background: #eef; }
.tw { display: inline-block; width: 1em; color: #666; }
.about { color: #777; font-size: 11px; margin-left: 4px; }
.ratio { font-size: 11px; margin-left: 6px; color: #333; }
.sw { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 4px; vertical-align: -1px; }
.band-none > .head > .sw, .band-none > .sw, .legend .band-none { background: #ccc; }
.band-ok > .head > .sw, .band-ok > .sw, .legend .band-ok { background: #4caf50; }
.band-near > .head > .sw, .band-near > .sw, .legend .band-near { background: #f0ad00; }
.band-over > .head > .sw, .band-over > .sw, .legend .band-over { background: #d62728; }
.legend span { color: #fff; }
.legend .band-none { color: #222; }
.fd > .head { outline: 2px solid #d62728; background: #fde8e8; }
.call { cursor: pointer; white-space: nowrap; padding: 0 2px; border-radius: 3px; font-family: ui-monospace, monospace; font-size: 12px; }
.call:hover { background: #eef; }
.call.selected { background: #dde6ff; }
.call.fd-call { outline: 2px solid #d62728; }
.tag { font-family: system-ui, sans-serif; font-size: 11px; color: #555; margin-left: 6px; }
mark { background: #ffef80; padding: 0; }
table { border-collapse: collapse; font-size: 12px; width: 100%; }
td, th { border: 1px solid #ccc; padding: 2px 4px; text-align: left; vertical-align: top; }
td, h2, code { overflow-wrap: normal; word-break: normal; }
tr.st-error td { background: #fde8e8; }
tr.st-warning td { background: #fff6d6; }
tr.fd-row td { outline: 2px solid #d62728; }
.more { color: #36c; cursor: pointer; font-size: 12px; }
.note { color: #666; font-size: 12px; }
</style>
</head>
<body>
<header>
<h1 id="title"></h1>
<div id="headline"></div>
<div class="first" id="first"></div>
<div class="paths" id="paths"></div>
<div class="sources" id="sources"></div>
<div class="controls">
<label>Search <input type="search" id="search" placeholder="module or call name"></label>
<span id="selectors"></span>
<span class="legend">worst error / allowed:
<span class="band-ok">&lt; 0.5</span><span class="band-near">0.5 to 1</span><span class="band-over">&#8805; 1 or error</span><span class="band-none">not measured</span></span>
<span id="matches" class="note"></span>
</div>
</header>
<main>
<div id="tree"></div>
<div id="details"><p class="note">Click a call to see its rows.</p></div>
</main>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const S = D.strings, INF = 1e300, SHOW = 300;
const nodes = D.nodes.map((n, i) => ({id: i, label: n[0], parent: n[1], about: n[2], kids: [], calls: []}));
for (const n of nodes) if (n.parent >= 0) nodes[n.parent].kids.push(n.id);
const calls = D.calls.map((c, i) => ({id: i, name: c[0], node: c[1], step: c[2], rank: c[3], dir: c[4],
  status: S[c[5]], ratio: c[6], reason: S[c[7]], row0: c[8], nrows: c[9]}));
for (const c of calls) nodes[c.node].calls.push(c.id);
const path = id => { const p = []; for (let n = nodes[id]; n.id !== 0; n = nodes[n.parent]) p.unshift(n.label); return p; };
const dotted = id => path(id).join(".");
const state = {step: "all", rank: "all", query: "", open: new Set([0]), closed: new Set(), selected: null, limit: {}};
const fdCall = D.first ? D.first.call : null;
const fdNode = fdCall === null ? null : calls[fdCall].node;

function esc(t) { return String(t).replace(/[&<>"]/g, ch => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[ch])); }
// a call or module name, escaped, that a narrow column wraps only after its dots and underscores, never inside a word
function name(t) { return esc(t).replace(/[._]/g, "$&<wbr>"); }
function shown(c) {
  return (state.step === "all" || String(c.step) === state.step) && (state.rank === "all" || String(c.rank) === state.rank);
}
function band(worst) {
  if (worst.error) return "over";
  if (worst.ratio === null) return "none";
  return worst.ratio >= 1 ? "over" : worst.ratio >= 0.5 ? "near" : "ok";
}
function fmtRatio(r) { return r === null ? "" : r >= INF ? "inf" : r < 0.001 && r > 0 ? r.toExponential(1) : String(+r.toPrecision(3)); }

// worst error/allowed (and whether any call breaches) of each node's subtree, over the calls shown
let worst = [];
function measure() {
  worst = nodes.map(() => ({ratio: null, error: false, n: 0, breach: 0}));
  for (const c of calls) {
    if (!shown(c)) continue;
    const err = c.status === "error";
    for (let id = c.node; id >= 0; id = nodes[id].parent) {
      const w = worst[id];
      w.n += 1;
      if (err) { w.error = true; w.breach += 1; }
      if (c.ratio !== null && (w.ratio === null || c.ratio > w.ratio)) w.ratio = c.ratio;
    }
  }
}

// the search: nodes and calls whose name holds the query, and the nodes on the way to them
let hits = null;
function search() {
  const q = state.query.trim().toLowerCase();
  state.closed.clear();
  if (!q) { hits = null; document.getElementById("matches").textContent = ""; return; }
  hits = {nodes: new Set(), calls: new Set(), on: new Set()};
  for (const n of nodes) if (n.id && (n.label.toLowerCase().includes(q) || dotted(n.id).toLowerCase().includes(q))) hits.nodes.add(n.id);
  for (const c of calls) if (shown(c) && c.name.toLowerCase().includes(q)) hits.calls.add(c.id);
  const mark = id => { for (; id >= 0 && !hits.on.has(id); id = nodes[id].parent) hits.on.add(id); };
  hits.nodes.forEach(mark);
  hits.calls.forEach(id => mark(calls[id].node));
  document.getElementById("matches").textContent = hits.nodes.size + " modules and " + hits.calls.size + " calls match";
}
function highlight(text) {
  const q = state.query.trim();
  if (!q) return esc(text);
  const at = text.toLowerCase().indexOf(q.toLowerCase());
  if (at < 0) return esc(text);
  return esc(text.slice(0, at)) + "<mark>" + esc(text.slice(at, at + q.length)) + "</mark>" + esc(text.slice(at + q.length));
}

function isOpen(id) {
  if (state.closed.has(id)) return false;
  return state.open.has(id) || (hits !== null && hits.on.has(id) && hasHitBelow(id));
}
function hasHitBelow(id) { return nodes[id].calls.some(c => hits.calls.has(c)) || nodes[id].kids.some(k => hits.on.has(k)); }

// all: inside a module that matches the search (or no search): everything in it is shown
function renderNode(id, all) {
  const n = nodes[id], w = worst[id];
  const li = document.createElement("li");
  li.className = "node band-" + band(w) + (id === fdNode ? " fd" : "") + (hits && hits.nodes.has(id) ? " match" : "");
  li.dataset.node = id;
  li.dataset.path = dotted(id);
  const open = isOpen(id);
  if (open) li.classList.add("open");
  const score = w.ratio === null ? "" : "worst " + fmtRatio(w.ratio) + "&#215; allowed, ";
  li.innerHTML = '<div class="head"><span class="tw">' + (n.kids.length || n.calls.length ? (open ? "&#9662;" : "&#9656;") : "") +
    '</span><span class="sw"></span><span class="label">' + highlight(n.label) + "</span>" +
    (n.about ? '<span class="about">' + esc(n.about) + "</span>" : "") +
    '<span class="ratio">' + score + (w.breach ? w.breach + " breach, " : "") + w.n + " calls</span></div>";
  li.firstChild.addEventListener("click", () => toggle(id));
  if (open) li.appendChild(renderChildren(id, all || (hits !== null && hits.nodes.has(id))));
  return li;
}
function renderChildren(id, all) {
  const ul = document.createElement("ul");
  for (const k of nodes[id].kids) if (worst[k].n && (all || hits.on.has(k))) ul.appendChild(renderNode(k, all));
  const mine = nodes[id].calls.filter(c => shown(calls[c]) && (all || hits.calls.has(c)));
  const limit = state.limit[id] || SHOW;
  for (const c of mine.slice(0, limit)) ul.appendChild(renderCall(c));
  if (mine.length > limit) {
    const more = document.createElement("li");
    more.className = "more";
    more.textContent = "show all " + mine.length + " calls";
    more.addEventListener("click", () => { state.limit[id] = mine.length; draw(); });
    ul.appendChild(more);
  }
  return ul;
}
function renderCall(id) {
  const c = calls[id];
  const li = document.createElement("li");
  li.className = "call band-" + band({ratio: c.ratio, error: c.status === "error"}) + (id === state.selected ? " selected" : "") + (id === fdCall ? " fd-call" : "");
  li.dataset.call = id;
  const where = (c.step === null ? "" : "step " + c.step) + (c.rank === null ? "" : " rank " + c.rank);
  li.innerHTML = '<span class="sw"></span>' + highlight(c.name) + '<span class="tag">' + esc(where) + " " + esc(c.status) +
    (c.ratio === null ? "" : " " + fmtRatio(c.ratio) + "&#215;") + "</span>";
  li.addEventListener("click", ev => { ev.stopPropagation(); select(id); });
  return li;
}
function draw() { document.getElementById("tree").replaceChildren(renderChildren(0, hits === null)); }
function toggle(id) {
  if (isOpen(id)) { state.open.delete(id); state.closed.add(id); } else { state.closed.delete(id); state.open.add(id); }
  draw();
}
function openTo(nodeId) { for (let n = nodeId; n >= 0; n = nodes[n].parent) { state.open.add(n); state.closed.delete(n); } }

function select(id) {
  state.selected = id;
  const c = calls[id];
  openTo(c.node);
  draw();
  const rows = [];
  for (let i = 0; i < c.nrows; i++) {
    const r = D.rows[c.row0 + i];
    const rowName = r[0].startsWith(".") ? c.name + r[0] : r[0];
    const fd = id === fdCall && i === D.first.row;
    rows.push('<tr class="st-' + esc(S[r[1]]) + (fd ? " fd-row" : "") + '"><td><code>' + name(rowName) + "</code></td><td>" + esc(S[r[1]]) +
      "</td><td>" + esc(S[r[2]]) + "</td><td>" + esc(r[3]) + "</td><td>" + esc(r[4]) + "</td><td>" + esc(S[r[5]]) +
      "</td><td>" + esc(c.step === null ? "" : c.step) + "</td><td>" + esc(c.rank === null ? "" : c.rank) + "</td></tr>");
  }
  const details = document.getElementById("details");
  details.innerHTML = "<h2 style=\\"font-size:14px;margin:4px 0\\">" + name(c.name) + (id === fdCall ? ' <span style="color:#b00">(first divergence)</span>' : "") + "</h2>" +
    '<p>module <code>' + name(dotted(c.node)) + "</code>; step " + esc(c.step) + ", rank " + esc(c.rank) + (c.dir ? ", " + esc(c.dir) : "") +
    "; status <b>" + esc(c.status) + "</b>" + (c.ratio === null ? "" : ", worst error/allowed " + fmtRatio(c.ratio)) + "</p>" +
    (c.reason ? "<p>" + esc(c.reason) + "</p>" : "") +
    (c.nrows ? '<table id="rows"><tr><th>row</th><th>status</th><th>metric</th><th>value</th><th>allowed</th><th>reason</th><th>step</th><th>rank</th></tr>' + rows.join("") + "</table>"
      : '<p class="note">rows of passing calls are left out of this page (' + D.omitted_rows + " rows): the xlsx has them</p>");
  const el = document.querySelector('[data-call="' + id + '"]');
  if (el) el.scrollIntoView({block: "center"});
}

function selectors() {
  const out = [];
  for (const [key, values] of [["step", D.steps], ["rank", D.ranks]]) {
    if (values.length < 2) continue;
    out.push("<label>" + key + ' <select id="sel-' + key + '"><option value="all">all</option>' +
      values.map(v => '<option value="' + v + '">' + v + "</option>").join("") + "</select></label>");
  }
  const box = document.getElementById("selectors");
  box.innerHTML = out.join(" ");
  for (const key of ["step", "rank"]) {
    const sel = document.getElementById("sel-" + key);
    if (sel) sel.addEventListener("change", () => { state[key] = sel.value; refresh(); });
  }
}
function refresh() { measure(); search(); draw(); }

function fromHash() {
  const params = new URLSearchParams(location.hash.replace(/^#/, ""));
  for (const key of ["step", "rank"]) {
    if (!params.has(key)) continue;
    state[key] = params.get(key);
    const sel = document.getElementById("sel-" + key);
    if (sel) sel.value = state[key];
  }
  state.query = params.get("search") || "";
  document.getElementById("search").value = state.query;
  refresh();
  if (params.has("call")) {
    const name = params.get("call");
    const found = calls.find(c => c.name === name && shown(c));
    if (found) select(found.id);
  } else if (params.has("node")) {
    const want = params.get("node");
    const found = nodes.find(n => n.id && dotted(n.id) === want);
    if (found) {
      openTo(found.id);
      draw();
      const el = document.querySelector('[data-node="' + found.id + '"]');
      if (el) el.scrollIntoView({block: "center"});
    }
  }
}

document.getElementById("title").textContent = D.title;
document.getElementById("headline").textContent = D.headline;
document.getElementById("paths").textContent = "target " + D.target + " vs baseline " + D.baseline;
document.getElementById("sources").textContent = D.sources.join("; ") || "no construct.json or stack.json: where the calls were made is unknown";
const first = D.checklist ? "First divergence: " + D.checklist : D.first ? "First divergence: " + D.first.text : "No first divergence";
document.getElementById("first").innerHTML = esc(first).replace(/^(First divergence: )(\\S+)/, "$1<b>$2</b>");
selectors();
let typing = null;
document.getElementById("search").addEventListener("input", ev => {
  clearTimeout(typing);
  typing = setTimeout(() => { state.query = ev.target.value; search(); draw(); }, 150);
});
window.addEventListener("hashchange", fromHash);
measure();
if (fdCall !== null) openTo(fdNode);
if (location.hash.length > 1) fromHash();
else if (fdCall !== null) select(fdCall);
else { search(); draw(); }
</script>
</body>
</html>
"""
