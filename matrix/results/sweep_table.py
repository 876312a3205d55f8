"""The compatibility table of a release sweep (matrix/releases/sweep.py): release x cell, folded.

A sweep document (sweep.json) holds, per release of the swept package, whether it installed
and imported with the rest of the stack and, where it ran, each cell's state. From it:

- `cell_states`: cell id -> release -> state ("passed", "failed <signature id>", "skipped");
  a release that did not install or import has no states;
- `first_changes`: per cell whose state differs between consecutive releases that ran, the
  first release of each change and the state before and after;
- `curve_moves`: per training cell, each release whose loss curve left the row of the curve the
  release before it trained (matrix/results/curves.py): the first release where a curve moved, and the step;
- `nothing_ran`: each release that installed and imported but whose selected cells did not run
  (every one skipped, none was selected, or its run came back without results), with the skips'
  reasons: a sweep decides nothing about such a release, and its page and exit status say so;
- `folded`: rows precision x engine, a column per release, each entry the cells of that row
  counted by state (the models, modes and devices folded together);
- `sweep_markdown` and `sweep_html`: the same as a page;
- `releases_page`: docs/RELEASES.md, every sweep of the published table (matrix/releases/releases.toml).

Standard library only: reading a sweep needs no torch.
"""

from __future__ import annotations

import html
from collections import Counter
from itertools import pairwise

from matrix.results import curves
from matrix.results.files import AXES

RAN = "ran"
# the other packages a release row names (the rest of the stack is in sweep.json)
STACK_SHOWN = ("torch", "transformers", "peft", "accelerate", "lightning", "bitsandbytes")


def cell_state(cell: dict) -> str:
    """What is compared across releases: the raw result, catalogue classification aside (a
    known failure is a failure with its signature, a fixed or inapplicable cell a pass)."""
    if cell["outcome"] in ("passed", "fixed", "inapplicable"):
        return "passed"
    if cell["outcome"] in ("failed", "known"):
        signature = cell.get("signature") or {}
        return f"failed {signature.get('id') or cell.get('phase') or '?'}"
    return cell["outcome"]  # skipped


def releases_ran(document: dict) -> list[str]:
    return [r["version"] for r in document["releases"] if r["status"] == RAN]


def nothing_ran(document: dict) -> list[dict]:
    """Each release whose selected cells did not run, in release order: {version, cells (how many
    were selected), reasons (skip reason -> cells, or the run's own last line)}."""
    empty = []
    for release in document["releases"]:
        cells = list((release.get("cells") or {}).values())
        if release["status"] == "did not run":
            empty.append({"version": release["version"], "cells": 0, "reasons": {release.get("detail") or "?": 0}})
        elif release["status"] == RAN and all(cell["state"] == "skipped" for cell in cells):
            empty.append({"version": release["version"], "cells": len(cells), "reasons": _skip_reasons(cells)})
    return empty


def _skip_reasons(cells: list[dict]) -> dict[str, int]:
    """Skipped cells' reasons -> how many cells, the commonest first."""
    reasons = Counter(cell.get("skip_reason") or "no reason recorded" for cell in cells)
    if not cells:
        reasons["the selection has no cell"] = 0
    return dict(reasons.most_common())


def nothing_ran_line(entry: dict) -> str:
    """`nothing ran in 0.21.1: 8 cells skipped: Requires: [bitsandbytes] (...)`; with several
    reasons, each one's cells after it."""
    counted = len(entry["reasons"]) > 1  # each reason's cells, where there are several reasons
    reasons = "; ".join(f"{reason} ({n})" if n and counted else reason for reason, n in entry["reasons"].items())
    if entry["cells"]:
        cells = f"{entry['cells']} cell{'s' if entry['cells'] != 1 else ''}"
        return f"nothing ran in {entry['version']}: {cells} skipped: {reasons}"
    return f"nothing ran in {entry['version']}: {reasons}"


def run_nothing_ran(document: dict, label: str) -> str | None:
    """A run's (results.json) line where none of its selected cells ran: every one skipped, or
    none was selected (`nox -s stack(...)` fails on it); None where a cell ran."""
    cells = document["cells"]
    if any(cell["outcome"] != "skipped" for cell in cells):
        return None
    return nothing_ran_line({"version": label, "cells": len(cells), "reasons": _skip_reasons(cells)})


def releases_that_ran_cells(document: dict) -> list[str]:
    """The releases some of whose selected cells ran (passed or failed): what a verdict rests on."""
    empty = {entry["version"] for entry in nothing_ran(document)}
    return [version for version in releases_ran(document) if version not in empty]


def _nothing_ran_markdown(document: dict) -> list[str]:
    empty = nothing_ran(document)
    if not empty:
        return []
    lines = [""]
    if not releases_that_ran_cells(document):
        lines += ["**No verdict: the selected cells ran in no release; this sweep decides nothing.**", ""]
    lines += [f"- **{_md(nothing_ran_line(entry))}**" for entry in empty]
    return lines


def cell_states(document: dict) -> dict[str, dict[str, str]]:
    states: dict[str, dict[str, str]] = {}
    for release in document["releases"]:
        for cell_id, cell in (release.get("cells") or {}).items():
            states.setdefault(cell_id, {})[release["version"]] = cell["state"]
    return states


def first_changes(document: dict) -> list[dict]:
    """Each change of a cell's state between consecutive releases that ran it, in release order."""
    order = releases_ran(document)
    changes = []
    for cell_id, by_release in sorted(cell_states(document).items()):
        seen = [(v, by_release[v]) for v in order if v in by_release]
        for (before_version, before), (version, after) in pairwise(seen):
            if before != after:
                changes.append(
                    {
                        "cell": cell_id,
                        "first_release": version,
                        "last_before": before_version,
                        "from": before,
                        "to": after,
                    }
                )
    return changes


def curve_moves(document: dict) -> list[dict]:
    """Each release whose curve of a cell left the row of the curve the previous release that ran
    it trained (the row the cell records), in release order: where a release moved training."""
    order = releases_ran(document)
    by_cell: dict[str, list[tuple[str, dict]]] = {}
    for release in document["releases"]:
        for cell_id, cell in (release.get("cells") or {}).items():
            if cell.get("losses") and cell.get("curve_row"):
                by_cell.setdefault(cell_id, []).append((release["version"], cell))
    moves = []
    for cell_id, seen in sorted(by_cell.items()):
        seen.sort(key=lambda item: order.index(item[0]) if item[0] in order else len(order))
        for (before_version, before), (version, after) in pairwise(seen):
            if len(before["losses"]) != len(after["losses"]):
                continue
            row = curves.CurveTolerance.from_dict(after["curve_row"])
            compared = curves.compare(after["losses"], before["losses"], row, curves.GOLDEN)
            if not compared.held:
                step = compared.first_step_outside
                moves.append(
                    {
                        "cell": cell_id,
                        "first_release": version,
                        "last_before": before_version,
                        "step": step,
                        "before": before["losses"][step - 1],
                        "after": after["losses"][step - 1],
                        "allowed": compared.allowed[step - 1],
                    }
                )
    return moves


def _row_key(cell: dict) -> tuple[str, str]:
    return cell["precision"], cell["engine"]


def folded(document: dict) -> dict[tuple[str, str], dict[str, Counter]]:
    """(precision, engine) -> release -> Counter of states over the row's cells."""
    rows: dict[tuple[str, str], dict[str, Counter]] = {}
    for release in document["releases"]:
        for cell in (release.get("cells") or {}).values():
            rows.setdefault(_row_key(cell), {}).setdefault(release["version"], Counter())[cell["state"]] += 1
    precision_order = {p: i for i, p in enumerate(document.get("axis_order", {}).get("precision", []))}
    engine_order = {e: i for i, e in enumerate(document.get("axis_order", {}).get("engine", []))}
    return dict(
        sorted(
            rows.items(),
            key=lambda item: (precision_order.get(item[0][0], 99), item[0][0], engine_order.get(item[0][1], 99)),
        )
    )


def signature_texts(document: dict) -> dict[str, str]:
    """signature id -> its text, with the catalogue entries that explained it where any did."""
    texts, known = {}, {}
    for release in document["releases"]:
        for cell in (release.get("cells") or {}).values():
            if cell["state"].startswith("failed ") and cell.get("signature_text"):
                signature = cell["state"].split(" ", 1)[1]
                texts.setdefault(signature, cell["signature_text"])
                if cell.get("known_failure"):
                    known.setdefault(signature, set()).add(cell["known_failure"])
    return {
        signature: (f"(known: {', '.join(sorted(known[signature]))}) " if signature in known else "") + text
        for signature, text in texts.items()
    }


def _entry(counter: Counter | None) -> str:
    if not counter:
        return "-"
    parts = []
    for state, n in sorted(counter.items(), key=lambda item: (item[0] != "passed", item[0])):
        label = "ok" if state == "passed" else state.replace("failed ", "")
        parts.append(f"{n} {label}")
    return ", ".join(parts)


def _not_run(release: dict) -> str:
    return f"{release['status']}: {release.get('detail') or ''}".strip().rstrip(":")


def _md(text) -> str:
    return "" if text is None else str(text).replace("|", "\\|").replace("\n", " ")


def _environment(document: dict) -> str:
    if document.get("environment_mb") is None and document.get("environment"):  # --in-this-environment
        return f"in the environment running the sweep ({document['environment']})"
    return f"scratch environment {document.get('environment_mb', '?')} MB"


def sweep_markdown(document: dict) -> str:
    package, releases = document["package"], document["releases"]
    lines = [
        f"# Release sweep: {package}",
        "",
        f"{len(releases)} releases of {package} ({', '.join(r['version'] for r in releases)}); "
        f"stack `{document['stack']}`, selection `{' '.join(document['selection']) or '(every cell)'}`; "
        f"{document.get('wall_s', 0):.0f} s, " + _environment(document) + ".",
    ]
    lines += _nothing_ran_markdown(document)
    lines += [
        "",
        "| release | status | cells | passed | failed | skipped | other packages | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    empty = {entry["version"] for entry in nothing_ran(document)}
    for r in releases:
        counts = Counter(c["state"].split(" ")[0] for c in (r.get("cells") or {}).values())
        packages = r.get("packages") or {}
        others = ", ".join(f"{k} {packages[k]}" for k in STACK_SHOWN if k != package and packages.get(k))
        status = ("**nothing ran**" if r["version"] in empty else "ran") if r["status"] == RAN else _md(_not_run(r))
        lines.append(
            f"| {r['version']} | {status} | {len(r.get('cells') or {})} | {counts['passed']} | {counts['failed']} "
            f"| {counts['skipped']} | {_md(others)} | {r.get('seconds', 0):.0f} |"
        )
    ran = releases_ran(document)
    rows = folded(document)
    if rows:
        lines += ["", "## Precision x engine, by release", ""]
        lines += ["| precision | engine | " + " | ".join(ran) + " |", "|---|---|" + "---|" * len(ran)]
        for (precision, engine), by_release in rows.items():
            lines.append(
                f"| {precision} | {engine} | " + " | ".join(_md(_entry(by_release.get(v))) for v in ran) + " |"
            )
    changes = first_changes(document)
    lines += ["", "## Where a cell changed", ""]
    decided = releases_that_ran_cells(document)
    if not changes and not decided:
        lines.append("No verdict: no release ran a selected cell.")
    elif not changes:
        lines.append(f"No cell changed its state across the {len(decided)} releases whose cells ran.")
    else:
        grouped: dict[tuple, list[str]] = {}
        for change in changes:
            grouped.setdefault(
                (change["first_release"], change["last_before"], change["from"], change["to"]), []
            ).append(change["cell"])
        lines += ["| first release | last before | from | to | cells |", "|---|---|---|---|---|"]
        for (first, last, before, after), cells in grouped.items():
            shown = ", ".join(f"`{c}`" for c in cells[:6]) + (f" and {len(cells) - 6} more" if len(cells) > 6 else "")
            lines.append(f"| {first} | {last} | {before} | {after} | {len(cells)}: {shown} |")
    moves = curve_moves(document)
    if moves or any(c.get("losses") for r in document["releases"] for c in (r.get("cells") or {}).values()):
        lines += ["", "## Where a loss curve moved", ""]
        if not moves:
            lines.append(f"No training curve left the row of the release before it across the {len(ran)} releases.")
        else:
            lines += [
                "| cell | first release | last before | step | before | after | allowed |",
                "|---|---|---|---|---|---|---|",
            ]
            lines += [
                f"| `{m['cell']}` | {m['first_release']} | {m['last_before']} | {m['step']} | {m['before']:.6g} "
                f"| {m['after']:.6g} | {m['allowed']:.3g} |"
                for m in moves
            ]
    texts = signature_texts(document)
    if texts:
        lines += ["", "## Signatures", ""]
        lines += [f"- `{sig}`: {_md(text)}" for sig, text in sorted(texts.items())]
    return "\n".join(lines) + "\n"


CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1rem 1.5rem; }
table { border-collapse: collapse; margin: .5rem 0 1.2rem; }
th, td { border: 1px solid #c8c8c8; padding: 2px 6px; text-align: left; vertical-align: top; }
th { background: #eef0f3; }
td.ok { background: #d4edda; } td.bad { background: #f8d7da; } td.mixed { background: #fff3cd; }
td.none { color: #999; }
code { font: 12px ui-monospace, monospace; }
"""


def _class(counter: Counter | None) -> str:
    if not counter:
        return "none"
    failed = sum(n for state, n in counter.items() if state.startswith("failed"))
    passed = counter.get("passed", 0)
    return "bad" if failed and not passed else "mixed" if failed else "ok" if passed else "none"


def _html_table(headers: tuple[str, ...], rows: list[tuple]) -> str:
    """A table of `headers` over `rows` (each cell already escaped)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def sweep_html(document: dict) -> str:
    e = html.escape
    ran = releases_ran(document)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>Release sweep: {e(document['package'])}</title><style>{CSS}</style></head><body>",
        f"<h1>Release sweep: {e(document['package'])}</h1>",
        f"<p>stack <code>{e(document['stack'])}</code>, selection "
        f"<code>{e(' '.join(document['selection']) or '(every cell)')}</code></p>",
    ]
    empty = nothing_ran(document)
    decided = releases_that_ran_cells(document)
    if empty and not decided:
        parts.append(
            "<p><strong>No verdict: the selected cells ran in no release; this sweep decides nothing.</strong></p>"
        )
    if empty:
        parts.append("<ul>" + "".join(f"<li><strong>{e(nothing_ran_line(x))}</strong></li>" for x in empty) + "</ul>")
    parts.append("<table><tr><th>release</th><th>status</th><th>cells</th><th>seconds</th></tr>")
    empty_versions = {entry["version"] for entry in empty}
    for r in document["releases"]:
        status = ("nothing ran" if r["version"] in empty_versions else "ran") if r["status"] == RAN else _not_run(r)
        parts.append(
            f"<tr><td>{e(r['version'])}</td><td>{e(status)}</td><td>{len(r.get('cells') or {})}</td>"
            f"<td>{r.get('seconds', 0):.0f}</td></tr>"
        )
    parts.append("</table>")
    rows = folded(document)
    if rows:
        parts.append("<h2>Precision x engine, by release</h2><table><tr><th>precision</th><th>engine</th>")
        parts += [f"<th>{e(v)}</th>" for v in ran]
        parts.append("</tr>")
        for (precision, engine), by_release in rows.items():
            parts.append(f"<tr><td>{e(precision)}</td><td>{e(engine)}</td>")
            parts += [f"<td class='{_class(by_release.get(v))}'>{e(_entry(by_release.get(v)))}</td>" for v in ran]
            parts.append("</tr>")
        parts.append("</table>")
    changes = first_changes(document)
    parts.append("<h2>Where a cell changed</h2>")
    if changes:
        rows = [
            (f"<code>{e(c['cell'])}</code>", *map(e, (c["first_release"], c["last_before"], c["from"], c["to"])))
            for c in changes
        ]
        parts.append(_html_table(("cell", "first release", "last before", "from", "to"), rows))
    elif not decided:
        parts.append("<p>No verdict: no release ran a selected cell.</p>")
    else:
        parts.append(f"<p>No cell changed its state across the {len(decided)} releases whose cells ran.</p>")
    moves = curve_moves(document)
    if moves:
        rows = [
            (
                f"<code>{e(m['cell'])}</code>",
                e(m["first_release"]),
                e(m["last_before"]),
                m["step"],
                f"{m['before']:.6g}",
                f"{m['after']:.6g}",
                f"{m['allowed']:.3g}",
            )
            for m in moves
        ]
        parts.append("<h2>Where a loss curve moved</h2>")
        parts.append(_html_table(("cell", "first release", "last before", "step", "before", "after", "allowed"), rows))
    texts = signature_texts(document)
    if texts:
        parts.append("<h2>Signatures</h2><ul>")
        parts += [f"<li><code>{e(sig)}</code>: {e(text)}</li>" for sig, text in sorted(texts.items())]
        parts.append("</ul>")
    parts.append("</body></html>\n")
    return "".join(parts)


def brief_cell(cell: dict) -> dict:
    """What a sweep keeps of a results.json cell."""
    signature = cell.get("signature") or {}
    kept = {axis: cell[axis] for axis in AXES}
    kept.update(
        state=cell_state(cell),
        outcome=cell["outcome"],
        known_failure=(cell.get("known_failure") or {}).get("id"),
        signature_text=signature.get("text"),
        skip_reason=cell.get("skip_reason"),
    )
    losses, row = curves.curve_of(cell)
    if losses:  # a training cell's curve, and the row it is judged by
        kept.update(losses=losses, curve_row=row)
    return kept


def releases_page(documents: list[dict], command: str) -> str:
    """docs/RELEASES.md: every sweep of the published table, one section each."""
    lines = [
        "# Releases: which versions work together",
        "",
        f"Generated by `{command}` from the sweeps in matrix/releases/releases.toml; do not edit by hand.",
        "Each section swaps one package's releases into the default stack (the other packages as",
        "pip resolves them beside it, listed per release) and runs the same cells on each. A",
        "cell's state is its raw result: `ok`, or the failure's signature (catalogued or not).",
        "",
    ]
    if documents:
        first = documents[0]
        lines += [f"Selection: `{' '.join(first['selection'])}`.", ""]
    for document in documents:
        section = sweep_markdown(document).splitlines()
        section[0] = f"## {document['package']}"
        lines += [line if not line.startswith("## ") else "#" + line for line in section] + [""]
    return "\n".join(lines).rstrip() + "\n"
