"""What changed between two runs, and whether it is a regression: python -m matrix diff OLD NEW.

Cells are matched by id. Each change falls in one category (a cell may be in two: a known
failure whose signature changed is in `signature-changed` and `known-stopped`):

  new                failed now (no catalogue entry explains it); passed, fixed, skipped or
                     absent before
  fixed              failing before (failed or known); passes now
  inapplicable       not applicable now: the cell passes where a catalogue entry selects it but the
                     entry's hardware condition does not hold on the new run's machine (a bug's
                     path this hardware does not take), and it was anything else before; neither
                     fixed nor new
  signature-changed  failing in both runs, with different signatures
  added / removed    a cell only in the new / only in the old run
  missing            selected by the new run (merged: planned for one of its shards) but never
                     reported: a shard or process that ended before it; neither passed nor
                     failed, and never merely `removed`
  known-started      a catalogue entry explains a cell now that it did not explain before
  known-stopped      a catalogue entry explained a cell before and does not now
  skipped            ran before (any outcome but skipped); skipped now: coverage lost, as when a
                     nightly runner loses its GPU
  drift              passed in both, but the deviation from the fp32 reference grew by more than
                     a fraction of the cell's tolerance (DRIFT_FRACTION below, --drift-threshold)
  curve-moved        trained in both, and the new training loss curve left the old one's row at
                     some step (the row the cell records: matrix/results/curves.py); named by that step.
                     Against golden curves (matrix/golden/, a slim run) it is what a release did
                     to training
  order-flip         the runs ran their cells in different orders (--order-seed), the cell's
                     verdict (outcome or signature) changed, and a cell of either run left
                     process-global state changed that the harness could not put back (its
                     `leaked_state`, restored false): named with it, the flip is not counted as
                     new, fixed or changed. A leak that was put back cannot reach the next cell,
                     so it explains nothing; a changed verdict between differently ordered runs
                     without such a leak stays in its own category, marked `order_differs`

The gate (exit status 1) is `new` and `missing` unless --fail-on names other categories. Standard library
only: a diff must not need the stack that produced the runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from matrix.grid.packages import STACK
from matrix.results import curves
from matrix.results.metrics import CellMetrics, Tolerance

CATEGORIES = (
    "new",
    "fixed",
    "inapplicable",
    "signature-changed",
    "added",
    "removed",
    "missing",
    "known-started",
    "known-stopped",
    "skipped",
    "drift",
    "curve-moved",
    "order-flip",
)
DEFAULT_FAIL_ON = ("new", "missing")
# Drift is growth of a cell's |loss - fp32 loss| by more than this fraction of what its
# tolerance row allows (matrix/checks/tolerances.py): a cell that moved a quarter of the way to
# failing in one night is worth a look before it fails.
DRIFT_FRACTION = 0.25
FAILING = ("failed", "known")


@dataclass
class Diff:
    old_run: dict
    new_run: dict
    packages: dict[str, tuple]  # name -> (old version, new version), only those that differ
    changes: dict[str, list[dict]] = field(default_factory=lambda: {c: [] for c in CATEGORIES})
    unchanged: int = 0
    # the release that broke each new failure (matrix/releases/new_failures.py), when the diff was
    # asked to bisect (--bisect-budget)
    bisections: list[dict] = field(default_factory=list)

    def gating(self, fail_on) -> dict[str, int]:
        return {category: len(self.changes[category]) for category in fail_on if self.changes[category]}

    def as_dict(self, fail_on=DEFAULT_FAIL_ON) -> dict:
        return {
            "old_run": self.old_run,
            "new_run": self.new_run,
            "packages_changed": {name: {"old": old, "new": new} for name, (old, new) in self.packages.items()},
            "fail_on": list(fail_on),
            "gate": "fail" if self.gating(fail_on) else "pass",
            "counts": {category: len(items) for category, items in self.changes.items()},
            "unchanged_cells": self.unchanged,
            "changes": self.changes,
            "bisections": self.bisections,
        }


def _run_summary(document: dict, source: str) -> dict:
    run, env = document["run"], document["environment"]
    packages = env.get("packages") or {}
    return {
        "id": run["id"],
        "source": source,
        "stack": run.get("stack"),
        "shard": run.get("shard"),
        "git_commit": run.get("git_commit"),
        "started_at": run.get("started_at"),
        "packages": {name: packages.get(name) for name in STACK},
        "gpus": [gpu.get("name") for gpu in env.get("cuda_devices") or []],
        "cells": len(document["cells"]),
        "incomplete": bool(run.get("incomplete")),
        "order_seed": run.get("order_seed"),
    }


def _signature_id(cell: dict) -> str | None:
    return cell["signature"]["id"] if cell.get("signature") else None


def _entry_id(cell: dict) -> str | None:
    return cell["known_failure"]["id"] if cell["outcome"] == "known" and cell.get("known_failure") else None


def _brief(cell: dict | None) -> dict | None:
    """What a change table shows of one side of a cell."""
    if cell is None:
        return None
    signature = cell.get("signature") or {}
    return {
        "outcome": cell["outcome"],
        "phase": cell.get("phase"),
        "signature": signature.get("id"),
        "signature_text": signature.get("text"),
        "known_failure": (cell.get("known_failure") or {}).get("id"),
        "skip_reason": cell.get("skip_reason"),
    }


def _verdict(cell: dict) -> tuple:
    return cell["outcome"], _signature_id(cell)


def unrestored_leaks(document: dict, side: str) -> list[dict]:
    """The cells of a run that left process-global state the harness could not put back: what
    can reach the cells after them in their process."""
    found = []
    for cell in document["cells"]:
        settings = [leak["setting"] for leak in cell.get("leaked_state") or [] if not leak.get("restored", True)]
        if settings:
            found.append({"run": side, "cell": cell["id"], "settings": settings})
    return found


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def drift_of(old: dict, new: dict, fraction: float) -> dict | None:
    """The deviation from fp32 grew by more than `fraction` of what the tolerance allows."""
    before, after = CellMetrics.from_dict(old["metrics"]), CellMetrics.from_dict(new["metrics"])
    old_dev, new_dev = _number(before.fp32_deviation_abs), _number(after.fp32_deviation_abs)
    reference = _number(after.fp32_reference_loss)
    tolerance = after.fp32_tolerance or Tolerance()
    atol, rtol = _number(tolerance.atol), _number(tolerance.rtol)
    if None in (old_dev, new_dev, reference, atol, rtol):
        return None
    allowed = atol + rtol * abs(reference)
    growth = new_dev - old_dev
    if allowed <= 0 or growth <= fraction * allowed:
        return None
    return {
        "old_deviation": old_dev,
        "new_deviation": new_dev,
        "allowed": allowed,
        "growth_of_allowed": round(growth / allowed, 4),
    }


def curve_moved(old: dict, new: dict) -> dict | None:
    """The new run's training losses left the old run's row at some step: the first such step, the
    two losses there and what the row (the new cell's golden_tolerance, else the old's) allowed.
    None where either has no curve, they have different lengths, or the curve held."""
    (losses, row), (reference, old_row) = curves.curve_of(new), curves.curve_of(old)
    row = row or old_row
    if not losses or not reference or len(losses) != len(reference) or not row:
        return None
    compared = curves.compare(losses, reference, curves.CurveTolerance.from_dict(row), curves.GOLDEN)
    if compared.held:
        return None
    step = compared.first_step_outside
    return {
        "step": step,
        "old_loss": reference[step - 1],
        "new_loss": losses[step - 1],
        "allowed": compared.allowed[step - 1],
        "steps": len(losses),
    }


def diff(old: dict, new: dict, *, old_source: str = "", new_source: str = "", drift_fraction=DRIFT_FRACTION) -> Diff:
    old_summary, new_summary = _run_summary(old, old_source), _run_summary(new, new_source)
    packages = {
        name: (old_summary["packages"][name], new_summary["packages"][name])
        for name in STACK
        if old_summary["packages"][name] != new_summary["packages"][name]
    }
    result = Diff(old_summary, new_summary, packages)
    before = {c["id"]: c for c in old["cells"]}
    after = {c["id"]: c for c in new["cells"]}
    missing = {m["id"]: m for m in new.get("missing") or [] if m["id"] not in after}

    def add(category: str, cell_id: str, **extra) -> None:
        result.changes[category].append(
            {"cell": cell_id, "old": _brief(before.get(cell_id)), "new": _brief(after.get(cell_id)), **extra}
        )

    order_differs = old["run"].get("order_seed") != new["run"].get("order_seed")
    leaking = unrestored_leaks(old, "old") + unrestored_leaks(new, "new") if order_differs else []

    for cell_id in sorted(missing):
        add("missing", cell_id, shard=missing[cell_id]["shard"])
    for cell_id in sorted(before.keys() | after.keys()):
        was, now = before.get(cell_id), after.get(cell_id)
        changed = False
        if now is None and cell_id in missing:
            continue
        if was is None:
            add("added", cell_id)
            changed = True
        elif now is None:
            add("removed", cell_id)
            changed = True
        flipped = bool(leaking) and was is not None and now is not None and _verdict(was) != _verdict(now)
        if now is not None and now["outcome"] == "failed" and (was is None or was["outcome"] != "failed"):
            if not (was is not None and was["outcome"] == "known") and not flipped:
                add("new", cell_id, **({"order_differs": True} if order_differs and was is not None else {}))
                changed = True
        if was is None or now is None:
            continue
        if flipped:
            add("order-flip", cell_id, leaking=leaking)  # the order, not the stack, can explain it
            continue
        if was["outcome"] in FAILING and now["outcome"] in ("passed", "fixed"):
            add("fixed", cell_id)
            changed = True
        if now["outcome"] == "inapplicable" and was["outcome"] != "inapplicable":
            add("inapplicable", cell_id, entry=(now.get("known_failure") or {}).get("id"))
            changed = True
        if was["outcome"] in FAILING and now["outcome"] in FAILING and _signature_id(was) != _signature_id(now):
            add("signature-changed", cell_id)
            changed = True
        old_entry, new_entry = _entry_id(was), _entry_id(now)
        if old_entry != new_entry:
            if new_entry:
                add("known-started", cell_id, entry=new_entry)
            if old_entry:
                add("known-stopped", cell_id, entry=old_entry)
            changed = True
        if was["outcome"] != "skipped" and now["outcome"] == "skipped":
            add("skipped", cell_id)
            changed = True
        if was["outcome"] == "passed" and now["outcome"] == "passed":
            drift = drift_of(was, now, drift_fraction)
            if drift:
                add("drift", cell_id, **drift)
                changed = True
        moved = curve_moved(was, now)
        if moved:
            add("curve-moved", cell_id, **moved)
            changed = True
        result.unchanged += not changed and was["outcome"] == now["outcome"]
    return result


# ------------------------------------------------------------------ Markdown


def _md(text) -> str:
    return "" if text is None else str(text).replace("|", "\\|").replace("\n", " ").replace("`", "'")


def _order(run: dict) -> str:
    return "selection's" if run.get("order_seed") is None else f"--order-seed {run['order_seed']}"


def _side(brief: dict | None) -> str:
    if brief is None:
        return "absent"
    if brief["outcome"] in FAILING:
        known = f" as `{brief['known_failure']}`" if brief["outcome"] == "known" else ""
        return f"{brief['outcome']}{known} in {brief['phase']}: `{brief['signature']}`"
    if brief["outcome"] == "skipped":
        return f"skipped ({_md(brief['skip_reason'])})"
    return brief["outcome"]


HEADINGS = {
    "new": "New failures (failed now; passed, skipped or absent before)",
    "fixed": "Fixed (failing before, passing now)",
    "inapplicable": "Not applicable here now (an entry's hardware condition does not hold on the new run's machine)",
    "signature-changed": "Signature changed (failing in both runs)",
    "added": "Cells added",
    "removed": "Cells removed",
    "missing": "Missing (selected, never reported: a shard or process ended before them)",
    "known-started": "Known-failure entries that started matching",
    "known-stopped": "Known-failure entries that stopped matching",
    "skipped": "Newly skipped (ran before, skipped now)",
    "drift": f"Numeric drift (deviation from fp32 grew by more than {DRIFT_FRACTION:.0%} of the tolerance)",
    "curve-moved": "Loss curves that moved (the new curve left the old one's row)",
    "order-flip": "Order flips (another cell order, and a cell that left global state it could not put back)",
}


# the categories whose changes carry numbers: their table's headers, and a change's row
TABLES = {
    "drift": (
        ("cell", "old deviation", "new deviation", "allowed", "growth"),
        lambda i: (
            f"`{i['cell']}`",
            f"{i['old_deviation']:.3g}",
            f"{i['new_deviation']:.3g}",
            f"{i['allowed']:.3g}",
            f"{i['growth_of_allowed']:.0%} of allowed",
        ),
    ),
    "curve-moved": (
        ("cell", "first step outside", "old loss", "new loss", "allowed"),
        lambda i: (
            f"`{i['cell']}`",
            f"{i['step']} of {i['steps']}",
            f"{i['old_loss']:.6g}",
            f"{i['new_loss']:.6g}",
            f"{i['allowed']:.3g}",
        ),
    ),
}


def diff_markdown(result: Diff, fail_on=DEFAULT_FAIL_ON) -> str:
    old, new = result.old_run, result.new_run
    gating = result.gating(fail_on)
    verdict = (
        "**Gate: FAIL** (" + ", ".join(f"{n} {c}" for c, n in gating.items()) + ")"
        if gating
        else f"**Gate: pass** (gating on: {', '.join(fail_on) or 'nothing'})"
    )
    counts = ", ".join(f"{len(items)} {category}" for category, items in result.changes.items() if items)
    lines = [
        f"# Matrix diff: `{old['id']}` → `{new['id']}`",
        "",
        verdict,
        "",
        f"{counts or 'no changes'}; {result.unchanged} cells unchanged.",
        "",
        "| | old | new |",
        "|---|---|---|",
        f"| run | `{_md(old['id'])}` | `{_md(new['id'])}` |",
        f"| version stack | {_md(old['stack'] or '-')} | {_md(new['stack'] or '-')} |",
        f"| commit | {_md((old['git_commit'] or '-')[:12])} | {_md((new['git_commit'] or '-')[:12])} |",
        f"| GPUs | {_md(', '.join(old['gpus']) or 'none')} | {_md(', '.join(new['gpus']) or 'none')} |",
        f"| cell order | {_order(old)} | {_order(new)} |",
        f"| cells | {old['cells']}{' (incomplete)' if old['incomplete'] else ''} "
        f"| {new['cells']}{' (incomplete)' if new['incomplete'] else ''} |",
    ]
    lines += [f"| {name} | {_md(was)} | {_md(now)} |" for name, (was, now) in result.packages.items()]
    for category, items in result.changes.items():
        if not items:
            continue
        gate = " (gates)" if category in fail_on else ""
        lines += ["", f"## {HEADINGS[category]}{gate}", ""]
        if category in TABLES:
            headers, row = TABLES[category]
            lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(row(i)) + " |" for i in items]
        elif category == "order-flip":
            lines += ["| cell | old | new | left global state changed |", "|---|---|---|---|"]
            lines += [
                f"| `{i['cell']}` | {_side(i['old'])} | {_side(i['new'])} | "
                + "; ".join(f"{x['run']} `{x['cell']}`: {_md(', '.join(x['settings']))}" for x in i["leaking"])
                + " |"
                for i in items
            ]
        elif category in ("known-started", "known-stopped"):
            lines += ["| entry | cell | old | new |", "|---|---|---|---|"]
            lines += [
                f"| `{i['entry']}` | `{i['cell']}` | {_side(i['old'])} | {_side(i['new'])} |"
                for i in sorted(items, key=lambda i: (i["entry"], i["cell"]))
            ]
        else:
            lines += ["| cell | old | new |", "|---|---|---|"]
            lines += [f"| `{i['cell']}` | {_side(i['old'])} | {_side(i['new'])} |" for i in items]
        if any(i.get("order_differs") for i in items):
            lines += [
                "",
                "The two runs ran their cells in different orders and no cell left state it could not put back: "
                "re-run a cell alone (its `rerun` command) to tell a regression from an order dependence the "
                "harness does not see.",
            ]
    new_signatures = {i["new"]["signature"]: i["new"]["signature_text"] for i in result.changes["new"]}
    if new_signatures:
        lines += ["", "### New signatures", ""]
        lines += [f"- `{sig}`: {_md(text)}" for sig, text in new_signatures.items()]
    if result.bisections:
        lines += ["", "## Which release broke it (or moved the curve)", ""]
        lines += [
            f"- `{b['signature']}` ({b['cells']} cells; bisected `{b['cell']}`): {_md(bisection_verdict(b))}"
            for b in result.bisections
        ]
    return "\n".join(lines) + "\n"


def bisection_verdict(record: dict) -> str:
    """One line of the diff report for a record."""
    package, status = record["package"], record["status"]
    if status == "found":
        first, last = record["first_changed"], record["last_before"]
        if record["direction"] == "up" and record["signature"] == "curve-moved":  # a move, not a breakage
            line = (
                f"first moved: {package} {first} (last before: {last}; {record['from_state']} -> {record['to_state']})"
            )
        elif record["direction"] == "up":
            line = f"first bad: {package} {first} (last good: {last}; {record['from_state']} -> {record['to_state']})"
        else:
            line = (
                f"{package} went down: the cell changes at {first} (below it, from {last} down, "
                f"{record['from_state']}; from {first} up, {record['to_state']})"
            )
        return line + (f"; repro: {record['repro']}" if record.get("repro") else "")
    if status == "same at both ends":
        return f"not {package}: {record['old']} and {record['new']} give the same result"
    return f"{package} {record['old']} -> {record['new']}: {status} ({record.get('detail')})"


def diff_json(result: Diff, fail_on=DEFAULT_FAIL_ON) -> str:
    return json.dumps(result.as_dict(fail_on), indent=2) + "\n"


def parse_fail_on(text: str) -> tuple[str, ...]:
    """'new,signature-changed' -> the categories; 'none' -> () (report only, never gate)."""
    if text.strip() == "none":
        return ()
    wanted = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [part for part in wanted if part not in CATEGORIES]
    if unknown or not wanted:
        raise ValueError(
            f"--fail-on: {', '.join(map(repr, unknown)) or 'nothing given'}; "
            f"choose from {', '.join(CATEGORIES)} (comma-separated), or none"
        )
    return wanted
