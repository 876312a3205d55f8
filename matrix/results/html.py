"""index.html of one run: a self-contained page (inline CSS, no script, nothing fetched).

`html_report(document)` renders a results.json document (matrix/results/results.schema.json) as a
header (counts, command, stack, machine, warnings), one grid per device x engine (models as
rows, precision x mode as columns, coloured by outcome), a details panel per cell that a click
on the cell shows (CSS :target), the failure signatures, the catalogue entries, the
explorations and the environment.

Every string taken from the document is escaped, in text and in attributes alike; only http(s)
URLs become links, and outcome values become class names only when they are known outcomes.
"""

from __future__ import annotations

import html
import json
import re
from urllib.parse import quote, urlsplit

from matrix.results.files import AXES, OUTCOMES, known_failure_keys
from matrix.results.reach import Reach, reach

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
table.grid td { width: 5.2rem; padding: 0; text-align: center; font: 11px/1.2 ui-monospace, Menlo, monospace; }
table.grid td a { display: block; padding: 5px 2px; color: inherit; text-decoration: none; }
table.grid td a:hover { outline: 2px solid #333; }
.outcome-passed { background: #cdeccd; color: #135c13; }
.outcome-known { background: #ffe08a; color: #6b4a00; }
.outcome-failed { background: #f4a6a6; color: #7a0000; font-weight: 700; }
.outcome-fixed { background: #cbb8f0; color: #3b1c7a; font-weight: 700; }
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
.cells { margin: 0; padding-left: 1.2rem; }
"""


# ------------------------------------------------------------------ small pieces


def esc(value) -> str:
    """Document text as HTML text or attribute value; None is empty."""
    return "" if value is None else html.escape(str(value), quote=True)


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
        ("machine", f"{esc(env.get('cpu'))}, {esc(env.get('cpu_count'))} CPUs"),
        ("GPUs", "<br>".join(map(esc, gpus)) or "no CUDA device"),
    ]
    if run.get("shard"):
        rows.append(("shard", esc(run["shard"])))
    if run.get("merged_from"):
        rows.append(("merged", f'from {len(run["merged_from"])} runs, <a href="#merged-from">listed below</a>'))
    labels = (
        ("failed", "new failures"),
        ("fixed", "fixed"),
        ("known", "known"),
        ("passed", "passed"),
        ("skipped", "skipped"),
    )
    badges = "".join(f'<span class="{outcome_class(o)}">{esc(counts.get(o, 0))} {label}</span>' for o, label in labels)
    banners = "".join(f'<p class="warning">warning: {esc(w)}</p>' for w in env.get("warnings") or [])
    if run.get("incomplete"):
        banners = '<p class="warning incomplete">incomplete run: not every selected cell reported</p>' + banners
    return (
        f"<header><h1>Mixed-precision matrix: run <code>{esc(run.get('id'))}</code></h1>{banners}"
        f'<p class="counts">{badges} of {len(document["cells"])} cells</p>{reach_line(document, shown)}'
        f"{kv_table(rows)}</header>"
    )


def reach_line(document: dict, shown: Reach) -> str:
    """How many cells ran here, and how many the grids leave out (reach.py)."""
    counts = document.get("counts", {})
    ran = len(document["cells"]) - counts.get("skipped", 0)
    left_out = sum(len(group.cells) for group in shown.not_run)
    if not left_out:
        return f'<p class="reach">Ran here: {ran} cells; the grids hold every cell.</p>'
    return (
        f'<p class="reach">Ran here: {ran} cells. Not run here: {left_out} cells, for {len(shown.not_run)} '
        f'reason{"s" if len(shown.not_run) != 1 else ""} (<a href="#not-run">why</a>).</p>'
    )


def cell_label(cell: dict, known_keys: dict) -> tuple[str, str]:
    """The short text a grid cell shows, and its tooltip."""
    outcome, signature = cell.get("outcome"), cell.get("signature") or {}
    entry = cell.get("known_failure") or {}
    key = known_keys.get(entry.get("id"), entry.get("id"))
    if outcome == "passed":
        return "✓", "passed"
    if outcome == "failed":
        return signature.get("id", "failed"), f"new failure: {signature.get('text')}"
    if outcome == "known":
        return str(key), f"known failure {entry.get('id')}: {signature.get('text')}"
    if outcome == "fixed":
        return f"fixed {key}", f"passed, although {entry.get('id')} says it fails: {entry.get('title')}"
    if outcome == "skipped":
        return "skip", f"skipped: {cell.get('skip_reason')}"
    return str(outcome), str(outcome)


def grids(document: dict, known_keys: dict, shown: Reach) -> str:
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
                    label, tip = cell_label(cell, known_keys)
                    tds.append(
                        f'<td class="{outcome_class(cell.get("outcome"))}" data-cell="{esc(cell["id"])}" '
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
        f'<span class="{outcome_class(o)}">{label}</span>'
        for o, label in (
            ("passed", "✓ passed"),
            ("known", "K<i>n</i> known failure"),
            ("failed", "sig-… new failure"),
            ("fixed", "fixed K<i>n</i>: passes, the catalogue says it fails"),
            ("skipped", "skip"),
        )
    )
    return (
        f'<section id="grids"><h2>Grids</h2><p class="counts">{legend}</p>'
        "<p>Hover a cell for its failure or skip reason; click it for the details.</p>"
        f"{''.join(tables)}</section>"
    )


def cell_detail(cell: dict, known_keys: dict) -> str:
    rows = [("outcome", f'<span class="{outcome_class(cell.get("outcome"))}">{esc(cell.get("outcome"))}</span>')]
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
        traceback = cell["traceback"]
        lines = traceback.rstrip("\n").count("\n") + 1
        folded = f"<summary>{lines} lines</summary><pre>{pre_text(traceback)}</pre>"
        rows.append(("traceback", f'<details class="traceback">{folded}</details>'))
    if cell.get("skip_reason"):
        rows.append(("skip reason", esc(cell["skip_reason"])))
    entry = cell.get("known_failure")
    if entry:
        key = known_keys.get(entry.get("id"), "")
        rows.append(
            (
                "catalogue entry",
                f'<a href="{esc(href("known", entry.get("id")))}">{esc(key)}</a> <code>{esc(entry.get("id"))}</code>: '
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
    rerun = cell.get("rerun") or f"pytest 'cases/test_cells.py::test_cell[{cell['id']}]'"
    rows.append(("re-run", f"<pre>{pre_text(rerun)}</pre>"))
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
        "skipped. Each reason says what they need.",
        ("cells", "why", "which"),
        [[str(len(g.cells)), esc(g.reason), esc(g.scope(shown.axes))] for g in shown.not_run],
    )


def kind_setups_section(document: dict) -> str:
    """Each kind's one-time work before its first cell (matrix/kind_setup.py)."""
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
                "train and eval" if s.get("training") else "eval",
                esc(", ".join(f"{name} {value:.2f} s" for name, value in (s.get("steps") or {}).items()) or "-"),
                seconds(s.get("seconds")),
                esc(s.get("outcome"))
                + (": " + esc(s["error"]) if s.get("error") else "")
                + f" (budget {seconds(s.get('budget_s'))})",
            ]
            for s in setups
        ],
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
            f"<td>{known or '<strong>new</strong>'}</td><td>{cell_links(s.get('cells') or [])}</td></tr>"
        )
    return (
        '<section id="signatures"><h2>Failure signatures</h2><table class="kv">'
        "<tr><th>signature</th><th>phase</th><th>exception: message @ origin</th><th>known as</th><th>cells</th></tr>"
        f"{''.join(rows)}</table></section>"
    )


def known_failures_section(document: dict, known_keys: dict) -> str:
    entries = document.get("known_failures") or {}
    if not entries:
        return '<section id="known-failures"><h2>Known failures</h2><p>No catalogue entry applied.</p></section>'
    rows = "".join(
        f'<tr id="{esc(anchor("known", entry_id))}"><td>{esc(known_keys[entry_id])}</td>'
        f"<td><code>{esc(entry_id)}</code>: {esc(e.get('title'))}</td><td>{esc(e.get('kind'))}</td>"
        f"<td>{', '.join(upstream_link(u) for u in e.get('upstream') or []) or 'found by this matrix'}</td>"
        f"<td>{link(e.get('link'), e.get('link'))}</td>"
        f"<td>{cell_links(e.get('cells') or [])}</td><td>{cell_links(e.get('fixed_cells') or [])}</td></tr>"
        for entry_id, e in entries.items()
    )
    return (
        '<section id="known-failures"><h2>Known failures (matrix/known_failures.toml)</h2><table class="kv">'
        "<tr><th>key</th><th>entry</th><th>kind</th><th>upstream</th><th>link</th><th>known cells</th>"
        f"<th>fixed cells</th></tr>{rows}</table></section>"
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


def html_report(document: dict) -> str:
    """The page for one results.json document, as a string (UTF-8 when written)."""
    known_keys = known_failure_keys(document)
    shown = reach(document)
    # a cell left out of the grids has no panel: nothing links to it (every cell that ran is shown)
    details = "".join(cell_detail(cell, known_keys) for cell in document["cells"] if cell["id"] in shown.shown)
    body = "".join(
        [
            header(document, shown),
            not_run_section(shown),
            grids(document, known_keys, shown),
            kind_setups_section(document),
            f'<div id="details">{details}</div>',
            signatures_section(document),
            known_failures_section(document, known_keys),
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
