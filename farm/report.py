"""The nightly report: one self-contained HTML file (plotly.js inlined once, no network needed
to view it), built from the history alone (storage/history.py).

It shows, per suite: the regressions of the latest run against the one before (the gate of
`farm zoo run`), pass rate over time per target, compile time per model over time, speedup
over eager per model with the geomean, and the cache hit rate."""
from __future__ import annotations

import html
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from farm.regressions import Regression, find_regressions

PASSED = ("compiled", "hit")


def _runs(rows: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """(run_id, run_at) of every run, oldest first."""
    return sorted({(r["run_id"], r["run_at"]) for r in rows}, key=lambda x: x[1])


def _night(row: dict[str, Any]) -> str:
    """A run's place on the time axis: its history date, and its start time to tell two runs of a day apart."""
    return f"{row['date']} {row['run_at']:%H:%M}"


def _figure(title: str, ytitle: str, percent: bool = False) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, yaxis_title=ytitle, template="plotly_white", width=660, height=380,
                      margin=dict(l=60, r=20, t=50, b=40), legend=dict(orientation="h", y=-0.2))
    fig.update_xaxes(type="category", categoryorder="category ascending", title="run (history date, start time)")
    if percent:
        fig.update_yaxes(tickformat=".0%", range=[0, 1.05])
    return fig


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def pass_rate(rows: list[dict[str, Any]]) -> go.Figure:
    fig = _figure("Pass rate per target", "models that compiled and verified", percent=True)
    by_target: dict[str, dict[Any, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["status"] != "skipped":
            by_target[r["target"]][_night(r)].append(r["status"] in PASSED)
    for target, runs in sorted(by_target.items()):
        xs = sorted(runs)
        fig.add_trace(go.Scatter(x=xs, y=[sum(runs[x]) / len(runs[x]) for x in xs], mode="lines+markers", name=target,
                                 text=[f"{sum(runs[x])}/{len(runs[x])}" for x in xs]))
    return fig


def per_model(rows: list[dict[str, Any]], column: str, title: str, ytitle: str) -> go.Figure:
    fig = _figure(title, ytitle)
    series: dict[str, list[tuple[Any, float]]] = defaultdict(list)
    for r in rows:
        if r["status"] in PASSED and r.get(column):
            series[f"{r['model']} · {r['target']}"].append((_night(r), r[column]))
    for name, points in sorted(series.items()):
        points.sort()
        fig.add_trace(go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="lines+markers", name=name))
    return fig


def speedup(rows: list[dict[str, Any]]) -> go.Figure:
    fig = per_model(rows, "speedup", "Speedup over eager (latest geomean dashed)", "eager / compiled latency")
    geo = []
    for rid, _ in _runs(rows):
        mine = [r for r in rows if r["run_id"] == rid]
        g = _geomean([r["speedup"] for r in mine if r["status"] in PASSED])
        if g:
            geo.append((_night(mine[0]), g))
    if geo:
        fig.add_trace(go.Scatter(x=[g[0] for g in geo], y=[g[1] for g in geo], name="geomean",
                                 mode="lines+markers", line=dict(dash="dash", width=3, color="black")))
    return fig


def hit_rate(rows: list[dict[str, Any]]) -> go.Figure:
    fig = _figure("Cache hit rate", "units answered from the store", percent=True)
    rates = []
    for rid, _ in _runs(rows):
        mine = [r for r in rows if r["run_id"] == rid]
        done = [r for r in mine if r["status"] in PASSED]
        rates.append((_night(mine[0]), sum(bool(r["hit"]) for r in done) / len(done) if done else 0.0))
    fig.add_trace(go.Bar(x=[a for a, _ in rates], y=[v for _, v in rates], name="hit rate",
                         text=[f"{v:.0%}" for _, v in rates], textposition="auto"))
    return fig


def _table(headers: list[str], body: list[list[str]], css: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'


def _regressions_html(regressions: list[Regression], latest: str, previous: str | None) -> str:
    if previous is None:
        return f"<p class='ok'>Run {html.escape(latest)} is the first of its suite: nothing to compare with.</p>"
    if not regressions:
        return f"<p class='ok'>No regressions in {html.escape(latest)} against {html.escape(previous)}.</p>"
    body = [[r.model, r.target, r.kind, r.detail] for r in regressions]
    return (f"<p class='bad'>{len(regressions)} regression{'s' if len(regressions) > 1 else ''} in "
            f"{html.escape(latest)} against {html.escape(previous)}:</p>"
            + _table(["model", "target", "regression", "detail"], body, "regressions"))


def _latest_html(rows: list[dict[str, Any]], run_id: str) -> str:
    def fmt(v: Any, spec: str) -> str:
        return "" if v is None else format(v, spec)
    body = [[r["model"], r["target"], r["status"], fmt(r["compile_s"], ".1f"),
             fmt(r["speedup"], ".2f"), _kib(r.get("saved_activation_bytes")), fmt(r["max_abs_err"], ".2g"),
             (r.get("error") or "")[:160]]
            for r in rows if r["run_id"] == run_id]
    return _table(["model", "target", "status", "compile s", "speedup (train: whole step)", "saved activations",
                   "max error", "error"], body, "latest")


def _kib(n: Any) -> str:
    return "" if n is None else f"{n / 1024:.1f} KiB"


def _side_by_side_html(rows: list[dict[str, Any]], run_id: str) -> str:
    """The latest run as a model × target grid, so formats built from the same program (AOTInductor,
    ExecuTorch .pte, core ATen, …) compare at a glance: status, speedup over eager, size."""
    latest = [r for r in rows if r["run_id"] == run_id]
    targets = sorted({r["target"] for r in latest})
    cells: dict[tuple[str, str], str] = {}
    for r in latest:
        parts = [r["status"]]
        if r.get("speedup"):
            parts.append(f"{'step ' if r.get('mode') == 'train' else ''}{r['speedup']:.2f}x")
        if r.get("saved_activation_bytes") is not None:
            parts.append(f"{_kib(r['saved_activation_bytes'])} saved for backward")
        if r.get("artifact_bytes"):
            parts.append(f"{r['artifact_bytes'] / 1024:.0f} KiB")
        cells[(r["model"], r["target"])] = " · ".join(parts)
    models = sorted({r["model"] for r in latest})
    body = [[m, *(cells.get((m, t), "") for t in targets)] for m in models]
    return _table(["model", *targets], body, "side-by-side")


STYLE = """body{font-family:system-ui,sans-serif;margin:24px;color:#222}h1{margin-bottom:4px}
.grid{display:flex;flex-wrap:wrap;gap:12px}
table{border-collapse:collapse;margin:8px 0 20px}td,th{border:1px solid #ddd;padding:4px 8px;font-size:13px;text-align:left}
th{background:#f3f3f3}.bad{color:#b00020;font-weight:600}.ok{color:#1b7f3b;font-weight:600}
table.regressions td{background:#fff3f3}"""


def render(history_rows: list[dict[str, Any]]) -> str:
    """The whole report: a section per suite."""
    suites = sorted({r["suite"] for r in history_rows})
    sections = []
    for suite in suites:
        rows = [r for r in history_rows if r["suite"] == suite]
        runs = _runs(rows)
        latest = runs[-1][0]
        previous = runs[-2][0] if len(runs) > 1 else None
        figures = [pass_rate(rows), per_model(rows, "compile_s", "Compile time per model", "seconds"),
                   speedup(rows), hit_rate(rows)]
        if any(r.get("mode") == "train" for r in rows):
            figures.append(per_model(rows, "saved_activation_bytes", "Training steps: activations saved for backward",
                                     "bytes at the example size"))
        plots = "".join(f"<div>{f.to_html(full_html=False, include_plotlyjs=False)}</div>" for f in figures)
        sections.append(f"<h2>Suite {html.escape(suite)}: {len(runs)} run{'s' if len(runs) > 1 else ''}</h2>"
                        f"<h3>Regressions</h3>{_regressions_html(find_regressions(rows, latest), latest, previous)}"
                        f"<div class='grid'>{plots}</div><h3>Latest run {html.escape(latest)}, target by target</h3>"
                        f"{_side_by_side_html(rows, latest)}<h3>Latest run {html.escape(latest)}</h3>{_latest_html(rows, latest)}")
    body = "".join(sections) or "<p>The history is empty: run <code>farm zoo run</code> first.</p>"
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Nightly zoo compiles</title>"
            f"<style>{STYLE}</style><script>{get_plotlyjs()}</script></head>"
            f"<body><h1>Nightly zoo compiles</h1>{body}</body></html>")


def write_report(history_rows: list[dict[str, Any]], dest: Path) -> Path:
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.write_text(render(history_rows), encoding="utf-8")
    tmp.replace(dest)
    return dest
