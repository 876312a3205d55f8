"""compatibility.md: the architecture sweep's table. One row per transformers architecture (an
hf:<model_type> kind) and engine, one column per precision and mode; a red cell carries its
signature and, where the catalogue knows it, its entry. Under it, every failure class with the
architectures it holds, and the architectures that were not built, with why.

Written beside summary.md for a run that has hf: cells (run_directory.py), and as a docs page by
`python -m matrix compatibility RUN --output docs/ARCHITECTURES.md` (nox -s architectures).
Standard library only.
"""

from __future__ import annotations

from matrix.results.files import hardware_line
from matrix.results.markdown import _md, grouped

HF_PREFIX = "hf:"
COLUMN_ORDER = ("train", "eval")


def hf_cells(document: dict) -> list[dict]:
    return [c for c in document["cells"] if c["model"].startswith(HF_PREFIX)]


def architecture(cell_or_model: dict | str) -> str:
    """hf:qwen2 -> qwen2 (of a cell record or a model name)."""
    model = cell_or_model if isinstance(cell_or_model, str) else cell_or_model["model"]
    return model[len(HF_PREFIX) :]


def outcome_mark(cell: dict, known_keys: dict[str, str]) -> str:
    outcome = cell["outcome"]
    if outcome == "passed":
        return "✅"
    if outcome == "failed":
        return f"❌ `{cell['signature']['id']}`"
    if outcome == "known":
        return f"⚠️ {known_keys[cell['known_failure']['id']]}"
    if outcome == "fixed":
        return f"❗ {known_keys[cell['known_failure']['id']]}"
    if outcome == "inapplicable":
        return f"➖ {known_keys[cell['known_failure']['id']]}"
    return "⏭️"


def architecture_counts(cells: list[dict]) -> dict[str, int]:
    """How many architectures: in the table, built (some cell ran), every cell that ran passed,
    with a known failure, with a new failure."""
    by_model = grouped(cells, lambda c: c["model"])
    ran = {m: [c for c in group if c["outcome"] != "skipped"] for m, group in by_model.items()}
    return {
        "architectures": len(by_model),
        "built": sum(1 for group in ran.values() if group),
        "all passed": sum(1 for group in ran.values() if group and all(c["outcome"] == "passed" for c in group)),
        "with known failures": sum(1 for group in ran.values() if any(c["outcome"] == "known" for c in group)),
        "with new failures": sum(1 for group in ran.values() if any(c["outcome"] == "failed" for c in group)),
    }


def compatibility_markdown(document: dict, title: str | None = None) -> str | None:
    """The table of a run's hf: cells, or None when it has none."""
    cells = hf_cells(document)
    if not cells:
        return None
    run, env = document["run"], document["environment"]
    packages = env.get("packages", {})
    stack = ", ".join(f"{name} {version}" for name, version in packages.items() if version)
    # the catalogue entry's id, as every report names it (a per-page K-number named another entry on the next page)
    known_keys = {entry_id: f"`{entry_id}`" for entry_id in document.get("known_failures") or {}}
    counts = architecture_counts(cells)
    outcomes = {
        o: sum(c["outcome"] == o for c in cells)
        for o in ("passed", "known", "fixed", "inapplicable", "failed", "skipped")
    }
    lines = [
        f"# {title or 'Architecture compatibility'}: run {run['id']}",
        "",
        f"**{counts['architectures']} architectures: {counts['built']} built, {counts['all passed']} passed every "
        f"cell that ran, {counts['with known failures']} with known failures, {counts['with new failures']} with "
        f"new failures.** {len(cells)} cells: {outcomes['passed']} passed, {outcomes['known']} known, "
        f"{outcomes['fixed']} fixed, "
        + (f"{outcomes['inapplicable']} not applicable here, " if outcomes["inapplicable"] else "")
        + f"{outcomes['failed']} new, {outcomes['skipped']} skipped, in "
        f"{run.get('duration_s', 0):.0f} s.",
        "",
        f"- command: `{run['command']}`",
        f"- stack: {stack}",
        f"- machine: {env.get('cpu')}, {env.get('cpu_count')} CPUs ({hardware_line(env)})",
        "",
        "✅ passed · ⚠️ `entry` a known failure (the catalogue entry, listed below) · ❌ `sig-…` not in the "
        "catalogue · ❗ `entry` the entry says it fails but it passed · ➖ `entry` passed, the entry does not apply "
        "on this machine's hardware · ⏭️ skipped. Columns where every cell skipped "
        "(a precision no engine here runs) are left out; the skip reasons are listed below.",
    ]
    ran = [c for c in cells if c["outcome"] != "skipped"]
    columns = [
        (precision, mode)
        for mode in COLUMN_ORDER
        for precision in document["precisions"]
        if any(c["precision"] == precision and c["mode"] == mode for c in ran)
    ]
    engines = [e for e in run.get("axes", {}).get("engine", []) if any(c["engine"] == e for c in cells)]
    engines += sorted({c["engine"] for c in cells} - set(engines))
    by_key = {(c["model"], c["engine"], c["precision"], c["mode"]): c for c in cells}
    models = sorted({c["model"] for c in cells}, key=architecture)
    not_built = {m for m in models if not any(c["model"] == m for c in ran)}
    lines += ["", "## The table", ""]
    lines.append("| architecture | engine | " + " | ".join(f"{p} {m}" for p, m in columns) + " |")
    lines.append("|---|---|" + "---|" * len(columns))
    for model in models:
        if model in not_built:
            continue
        for engine in engines:
            marks = [
                outcome_mark(by_key[(model, engine, p, m)], known_keys) if (model, engine, p, m) in by_key else ""
                for p, m in columns
            ]
            lines.append(f"| {_md(architecture(model))} | {engine} | " + " | ".join(marks) + " |")

    failing = [c for c in cells if c["outcome"] in ("failed", "known")]
    if failing:
        lines += ["", "## Failure classes", ""]
        lines += ["| class | kind | architectures | cells | failure |", "|---|---|---|---|---|"]
        classes = grouped(
            failing,
            lambda c: f"known:{c['known_failure']['id']}" if c["outcome"] == "known" else f"new:{c['signature']['id']}",
        )
        for group in classes.values():
            first = group[0]
            if first["outcome"] == "known":
                entry = document["known_failures"][first["known_failure"]["id"]]
                label = known_keys[first["known_failure"]["id"]]
                kind = entry["kind"]
            else:
                label, kind = f"❌ `{first['signature']['id']}`", "**new**"
            names = sorted({architecture(c) for c in group})
            lines.append(
                f"| {label} | {kind} | {len(names)}: {', '.join(names)} | {len(group)} | "
                f"{_md(first['signature']['text'])} |"
            )

    if not_built:
        lines += ["", "## Not built", ""]
        reasons = grouped(
            [next(c for c in cells if c["model"] == m) for m in not_built], lambda c: c.get("skip_reason") or ""
        )
        for reason, group in reasons.items():
            names = ", ".join(sorted(architecture(c) for c in group))
            lines.append(f"- {len(group)}: {names}: {_md(reason)}")

    skipped = grouped([c for c in cells if c["outcome"] == "skipped" and c["model"] not in not_built], _skip)
    if skipped:
        lines += ["", "## Skip reasons of the architectures that were built", ""]
        for reason, group in skipped.items():
            lines.append(f"- {len(group)} cells: {_md(reason)}")

    if document.get("known_failures"):
        used = {c["known_failure"]["id"] for c in cells if c["outcome"] in ("known", "fixed", "inapplicable")}
        if used:
            lines += ["", "## Catalogue entries", ""]
            for entry_id, entry in document["known_failures"].items():
                if entry_id in used:
                    upstream = ", ".join(entry["upstream"]) or "found by this matrix"
                    lines.append(f"- `{entry_id}` ({entry['kind']}; {upstream}): {_md(entry['title'])}")
    return "\n".join(lines) + "\n"


def _skip(cell: dict) -> str:
    return cell.get("skip_reason") or ""
