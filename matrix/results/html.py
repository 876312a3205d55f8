"""index.html of one run: a self-contained page (inline CSS, no script, nothing fetched).

`html_report(document)` renders a results.json document (matrix/results/results.schema.json) as a
header (counts, command, stack, machine, warnings), one grid per device x engine (models as
rows, precision x mode as columns, coloured by outcome), a details panel per cell that a click
on the cell shows (CSS :target) with a training cell's loss curve drawn against its references
(inline SVG, `curve_figure`) and its traceback with the harness's frames folded
(matrix/results/tracebacks.py), the passed cells that did not exercise their precision
(matrix/results/exercised.py), the failure signatures, the triage of the uncatalogued ones (once
python -m matrix triage has run: `triage_section`, from its triage.json), the catalogue entries,
the explorations and the environment.

Every string taken from the document is escaped, in text and in attributes alike; only http(s)
URLs become links, and outcome values become class names only when they are known outcomes.
"""

from __future__ import annotations

import html
import json
import math
import re
from urllib.parse import quote, urlsplit

from matrix.results import tracebacks
from matrix.results.curves import share_words
from matrix.results.exercised import asked_and_ran, not_exercised_line, passed_without_precision, ran_instead
from matrix.results.files import AXES, OUTCOMES, hardware_line
from matrix.results.metrics import CellMetrics, Curve, CurveComparison, at_step, given, recorded_float
from matrix.results.reach import Reach, not_run_sentence, nothing_ran_line, ran_here, reach
from matrix.results.run_them import command

UPSTREAM_REFERENCE = re.compile(r"([A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)#([0-9]+)")  # owner/repo#123

CSS = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1rem 1.5rem; color: #1b1b1b; }
h1 { font-size: 1.4rem; margin: 0 0 .5rem; } h2 { font-size: 1.15rem; margin: 1.6rem 0 .5rem; }
code, pre { font: 12px/1.35 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
pre { background: #f5f5f5; padding: .5rem; white-space: pre-wrap; word-break: break-word; margin: .2rem 0; }
table { border-collapse: collapse; }
th, td { border: 1px solid #c8c8c8; padding: 2px 6px; vertical-align: top; text-align: left; }
.kv th { background: #f3f3f3; font-weight: 600; white-space: nowrap; }
.kv td > table { margin: 0; }
.none { color: #999; }
#signatures td:first-child { white-space: nowrap; }
.warning { background: #fff3cd; border: 2px solid #d39e00; padding: .4rem .7rem; margin: .4rem 0; font-weight: 600; }
.incomplete { background: #f8d7da; border-color: #b02a37; }
.counts span { display: inline-block; padding: 2px 8px; margin: 0 4px 4px 0; border-radius: 3px; font-weight: 600; }
table.grid { margin: .4rem 0 1.2rem; table-layout: fixed; }
table.grid caption { text-align: left; font-weight: 700; font-size: 1.05rem; padding: 2px 0; }
table.grid th { background: #eef0f3; text-align: center; font-size: 12px; overflow-wrap: anywhere; }
table.grid th[scope=row] { text-align: left; white-space: nowrap; }
table.grid td { width: 5.2rem; padding: 0; text-align: center; font: 11px/1.2 ui-monospace, Menlo, monospace;
  overflow-wrap: anywhere; }
table.grid td a { display: block; padding: 5px 2px; color: inherit; text-decoration: none; }
table.grid td a:hover { outline: 2px solid #333; }
.outcome-passed { background: #cdeccd; color: #135c13; }
.outcome-passed.unexercised { background: repeating-linear-gradient(135deg, #e9f6e9, #e9f6e9 5px, #fff 5px, #fff 9px);
  color: #135c13; outline: 1px dashed #4a8a4a; outline-offset: -3px; }
.outcome-known { background: #ffe08a; color: #6b4a00; }
.outcome-failed { background: #f4a6a6; color: #7a0000; font-weight: 700; }
.outcome-fixed { background: #cbb8f0; color: #3b1c7a; font-weight: 700; }
.outcome-inapplicable { background: #eef3f8; color: #345; font-style: italic; }
.outcome-skipped { background: #e4e4e4; color: #666; }
.outcome-other { background: #fff; color: #333; outline: 1px dashed #888; }
td.empty { background: repeating-linear-gradient(45deg, #fff, #fff 4px, #f0f0f0 4px, #f0f0f0 8px); }
.detail { display: none; }
.detail:target { display: block; position: fixed; top: 0; right: 0; bottom: 0; width: min(48rem, 58vw);
  overflow: auto; background: #fff; border-left: 4px solid #444; box-shadow: -6px 0 18px rgba(0, 0, 0, .25);
  padding: .8rem 1.1rem; z-index: 10; }
.detail h3 { margin: 0 0 .5rem; font-size: 1.05rem; word-break: break-all; }
.detail .close { float: right; font-size: 1.2rem; text-decoration: none; }
.detail .kv { width: 100%; }
details summary { cursor: pointer; }
.curve svg { display: block; max-width: 100%; height: auto; font: 9px system-ui, sans-serif; }
.curve p { margin: .15rem 0; }
.curve .outside, .curve .error { color: #b02a37; font-weight: 600; }
.cells { margin: 0; padding-left: 1.2rem; }
details.harness > summary { color: #666; font: 12px/1.35 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
details.harness pre { background: #eee; color: #555; }
"""


# ------------------------------------------------------------------ small pieces


def esc(value) -> str:
    """Document text as HTML text or attribute value; None is empty."""
    return "" if value is None else html.escape(str(value), quote=True)


def code_spans(text: str) -> str:
    """Text with `backquoted` commands (this module's own words, matrix/results/run_them.py) as
    <code> elements, every part escaped."""
    parts = text.split("`")
    return "".join(f"<code>{esc(part)}</code>" if index % 2 else esc(part) for index, part in enumerate(parts))


def pre_text(value) -> str:
    """Document text inside a <pre> element: <, > and & escaped; quotes need not be, and a
    cell's metrics JSON is mostly quotes (escaped, they made half the page's bytes)."""
    return html.escape(str(value), quote=False)


def web_url(url) -> str | None:
    """`url` when it is an http(s) URL with a host, else None: nothing else becomes a link."""
    if not isinstance(url, str):
        return None
    url = url.strip()
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    return url if parts.scheme.lower() in ("http", "https") and parts.netloc else None


def link(url, text) -> str:
    safe = web_url(url)
    if safe is None:
        return esc(text)
    return f'<a href="{esc(safe)}" rel="noopener noreferrer">{esc(text)}</a>'


def upstream_link(reference) -> str:
    """'owner/repo#123' links to its GitHub issue, an http(s) URL to itself, anything else is text."""
    match = UPSTREAM_REFERENCE.fullmatch(str(reference))
    if match:
        return link(f"https://github.com/{match[1]}/issues/{match[2]}", reference)
    return link(reference, reference)


def anchor(prefix: str, key) -> str:
    """The element id of a cell's, signature's or entry's section."""
    return f"{prefix}-{key}"


def href(prefix: str, key) -> str:
    return "#" + quote(anchor(prefix, key), safe="")


def outcome_class(outcome) -> str:
    return f"outcome-{outcome}" if outcome in OUTCOMES else "outcome-other"


def seconds(value) -> str:
    return f"{value:.2f} s" if isinstance(value, (int, float)) and not isinstance(value, bool) else esc(value)


def ordered(values, order) -> list:
    """`values` in the axis' own order, then any it does not list, sorted."""
    present = set(values)
    listed = [value for value in dict.fromkeys(order or ()) if value in present]
    return listed + sorted(present - set(listed), key=str)


def value_html(value) -> str:
    """Any JSON value, generically: dicts as key/value tables, lists of dicts as tables."""
    if isinstance(value, dict):
        if not value:
            return '<span class="none">-</span>'
        rows = "".join(f"<tr><th>{esc(key)}</th><td>{value_html(item)}</td></tr>" for key, item in value.items())
        return f'<table class="kv">{rows}</table>'
    if isinstance(value, list):
        if not value:
            return '<span class="none">none</span>'
        if all(isinstance(item, dict) for item in value):
            keys = list(dict.fromkeys(key for item in value for key in item))
            head = "".join(f"<th>{esc(key)}</th>" for key in keys)
            body = "".join(
                "<tr>" + "".join(f"<td>{value_html(item.get(key))}</td>" for key in keys) + "</tr>" for item in value
            )
            return f'<table class="kv"><tr>{head}</tr>{body}</table>'
        return '<ul class="cells">' + "".join(f"<li>{value_html(item)}</li>" for item in value) + "</ul>"
    if value is None:
        return '<span class="none">null</span>'
    if isinstance(value, bool):
        return "true" if value else "false"
    return esc(value)


def kv_table(rows: list[tuple[str, str]]) -> str:
    """Rows of (label, HTML already escaped); labels are this module's own words."""
    return (
        '<table class="kv">' + "".join(f"<tr><th>{label}</th><td>{body}</td></tr>" for label, body in rows) + "</table>"
    )


def cell_links(cell_ids) -> str:
    if not cell_ids:
        return '<span class="none">none</span>'
    items = "".join(f'<li><a href="{esc(href("cell", c))}">{esc(c)}</a></li>' for c in cell_ids)
    return f'<details><summary>{len(cell_ids)} cells</summary><ul class="cells">{items}</ul></details>'


# ------------------------------------------------------------------ loss curves

# the curves a training cell's panel draws: its own (curve.losses, the applied steps'), then its references
# (matrix/results/curves.py), each with a colour, a dash pattern and a marker shape of its own, so that a
# reference drawn over an identical curve still shows
CURVE_SERIES = (
    ("cell", "the cell", "#1f5fbf", "", "circle"),
    ("torch_engine", "torch engine", "#d97706", "5 3", "square"),
    ("fp32_twin", "fp32 twin", "#15803d", "2 2", "diamond"),
)
CURVE_WIDTH, CURVE_HEIGHT = 320, 160
CURVE_PLOT = (46, 8, 312, 112)  # left, top, right, bottom of the plot area inside the SVG
OUTSIDE_COLOUR = "#dc2626"


def loss_value(value) -> float | None:
    """A loss as results.json holds it: a finite float, else None (not drawn)."""
    number = recorded_float(value)
    return number if number is not None and math.isfinite(number) else None


def loss_text(value, spec: str = ".5g") -> str:
    number = loss_value(value)
    return format(number, spec) if number is not None else str(value)


def curve_comparisons(metrics: dict) -> tuple[list, Curve | None]:
    """The cell's own losses and its curve record (typed, None when it records none)."""
    typed = CellMetrics.from_dict(metrics)
    curve = typed.curve if isinstance(typed.curve, Curve) else None
    # the applied steps' losses (what the references are compared with); a run before them: every attempt's
    losses = given(curve.losses) if curve is not None else None
    if not isinstance(losses, list):
        losses = given(typed.train_losses)
    return (losses if isinstance(losses, list) else []), curve


def curve_series(metrics: dict) -> list[tuple[str, str, str, str, str, list]]:
    """(key, label, colour, dash, marker, losses) of each curve the cell records losses for."""
    losses, curve = curve_comparisons(metrics)
    found = []
    for key, label, colour, dash, marker in CURVE_SERIES:
        if key == "cell":
            values = losses
        else:
            comparison = given(getattr(curve, key)) if curve else None
            values = given(comparison.reference_losses) if isinstance(comparison, CurveComparison) else None
        if isinstance(values, list) and values:
            found.append((key, label, colour, dash, marker, values))
    return found


def _marker(shape: str, x: float, y: float, colour: str) -> str:
    if shape == "square":
        return f'<rect x="{x - 2.5:.1f}" y="{y - 2.5:.1f}" width="5" height="5" fill="{colour}"/>'
    if shape == "diamond":
        points = f"{x:.1f},{y - 3.2:.1f} {x + 3.2:.1f},{y:.1f} {x:.1f},{y + 3.2:.1f} {x - 3.2:.1f},{y:.1f}"
        return f'<polygon points="{points}" fill="{colour}"/>'
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.6" fill="{colour}"/>'


def curve_svg(metrics: dict) -> str:
    """A training cell's loss curve against its references' as a small inline SVG: x the step
    (1..n), y the loss; one polyline with point markers per curve recorded, a legend, the min and
    max of both axes, and a red ring at each reference's first step outside the row. Points that
    are not finite are left out (curve_figure says which). Empty where no curve has a finite point."""
    series = curve_series(metrics) if isinstance(metrics, dict) else []
    finite = [
        (key, label, colour, dash, marker, [(s, v) for s, v in enumerate(map(loss_value, values), 1) if v is not None])
        for key, label, colour, dash, marker, values in series
    ]
    ys = [v for *_, points in finite for _, v in points]
    if not ys:
        return ""
    steps = max(len(values) for *_, values in series)
    left, top, right, bottom = CURVE_PLOT
    low, high = min(ys), max(ys)

    inset = 6  # the first and last points, and the lowest and highest, keep off the frame

    def x_of(step: int) -> float:  # a single step sits in the middle
        if steps == 1:
            return (left + right) / 2
        return left + inset + (right - left - 2 * inset) * (step - 1) / (steps - 1)

    def y_of(value: float) -> float:  # a flat curve sits in the middle
        if high == low:
            return (top + bottom) / 2
        return bottom - inset - (bottom - top - 2 * inset) * (value - low) / (high - low)

    parts = [
        f'<svg class="curve-plot" width="{CURVE_WIDTH}" height="{CURVE_HEIGHT}" '
        f'viewBox="0 0 {CURVE_WIDTH} {CURVE_HEIGHT}" font-size="9" role="img" aria-label="training loss per step">',
        f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="#fafafa" stroke="#bbb"/>',
    ]
    # the axes' ticks: min and max (one tick where they are equal)
    x_ticks = sorted({1, steps})
    y_ticks = sorted({low, high})
    for step in x_ticks:
        x = x_of(step)
        parts.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 3}" stroke="#666"/>')
        parts.append(f'<text x="{x:.1f}" y="{bottom + 12}" text-anchor="middle">{esc(step)}</text>')
    for value in y_ticks:
        y = y_of(value)
        parts.append(f'<line x1="{left - 3}" y1="{y:.1f}" x2="{left}" y2="{y:.1f}" stroke="#666"/>')
        parts.append(f'<text x="{left - 5}" y="{y + 3:.1f}" text-anchor="end">{esc(format(value, ".5g"))}</text>')
    parts.append(f'<text x="{(left + right) / 2:.1f}" y="{bottom + 22}" text-anchor="middle" fill="#555">step</text>')
    middle = (top + bottom) / 2
    parts.append(
        f'<text x="9" y="{middle:.1f}" transform="rotate(-90 9 {middle:.1f})" text-anchor="middle" '
        'fill="#555">loss</text>'
    )
    for key, _label, colour, dash, marker, points in finite:
        if not points:
            continue
        width = "2.4" if key == "cell" else "1.4"
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        coordinates = " ".join(f"{x_of(s):.1f},{y_of(v):.1f}" for s, v in points)
        parts.append(
            f'<polyline class="series" data-series="{esc(key)}" points="{coordinates}" fill="none" '
            f'stroke="{colour}" stroke-width="{width}"{dashes}/>'
        )
        parts += [_marker(marker, x_of(s), y_of(v), colour) for s, v in points]
    # the first step outside the row, against each reference: a red line across the plot at that
    # step (the two curves may lie closer than a pixel) and a red ring on the cell's point there (on
    # the reference's where the cell's is not finite, on the step axis where neither is)
    losses, curve = curve_comparisons(metrics)
    for key, *_ in CURVE_SERIES[1:]:
        comparison = given(getattr(curve, key)) if curve else None
        if not isinstance(comparison, CurveComparison):
            continue
        step = given(comparison.first_step_outside)
        if not isinstance(step, int) or isinstance(step, bool) or not 1 <= step <= steps:
            continue
        value = loss_value(at_step(losses, step))
        if value is None:
            value = loss_value(at_step(given(comparison.reference_losses), step))
        x, y = x_of(step), (bottom if value is None else y_of(value))
        parts.append(
            f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="{OUTSIDE_COLOUR}" '
            'stroke-opacity=".45" stroke-dasharray="3 2"/>'
        )
        parts.append(
            f'<circle class="outside" data-step="{esc(step)}" cx="{x:.1f}" cy="{y:.1f}" r="5.5" '
            f'fill="none" stroke="{OUTSIDE_COLOUR}" stroke-width="2"/>'
        )
    # the legend, one row below the step axis
    x = left
    for key, label, colour, dash, marker, _points in finite:
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(
            f'<line x1="{x}" y1="{CURVE_HEIGHT - 9}" x2="{x + 16}" y2="{CURVE_HEIGHT - 9}" stroke="{colour}" '
            f'stroke-width="{"2.4" if key == "cell" else "1.4"}"{dashes}/>'
        )
        parts.append(_marker(marker, x + 8, CURVE_HEIGHT - 9, colour))
        parts.append(f'<text x="{x + 19}" y="{CURVE_HEIGHT - 6}">{esc(label)}</text>')
        x += 24 + 5 * len(label)
    parts.append("</svg>")
    return "".join(parts)


def curve_lines(metrics: dict) -> list[tuple[str, str]]:
    """What the plot cannot say, one line each as (class, HTML): against each reference, the first
    step outside the row (the step, the two losses, what the row allowed) or how near the curve
    came; why a reference was not compared or failed itself; the points not drawn."""
    losses, curve = curve_comparisons(metrics)
    lines = []
    for key, label, *_ in CURVE_SERIES[1:]:
        comparison = given(getattr(curve, key)) if curve else None
        if not isinstance(comparison, CurveComparison):
            continue
        name = given(comparison.reference) or label
        error, unchecked = given(comparison.reference_error), given(comparison.unchecked)
        step, worst = given(comparison.first_step_outside), given(comparison.worst_step)
        if error:
            lines.append(("error", f"the {esc(name)}'s own run failed, nothing to compare with: {esc(error)}"))
        elif unchecked:
            lines.append(("unchecked", f"not compared with the {esc(name)}: {esc(unchecked)}"))
        elif step is not None:
            value, reference = at_step(losses, step), at_step(given(comparison.reference_losses), step)
            difference = (
                f" (|difference| {abs(loss_value(value) - loss_value(reference)):.2g})"
                if loss_value(value) is not None and loss_value(reference) is not None
                else ""
            )
            # how far past the row the step went, where both losses are numbers (a loss that is not
            # finite left it by no measurable share)
            allowed = loss_value(at_step(given(comparison.allowed), step))
            margin = (
                f", {share_words(abs(loss_value(value) - loss_value(reference)) / allowed, row_name(comparison))}"
                if difference and allowed
                else ""
            )
            lines.append(
                (
                    "outside",
                    f"leaves the {esc(name)}'s curve at step {esc(step)}: {esc(loss_text(value))} vs "
                    f"{esc(loss_text(reference))}{esc(difference)}, allowed "
                    f"{esc(loss_text(at_step(given(comparison.allowed), step), '.2g'))}{esc(margin)}",
                )
            )
        elif worst is not None:
            compared = given(comparison.steps_compared)
            over = f" over {esc(compared)} step{'s' if compared != 1 else ''}" if compared is not None else ""
            share = loss_value(given(comparison.worst_share))
            nearest = f"{share:.1%}" if share is not None else esc(given(comparison.worst_share))
            lines.append(
                (
                    "within",
                    f"within the {esc(name)}'s row{over}; nearest at step {esc(worst)}, {nearest} of what it allows"
                    + (f" (the {esc(row_name(comparison))} row)" if row_name(comparison) else ""),
                )
            )
    skipped = [
        f"{label} at step {step} ({esc(value)})"
        for _key, label, *_, values in curve_series(metrics)
        for step, value in enumerate(values, 1)
        if loss_value(value) is None
    ]
    if skipped:
        lines.append(("skipped", f"not drawn, not finite: {'; '.join(skipped)}"))
    return lines


def row_name(comparison: CurveComparison) -> str | None:
    """The name of the row that judged the comparison ("master-weights bfloat16": matrix/checks/tolerances.py
    names the rows it derives); None for a row without one (an older run's)."""
    tolerance = given(comparison.tolerance)
    row = tolerance.get("row") if isinstance(tolerance, dict) else None
    return row if isinstance(row, str) and row else None


def curve_figure(metrics) -> str:
    """A training cell's loss curve in its details panel: the SVG and its lines; empty for a cell
    that records neither losses nor a curve (an eval cell, an older run)."""
    if not isinstance(metrics, dict):
        return ""
    losses, curve = curve_comparisons(metrics)
    if not losses and curve is None:
        return ""
    svg = curve_svg(metrics)
    lines = curve_lines(metrics)
    if not svg and not lines:
        return ""
    text = "".join(f'<p class="{kind}">{line}</p>' for kind, line in lines)
    return f'<div class="curve">{svg or "<p>no finite loss to draw</p>"}{text}</div>'


# ------------------------------------------------------------------ sections


def header(document: dict, shown: Reach) -> str:
    run, env, counts = document["run"], document["environment"], document.get("counts", {})
    packages = env.get("packages") or {}
    stack = ", ".join(f"{name} {version}" for name, version in packages.items() if version)
    gpus = [
        f"cuda:{gpu.get('index')} {gpu.get('name')} (compute capability {gpu.get('compute_capability')}, "
        f"{gpu.get('total_memory_gib')} GiB, native bf16: {'yes' if gpu.get('native_bf16') else 'no'})"
        for gpu in env.get("cuda_devices") or []
    ]
    commit = esc(run.get("git_commit") or "unknown") + (" (dirty)" if run.get("git_dirty") else "")
    rows = [
        ("command", f"<code>{esc(run.get('command'))}</code>"),
        (
            "duration",
            f"{seconds(run.get('duration_s'))} ({esc(run.get('started_at'))} to {esc(run.get('finished_at'))})",
        ),
        ("stack", esc(stack)),
        (
            "version stack",
            f"<code>{esc(run['stack'])}</code>" if run.get("stack") else "none (an environment of its own)",
        ),
        ("project commit", commit),
        ("machine", f"{esc(env.get('cpu'))}, {esc(env.get('cpu_count'))} CPUs ({esc(hardware_line(env))})"),
        ("GPUs", "<br>".join(map(esc, gpus)) or "no CUDA device"),
    ]
    if run.get("shard"):
        rows.append(("shard", esc(run["shard"])))
    if run.get("order_seed") is not None:
        rows.append(("cell order", f"shuffled by <code>--order-seed {esc(run['order_seed'])}</code>"))
    if run.get("merged_from"):
        rows.append(("merged", f'from {len(run["merged_from"])} runs, <a href="#merged-from">listed below</a>'))
    unexercised = len(passed_without_precision(document["cells"]))
    labels = (
        ("failed", "failures not in the catalogue"),
        ("fixed", "fixed"),
        ("inapplicable", "not applicable here"),
        ("known", "known"),
        ("passed", "passed" + (f" ({unexercised} without the precision exercised)" if unexercised else "")),
    )  # the cells that ran; the skipped ones are the next line's (reach_line)
    badges = "".join(
        f'<span class="{outcome_class(o)}">{esc(counts.get(o, 0))} '
        f"{label.replace('failures', 'failure', 1) if counts.get(o, 0) == 1 else label}</span>"
        for o, label in labels
    )
    ran = ran_here(document)
    headline = (
        f"{badges} of {ran} cells that ran here"
        if ran
        else f'<span class="warning nothing-ran">{esc(nothing_ran_line(document))}</span>'
    )
    banners = "".join(f'<p class="warning">warning: {esc(w)}</p>' for w in env.get("warnings") or [])
    missing = document.get("missing") or []
    if missing:
        shards = sorted({m["shard"] or "unsharded" for m in missing})
        ids = ", ".join(f"<code>{esc(m['id'])}</code>" for m in missing)
        banners = (
            f'<div class="warning incomplete" id="missing">incomplete run: {len(missing)} selected cells never '
            f"reported ({esc(', '.join(shards))}): missing, neither passed nor failed"
            f"<details><summary>cells</summary>{ids}</details></div>" + banners
        )
    elif run.get("incomplete"):
        banners = '<p class="warning incomplete">incomplete run: not every selected cell reported</p>' + banners
    return (
        f"<header><h1>Mixed-precision matrix: run <code>{esc(run.get('id'))}</code></h1>{banners}"
        f'<p class="counts">{headline}</p>{reach_line(document, shown)}'
        f"{kv_table(rows)}</header>"
    )


def reach_line(document: dict, shown: Reach) -> str:
    """How many cells did not run here, and how many of them the grids leave out (reach.py)."""
    sentence = not_run_sentence(document, shown, lambda text: f'<a href="#not-run">{text}</a>')
    return f'<p class="reach">{sentence}</p>'


def cell_label(cell: dict) -> tuple[str, str]:
    """The short text a grid cell shows, and its tooltip; a known, fixed or not applicable cell
    shows its catalogue entry's id (the same on every page and every run)."""
    outcome, signature = cell.get("outcome"), cell.get("signature") or {}
    entry = cell.get("known_failure") or {}
    key = entry.get("id")
    if outcome == "passed":
        instead = ran_instead(cell)
        if instead:  # passed, but not in the precision it is filed under
            short = "no autocast" if instead == "without autocast" else instead.removeprefix("with ")
            return f"✓ {short}", f"passed without the precision exercised: {not_exercised_line(cell)}"
        return "✓", "passed"
    if outcome == "failed":
        return signature.get("id", "failed"), f"not in the catalogue: {signature.get('text')}"
    if outcome == "known":
        return str(key), f"known failure {entry.get('id')}: {signature.get('text')}"
    if outcome == "fixed":
        return f"fixed {key}", f"passed, although {entry.get('id')} says it fails: {entry.get('title')}"
    if outcome == "inapplicable":
        unmet = ", ".join(entry.get("not_holding") or []) or "its hardware condition"
        return f"n/a {key}", f"passed; {entry.get('id')} does not apply on this machine ({unmet} does not hold)"
    if outcome == "skipped":
        return "skip", f"skipped: {cell.get('skip_reason')}"
    return str(outcome), str(outcome)


def grids(document: dict, shown: Reach) -> str:
    """One table per device and engine with a cell that ran or skipped alone (reach.py): models
    as rows, precision x mode as columns, each only where it has such a cell."""
    cells = [cell for cell in document["cells"] if cell["id"] in shown.shown]
    order = shown.axes
    by_axes = {tuple(cell[axis] for axis in AXES): cell for cell in cells}
    pairs = {(cell["device"], cell["engine"]) for cell in cells}
    tables = []
    for device in order["device"]:
        on_device = [cell for cell in cells if cell["device"] == device]
        columns = [
            (precision, mode)
            for precision in order["precision"]
            for mode in order["mode"]
            if any(c["precision"] == precision and c["mode"] == mode for c in on_device)
        ]
        precisions = list(dict.fromkeys(precision for precision, _ in columns))
        head = (
            '<tr><th rowspan="2" scope="col">model</th>'
            + "".join(
                f'<th colspan="{sum(p == precision for p, _ in columns)}" scope="colgroup">{esc(precision)}</th>'
                for precision in precisions
            )
            + "</tr><tr>"
            + "".join(f'<th scope="col">{esc(mode)}</th>' for _, mode in columns)
            + "</tr>"
        )
        for engine in order["engine"]:
            if (device, engine) not in pairs:
                continue
            rows = []
            for model in order["model"]:
                if not any(c["model"] == model and c["engine"] == engine for c in on_device):
                    continue
                tds = []
                for precision, mode in columns:
                    cell = by_axes.get((model, precision, mode, device, engine))
                    if cell is None:
                        tds.append('<td class="empty"></td>')
                        continue
                    label, tip = cell_label(cell)
                    unexercised = " unexercised" if cell.get("outcome") == "passed" and ran_instead(cell) else ""
                    tds.append(
                        f'<td class="{outcome_class(cell.get("outcome"))}{unexercised}" data-cell="{esc(cell["id"])}" '
                        f'title="{esc(cell["id"] + chr(10) + tip)}">'
                        f'<a href="{esc(href("cell", cell["id"]))}">{esc(label)}</a></td>'
                    )
                rows.append(f'<tr><th scope="row">{esc(model)}</th>{"".join(tds)}</tr>')
            tables.append(
                f'<table class="grid" id="{esc(anchor("grid", f"{device}-{engine}"))}" '
                f'data-device="{esc(device)}" data-engine="{esc(engine)}">'
                f"<caption>{esc(device)} · {esc(engine)}</caption>{head}{''.join(rows)}</table>"
            )
    legend = " ".join(
        f'<span class="{classes}">{label}</span>'
        for classes, label in (
            (outcome_class("passed"), "✓ passed"),
            (
                f"{outcome_class('passed')} unexercised",
                "✓ no autocast (or another autocast named): passed, the precision not exercised",
            ),
            (outcome_class("known"), "<i>entry id</i>: known failure"),
            (outcome_class("failed"), "sig-…: not in the catalogue"),
            (outcome_class("fixed"), "fixed <i>entry id</i>: passes, the catalogue says it fails"),
            (outcome_class("inapplicable"), "n/a <i>entry id</i>: the entry's hardware condition does not hold here"),
            (outcome_class("skipped"), "skip"),
        )
    )
    return (
        f'<section id="grids"><h2>Grids</h2><p class="counts">{legend}</p>'
        "<p>Hover a cell for its failure or skip reason; click it for the details.</p>"
        f"{''.join(tables)}</section>"
    )


def traceback_html(traceback: str) -> str:
    """A cell's traceback, folded in its panel: the user's and the libraries' frames shown, each
    run of the harness's frames (and a rank failure's driver side) a <details> of its own."""
    segments = tracebacks.shown(traceback)
    parts = []
    for segment in segments:
        if segment.folded:
            parts.append(
                f'<details class="harness"><summary>{esc(segment.line.strip())}</summary>'
                f"<pre>{pre_text(segment.text)}</pre></details>"
            )
        else:
            parts.append(f"<pre>{pre_text(segment.text)}</pre>")
    lines = traceback.rstrip("\n").count("\n") + 1
    folded = tracebacks.harness_frames(segments)
    summary = f"{lines} lines"
    if folded:
        summary += f", {folded} frame{'s' if folded != 1 else ''} of the harness folded"
    return f'<details class="traceback"><summary>{summary}</summary>{"".join(parts)}</details>'


def cell_detail(cell: dict) -> str:
    rows = [("outcome", f'<span class="{outcome_class(cell.get("outcome"))}">{esc(cell.get("outcome"))}</span>')]
    unexercised = not_exercised_line(cell) if cell.get("outcome") != "skipped" else None
    if unexercised:
        rows.append(("precision exercised", f"<strong>no</strong>: {esc(unexercised)}"))
    rows.append(("axes", esc(" · ".join(str(cell.get(axis)) for axis in AXES))))
    if cell.get("phase"):
        rows.append(("phase", esc(cell["phase"])))
    if cell.get("phases"):
        rows.append(("phases", esc(", ".join(f"{name}: {state}" for name, state in cell["phases"].items()))))
    for key in ("cuda_index", "device_name"):
        if cell.get(key) is not None:
            rows.append((key.replace("_", " "), esc(cell[key])))
    rows.append(("duration", seconds(cell.get("duration_s"))))
    signature = cell.get("signature")
    if signature:
        rows.append(
            (
                "signature",
                f'<a href="{esc(href("signature", signature.get("id")))}"><code>{esc(signature.get("id"))}</code></a> '
                f"<code>{esc(signature.get('text'))}</code>"
                + kv_table([(k, esc(signature.get(k))) for k in ("phase", "exception", "message", "origin")]),
            )
        )
    if cell.get("message"):
        rows.append(("message", f"<pre>{pre_text(cell['message'])}</pre>"))
    if cell.get("traceback"):  # folded: the message says what failed, the traceback where
        rows.append(("traceback", traceback_html(cell["traceback"])))
    if cell.get("skip_reason"):
        rows.append(("skip reason", esc(cell["skip_reason"])))
    entry = cell.get("known_failure")
    if entry:
        rows.append(
            (
                "catalogue entry",
                f'<a href="{esc(href("known", entry.get("id")))}"><code>{esc(entry.get("id"))}</code></a>: '
                f"{esc(entry.get('title'))}"
                + kv_table(
                    [
                        ("kind", esc(entry.get("kind"))),
                        ("upstream", ", ".join(upstream_link(u) for u in entry.get("upstream") or []) or "none"),
                        ("link", link(entry.get("link"), entry.get("link"))),
                    ]
                ),
            )
        )
    if cell.get("leaked_state"):
        rows.append(("left global state changed", leaks_table(cell["leaked_state"])))
    rerun = cell.get("rerun") or f"pytest 'cases/test_cells.py::test_cell[{cell['id']}]'"
    rows.append(("re-run", f"<pre>{pre_text(rerun)}</pre>"))
    curve = curve_figure(cell.get("metrics"))
    if curve:
        rows.append(("loss curve", curve))
    if cell.get("metrics"):
        metrics = json.dumps(cell["metrics"], indent=1, default=str, ensure_ascii=False)
        rows.append(("metrics", f"<pre>{pre_text(metrics)}</pre>"))
    return (
        f'<section class="detail" id="{esc(anchor("cell", cell["id"]))}">'
        f'<a class="close" href="#closed" title="close">×</a><h3>{esc(cell["id"])}</h3>{kv_table(rows)}</section>'
    )


def table_section(section_id: str, title: str, intro: str, headers: tuple[str, ...], rows: list[list[str]]) -> str:
    """A section of one table: a title, a sentence, a header row, and rows of cells already
    escaped (HTML); the titles, sentences and headers are this module's own words."""
    head = "".join(f"<th>{header}</th>" for header in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return (
        f'<section id="{section_id}"><h2>{title}</h2><p>{intro}</p>'
        f'<table class="kv"><tr>{head}</tr>{body}</table></section>'
    )


def not_run_section(shown: Reach) -> str:
    """The cells left out of the grids, one line per reason (reach.py), as summary.md has them."""
    if not shown.not_run:
        return ""
    return table_section(
        "not-run",
        f"Not run here: {sum(len(group.cells) for group in shown.not_run)} cells",
        "Left out of the grids: every cell of their device, of their precision column, of their model's cells "
        "in that column (a precision the kind cannot take: left empty in the grid) or of their model x engine row "
        "skipped. Each reason says what they need, and where a machine can give it, the command that runs them "
        "(none: nothing runs them).",
        ("cells", "why", "which", "to run them"),
        [
            [str(len(g.cells)), esc(g.reason), esc(g.scope(shown.axes)), code_spans(command(g, shown.axes) or "none")]
            for g in shown.not_run
        ],
    )


def unexercised_section(document: dict) -> str:
    """The passed cells that did not exercise their precision, by what was asked and what ran
    (matrix/results/exercised.py), as summary.md lists them."""
    unexercised = passed_without_precision(document["cells"])
    if not unexercised:
        return ""
    groups: dict[str, list[str]] = {}
    for cell in unexercised:
        groups.setdefault(asked_and_ran(cell), []).append(cell["id"])
    return table_section(
        "unexercised",
        f"Passed without the precision exercised: {len(unexercised)} cell{'s' if len(unexercised) != 1 else ''}",
        "They passed every check, but the autocast in force in their model's first forward was not the one their "
        "precision declares, or their run held no grad scaler where it asks for one: they say nothing about that "
        "precision here (striped in the grids; each cell's panel "
        "says what ran).",
        ("asked for, and what ran", "cells"),
        [[esc(line), cell_links(ids)] for line, ids in sorted(groups.items(), key=lambda item: -len(item[1]))],
    )


def kind_setups_section(document: dict) -> str:
    """Each kind's one-time work before its first cell (matrix/harness/kind_setup.py)."""
    setups = document.get("kind_setups") or []
    if not setups:
        return ""
    return table_section(
        "kind-setups",
        "One-time work per kind",
        "Done once per kind and process before its first cell, under its own budget; no cell's time or timeout "
        "includes it.",
        ("kind", "for", "work", "seconds", "outcome"),
        [
            [
                esc(s.get("kind")),
                esc(s.get("for") or ("train and eval" if s.get("training") else "eval")),  # a library's: its engines'
                esc(", ".join(f"{name} {value:.2f} s" for name, value in (s.get("steps") or {}).items()) or "-"),
                seconds(s.get("seconds")),
                esc(s.get("outcome"))
                + (": " + esc(s["error"]) if s.get("error") else "")
                + f" (budget {seconds(s.get('budget_s'))})",
            ]
            for s in setups
        ],
    )


def leaks_table(leaks: list[dict]) -> str:
    head = "<tr><th>setting</th><th>before</th><th>after</th><th>phase</th><th>put back</th></tr>"
    rows = "".join(
        f"<tr><td><code>{esc(leak.get('setting'))}</code></td><td><code>{esc(leak.get('before'))}</code></td>"
        f"<td><code>{esc(leak.get('after'))}</code></td><td>{esc(leak.get('phase'))}</td>"
        f"<td>{'yes' if leak.get('restored') else '<strong>no</strong>'}</td></tr>"
        for leak in leaks
    )
    return f'<table class="kv">{head}{rows}</table>'


def leaked_state_section(document: dict) -> str:
    """The cells that left process-global state changed (matrix/harness/global_state.py), as summary.md
    lists them: each cell's own finding, put back before the next cell."""
    rows = [
        [
            f'<a href="{esc(href("cell", cell["id"]))}">{esc(cell["id"])}</a>',
            esc(cell.get("outcome")),
            f"<code>{esc(leak.get('setting'))}</code>",
            f"<code>{esc(leak.get('before'))}</code> → <code>{esc(leak.get('after'))}</code>",
            esc(leak.get("phase")),
            "yes" if leak.get("restored") else "<strong>no</strong>",
        ]
        for cell in document["cells"]
        for leak in cell.get("leaked_state") or []
    ]
    if not rows:
        return ""
    cells = len({cell["id"] for cell in document["cells"] if cell.get("leaked_state")})
    return table_section(
        "leaked-state",
        f"Left global state changed: {cells} cell{'s' if cells != 1 else ''}",
        "Settings of the process a cell changed and did not put back (the fp32 matmul precisions, TF32, "
        "deterministic mode, default dtype, autocast, threads, compile configs, environment variables). The "
        "harness put each back before the next cell: a finding of the cell named, never of the one after it.",
        ("cell", "outcome", "setting", "before → after", "phase", "put back"),
        rows,
    )


def signatures_section(document: dict) -> str:
    signatures = document.get("signatures") or {}
    if not signatures:
        return '<section id="signatures"><h2>Failure signatures</h2><p>No cell failed.</p></section>'
    rows = []
    for sig_id, s in signatures.items():
        known = ", ".join(f'<a href="{esc(href("known", k))}">{esc(k)}</a>' for k in s.get("known_as") or [])
        rows.append(
            f'<tr id="{esc(anchor("signature", sig_id))}"><td><code>{esc(sig_id)}</code></td>'
            f"<td>{esc(s.get('phase'))}</td>"
            f"<td>{esc(s.get('exception'))}: {esc(s.get('message'))} @ <code>{esc(s.get('origin'))}</code></td>"
            f"<td>{known or '<strong>not in the catalogue</strong>'}</td>"
            f"<td>{cell_links(s.get('cells') or [])}</td></tr>"
        )
    return (
        '<section id="signatures"><h2>Failure signatures</h2><table class="kv">'
        "<tr><th>signature</th><th>phase</th><th>exception: message @ origin</th><th>known as</th><th>cells</th></tr>"
        f"{''.join(rows)}</table></section>"
    )


def triage_section(triage: dict | None) -> str:
    """The run's triage (python -m matrix triage, its triage.json), when it has one: one row per
    new signature with its classification and script, the drafts and findings folded under it."""
    if not triage:
        return ""
    entries = triage.get("signatures") or []
    if not entries:
        return '<section id="triage"><h2>Triage</h2><p>No new failure: nothing to triage.</p></section>'
    rows, drafts = [], []
    for e in entries:
        signature = e.get("signature") or {}
        script = e.get("script")
        script_cell = f'<a href="{esc(quote(script))}">{esc(script)}</a>' if script else "-"
        rows.append(
            [
                f'<a href="{esc(href("signature", signature.get("id")))}"><code>{esc(signature.get("id"))}</code></a> '
                f"{esc(signature.get('text'))}",
                esc(len(e.get("cells") or [])),
                f'<a href="{esc(href("cell", e.get("smallest_cell")))}"><code>{esc(e.get("smallest_cell"))}</code></a>',
                f"<strong>{esc(e.get('classification'))}</strong>: {esc(e.get('summary'))}",
                script_cell,
            ]
        )
        parts = [f"<li>{esc(line)}</li>" for line in e.get("differed") or []]
        found = f'<ul class="cells">{"".join(parts)}</ul>' if parts else ""
        for title, text in (
            ("draft catalogue entry", e.get("catalogue_entry")),
            ("draft upstream issue", e.get("issue")),
        ):
            if text:
                found += f"<details><summary>{title}</summary><pre>{pre_text(text)}</pre></details>"
        if found:
            drafts.append(f"<h3><code>{esc(signature.get('id'))}</code>: {esc(e.get('classification'))}</h3>{found}")
    section = table_section(
        "triage",
        f"Triage: {len(entries)} new signature{'s' if len(entries) != 1 else ''}",
        "Each new signature's smallest cell run as a standalone script in a fresh process (python -m matrix "
        "triage): reproduces (an upstream candidate), does not reproduce (a harness suspect), another failure.",
        ("signature", "cells", "smallest cell", "classification", "script"),
        rows,
    )
    return section.removesuffix("</section>") + "".join(drafts) + "</section>"


def known_failures_section(document: dict) -> str:
    entries = document.get("known_failures") or {}
    if not entries:
        return '<section id="known-failures"><h2>Known failures</h2><p>No catalogue entry applied.</p></section>'
    rows = "".join(
        f'<tr id="{esc(anchor("known", entry_id))}">'
        f"<td><code>{esc(entry_id)}</code>: {esc(e.get('title'))}</td><td>{esc(e.get('kind'))}</td>"
        f"<td>{', '.join(upstream_link(u) for u in e.get('upstream') or []) or 'found by this matrix'}</td>"
        f"<td>{link(e.get('link'), e.get('link'))}</td>"
        f"<td>{cell_links(e.get('cells') or [])}</td><td>{cell_links(e.get('fixed_cells') or [])}</td>"
        f"<td>{cell_links(e.get('inapplicable_cells') or [])}</td></tr>"
        for entry_id, e in entries.items()
    )
    return (
        '<section id="known-failures"><h2>Known failures (matrix/catalogue/known_failures.toml)</h2><table class="kv">'
        "<tr><th>entry</th><th>kind</th><th>upstream</th><th>link</th><th>known cells</th>"
        f"<th>fixed cells</th><th>not applicable here</th></tr>{rows}</table></section>"
    )


def explorations_section(document: dict) -> str:
    explorations = document.get("explorations") or []
    if not explorations:
        return ""
    rows = []
    for e in explorations:
        if e.get("skip_reason") is not None:
            rows.append(
                f"<tr><td><code>{esc(e.get('target'))}</code></td>"
                f'<td colspan="3">skipped: {esc(e["skip_reason"])}</td></tr>'
            )
            continue
        findings = "".join(
            f"<li><code>{esc((f.get('signature') or {}).get('id'))}</code> ({esc(f.get('status'))}): "
            f"{esc((f.get('signature') or {}).get('text'))}<br>replay: <code>{esc(f.get('replay'))}</code></li>"
            for f in e.get("findings") or []
        )
        findings = f'<ul class="cells">{findings}</ul>' if findings else "none"
        budget = (e.get("budget") or {}).get("examples")
        rows.append(
            f"<tr><td><code>{esc(e.get('target'))}</code></td><td>{esc(e.get('examples_run'))} of {esc(budget)}"
            f" (fp32 failed: {esc(e.get('fp32_failures'))}; stopped by {esc(e.get('stopped_by'))})</td>"
            f"<td>{seconds(e.get('wall_s'))}</td>"
            f"<td>{findings}</td></tr>"
        )
    return (
        '<section id="explorations"><h2>Explorations</h2><table class="kv">'
        f"<tr><th>target</th><th>variants run</th><th>wall</th><th>findings</th></tr>{''.join(rows)}</table></section>"
    )


def environment_section(document: dict) -> str:
    merged = document["run"].get("merged_from")
    section = f'<section id="environment"><h2>Environment</h2>{value_html(document["environment"])}</section>'
    if merged:
        section += f'<section id="merged-from"><h2>Merged from</h2>{value_html(merged)}</section>'
    return section


# ------------------------------------------------------------------ the page


def html_report(document: dict, triage: dict | None = None) -> str:
    """The page for one results.json document, as a string (UTF-8 when written); `triage`: the
    run's triage.json, when python -m matrix triage has run on it."""
    shown = reach(document)
    # a cell left out of the grids has no panel: nothing links to it (every cell that ran is shown)
    details = "".join(cell_detail(cell) for cell in document["cells"] if cell["id"] in shown.shown)
    body = "".join(
        [
            header(document, shown),
            not_run_section(shown),
            grids(document, shown),
            unexercised_section(document),
            kind_setups_section(document),
            leaked_state_section(document),
            f'<div id="details">{details}</div>',
            signatures_section(document),
            triage_section(triage),
            known_failures_section(document),
            explorations_section(document),
            environment_section(document),
        ]
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>matrix run {esc(document['run'].get('id'))}</title><style>{CSS}</style></head>"
        f"<body>{body}</body></html>\n"
    )
