"""summary.md: one grid per device and mode, the failures no catalogue entry explains grouped by
signature (each with its first cell's traceback, the harness's frames folded), the passed cells
that did not exercise their precision, fixed cells by catalogue entry, the cells that left global state
changed (by setting), skip reasons, known failures, signatures, the loss curves that came nearest
their rows, the slowest phases, explorations, the precision table."""

from __future__ import annotations

import json
import math
import re

from matrix.results import crash_dump, tracebacks
from matrix.results.exercised import asked_and_ran, passed_without_precision, ran_instead
from matrix.results.files import hardware_line
from matrix.results.metrics import (
    UNSET,
    CellMetrics,
    Curve,
    CurveComparison,
    KindRecord,
    LearningRate,
    at_step,
    given,
    recorded_float,
)
from matrix.results.phase_costs import slowest_phases_markdown
from matrix.results.reach import not_run_sentence, nothing_ran_line, ran_here, reach
from matrix.results.run_them import command

# summary.md goes into a CI job's summary, which GitHub caps at 1 MiB: a new signature's
# traceback there keeps its first lines and innermost frames in this many characters.
SUMMARY_TRACEBACK_LIMIT = 4000
# "Loss curves: the worst deviations" lists this many comparisons, the nearest their rows first
CURVE_ROWS = 10
# a cell's curve record's comparisons (matrix/results/curves.py), in the order the section counts them
CURVE_REFERENCES = (("torch_engine", "torch engine"), ("fp32_twin", "fp32 twin"))


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def inapplicable_markdown(cells: list[dict]) -> list[str]:
    """The cells an entry selects whose hardware condition does not hold on this machine: they
    passed, and nothing is expected of them here (neither fixed nor a failure)."""
    inapplicable = [c for c in cells if c["outcome"] == "inapplicable"]
    if not inapplicable:
        return []
    lines = ["", "## Not applicable here: an entry's hardware condition does not hold on this machine", ""]
    by_entry = grouped(inapplicable, lambda c: c["known_failure"]["id"])
    lines += [f"{len(inapplicable)} cells passed, {len(by_entry)} entries:", ""]
    for entry_id, group in by_entry.items():
        unmet = ", ".join(f"`{name}`" for name in group[0]["known_failure"].get("not_holding") or []) or "a condition"
        lines += folded_cells(f"- entry `{entry_id}` ({unmet} does not hold): {_cells(len(group))}", group)
    return lines


def grouped(cells: list[dict], key) -> dict[str, list[dict]]:
    """Cells by key, the largest group first (then by key): a nightly reader sees the problems,
    not one line per cell."""
    groups: dict[str, list[dict]] = {}
    for cell in cells:
        groups.setdefault(key(cell), []).append(cell)
    return dict(sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])))


def _failures(count: int, number: bool = True) -> str:
    """'1 failure', '2 failures' (number=False: the noun alone)."""
    noun = "failure" if count == 1 else "failures"
    return f"{count} {noun}" if number else noun


def _cells(count: int) -> str:
    return f"**{count} cell{'s' if count != 1 else ''}**"


def folded_cells(line: str, cells: list[dict]) -> list[str]:
    """One list item, with its cells folded below it (a <details> block, as GitHub renders)."""
    ids = ", ".join(f"`{c['id']}`" for c in cells)
    return [line, "  <details><summary>cells</summary>", "", f"  {ids}", "", "  </details>"]


def folded_traceback(traceback: str | None) -> list[str]:
    """A list item's traceback, folded beneath it in a fenced block: one per uncatalogued
    signature, the user's and the libraries' frames shown and the harness's folded to a line each
    (matrix/results/tracebacks.py), at most SUMMARY_TRACEBACK_LIMIT characters of it (the whole
    one is in results.json and index.html)."""
    if not traceback:
        return []
    text = crash_dump.condense(tracebacks.shown_text(traceback), SUMMARY_TRACEBACK_LIMIT).rstrip("\n")
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))
    body = [f"  {line}" if line else "" for line in text.split("\n")]
    return ["  <details><summary>traceback</summary>", "", f"  {fence}", *body, f"  {fence}", "", "  </details>"]


def ran_as_note(cell: dict) -> str:
    """' (ran without autocast)' where the engine put another autocast in force than declared
    (matrix/results/exercised.py)."""
    instead = ran_instead(cell)
    return f" (ran {instead})" if instead else ""


def passed_count(document: dict) -> str:
    """'433 passed (120 without the precision exercised)': the passed cells, and those of them
    whose first forward ran another autocast than their precision declares."""
    unexercised = len(passed_without_precision(document["cells"]))
    return f"{document['counts']['passed']} passed" + (
        f" ({unexercised} without the precision exercised)" if unexercised else ""
    )


def unexercised_markdown(cells: list[dict]) -> list[str]:
    """The passed cells that did not exercise their precision, by what was asked and what ran."""
    unexercised = passed_without_precision(cells)
    if not unexercised:
        return []
    lines = ["", "## Passed without the precision exercised", ""]
    by_line = grouped(unexercised, asked_and_ran)
    lines += [
        f"{_cells(len(unexercised))} passed every check, but the autocast in force in their model's first forward "
        "was not the one their precision declares, or their run held no grad scaler where it asks for one: they say "
        "nothing about that precision here (☑️ in the grids; "
        "each cell's `metrics.effective` in results.json says what ran).",
        "",
    ]
    for line, group in by_line.items():
        lines += folded_cells(f"- {_md(line)}: {_cells(len(group))}", group)
    return lines


def summary_markdown(document: dict) -> str:
    run, env, cells = document["run"], document["environment"], document["cells"]
    packages = env.get("packages", {})
    stack = ", ".join(f"{name} {version}" for name, version in packages.items() if version)
    counts = document["counts"]
    shown = reach(document)
    ran = ran_here(document)
    lines = [
        f"# Mixed-precision matrix: run {run['id']}",
        "",
        (
            f"**{_failures(counts['failed'])} not in the catalogue, {counts['fixed']} fixed, "
            f"{counts['known']} known {_failures(counts['known'], number=False)}, {passed_count(document)}"
            + (f", {counts['inapplicable']} not applicable here" if counts.get("inapplicable") else "")
            + f"** of {ran} cells that ran here, in {run.get('duration_s', 0):.1f} s."
            if ran
            else f"**{nothing_ran_line(document)}** ({run.get('duration_s', 0):.1f} s)."
        ),
        "",
        not_run_sentence(document, shown, lambda text: f"[{text}](#not-run-here)"),
        "",
        f"- command: `{run['command']}`",
        f"- stack: {stack}",
        f"- machine: {env.get('cpu')}, {env.get('cpu_count')} CPUs ({hardware_line(env)}); "
        + (
            "GPUs: "
            + ", ".join(f"cuda:{g['index']} {g['name']} (cc {g['compute_capability']})" for g in env["cuda_devices"])
            if env.get("cuda_devices")
            else "no CUDA device"
        ),
        f"- project commit: {run.get('git_commit') or 'unknown'}{' (dirty)' if run.get('git_dirty') else ''}",
    ]
    if env.get("cuda_devices"):
        gpus = env["cuda_devices"]
        chosen = env.get("selected_cuda_device")
        placement = (
            "each xdist worker on its own GPU (--cuda-device per-worker; see each cell)"
            if run.get("cuda_device") == "per-worker"
            else f"cuda:{chosen} {gpus[chosen]['name']}, PCI {gpus[chosen].get('pci_bus_id') or 'unknown'}"
            if isinstance(chosen, int) and chosen < len(gpus)
            else "unknown"
        )
        lines.append(
            f"- cuda cells ran on: {placement}; driver {env.get('driver_version') or 'unknown'} "
            f"(CUDA {env.get('driver_cuda_version') or 'unknown'}), torch built with CUDA {env.get('torch_cuda')}; "
            f"CUDA_VISIBLE_DEVICES={(env.get('env') or {}).get('CUDA_VISIBLE_DEVICES')}, "
            f"CUDA_DEVICE_ORDER={(env.get('env') or {}).get('CUDA_DEVICE_ORDER')}"
        )
    if run.get("stack"):
        lines.append(f"- version stack: `{run['stack']}`")
    if run.get("order_seed") is not None:
        lines.append(f"- cell order: shuffled by `--order-seed {run['order_seed']}`")
    leaking = [c for c in cells if c.get("leaked_state")]
    if leaking:
        lines.append(
            f"- {_cells(len(leaking))} left global state changed (put back before the next cell): "
            "[below](#left-global-state-changed-put-back-before-the-next-cell)"
        )
    lines += [f"- **warning:** {w}" for w in env.get("warnings", [])]
    missing = document.get("missing") or []
    if run.get("incomplete"):
        lines.append(
            f"- **incomplete run:** {len(missing)} selected cells never reported "
            "([missing](#missing-selected-never-reported))"
            if missing
            else "- **incomplete run:** not every selected cell reported"
        )
    if any(c["model"].startswith("hf:") for c in cells):
        lines.append("- transformers architectures (hf: kinds): their table is in [compatibility.md](compatibility.md)")

    fixed = [c for c in cells if c["outcome"] == "fixed"]
    if fixed:
        lines += ["", "## Fixed: the catalogue says these fail, but they pass (narrow the entries)", ""]
        by_entry = grouped(fixed, lambda c: c["known_failure"]["id"])
        lines += [f"{len(fixed)} cells, {len(by_entry)} entries:", ""]
        for entry_id, group in by_entry.items():
            lines += folded_cells(f"- entry `{entry_id}`: {_cells(len(group))}", group)
    lines += inapplicable_markdown(cells)
    new = [c for c in cells if c["outcome"] == "failed"]
    if new:
        lines += ["", f"## Not in the catalogue: {len(new)} failure{'s' if len(new) != 1 else ''} (new here)", ""]
        by_signature = grouped(new, lambda c: c["signature"]["id"])
        lines += [
            "No catalogue entry explains these: new to the catalogue, not necessarily new since an earlier run. "
            "Whether one is a regression only a baseline tells: run the same selection before and after the "
            "change on the same machine, then `python -m matrix diff BASE NEW`.",
            "",
            f"{len(new)} cells, {len(by_signature)} signatures:",
            "",
        ]
        for sig_id, group in by_signature.items():
            lines += folded_cells(f"- `{sig_id}` {_cells(len(group))}: {_md(group[0]['signature']['text'])}", group)
            lines += folded_traceback(group[0].get("traceback"))

    lines += unexercised_markdown(cells)
    lines += leaked_state_markdown(leaking)

    if missing:
        lines += ["", "## Missing: selected, never reported", ""]
        lines += [f"{len(missing)} cells: neither passed nor failed, their shard or process ended before them.", ""]
        for shard, group in grouped(missing, lambda m: m["shard"] or "unsharded").items():
            where = f"shard {shard}" if shard != "unsharded" else "this run"
            lines += folded_cells(f"- {where}: {_cells(len(group))}", group)

    lines += not_run_markdown(shown)
    lines += kind_setups_markdown(document.get("kind_setups") or [])
    skip_reasons: dict[str, str] = {}
    for device, mode in sorted(
        {(c["device"], c["mode"]) for c in cells if c["id"] in shown.shown},
        key=lambda dm: (dm[0] != "cpu", dm[1] != "train"),
    ):
        group = [c for c in cells if c["device"] == device and c["mode"] == mode and c["id"] in shown.shown]
        precisions = [p for p in document["precisions"] if any(c["precision"] == p for c in group)]
        precisions += sorted({c["precision"] for c in group} - set(precisions))
        present = {c["model"] for c in group}
        models = [m for m in run.get("axes", {}).get("model", []) if m in present]
        models += sorted(present - set(models))
        engines_present = {c["engine"] for c in group}
        engines = [e for e in run.get("axes", {}).get("engine", []) if e in engines_present]
        engines += sorted(engines_present - set(engines))
        rows_shown = {(c["model"], c["engine"]) for c in group}
        lines += ["", f"## {device} · {mode}", "", "| model | engine | " + " | ".join(precisions) + " |"]
        lines.append("|---|---|" + "---|" * len(precisions))
        by_key = {(c["model"], c["engine"], c["precision"]): c for c in group}
        for model in models:
            for engine in engines:
                if (model, engine) not in rows_shown:
                    continue
                row = []
                for precision in precisions:
                    cell = by_key.get((model, engine, precision))
                    if cell is None:
                        row.append("")
                    elif cell["outcome"] == "failed":
                        row.append(f"❌ `{cell['signature']['id']}` ({cell['phase']})")
                    elif cell["outcome"] == "known":
                        row.append(f"⚠️ `{cell['known_failure']['id']}` ({cell['phase']})")
                    elif cell["outcome"] == "fixed":
                        row.append(f"❗ fixed `{cell['known_failure']['id']}`")
                    elif cell["outcome"] == "inapplicable":
                        row.append(f"➖ n/a `{cell['known_failure']['id']}`")
                    elif cell["outcome"] == "skipped":
                        key = skip_reasons.setdefault(cell["skip_reason"], f"S{len(skip_reasons) + 1}")
                        row.append(f"⏭️ {key}")
                    elif ran_instead(cell):  # passed, but another autocast ran than the precision's
                        row.append("☑️")
                    else:
                        row.append("✅")
                    if cell is not None and cell["outcome"] != "skipped":
                        row[-1] += ran_as_note(cell)
                lines.append(f"| {model} | {engine} | " + " | ".join(row) + " |")

    if skip_reasons:
        lines += ["", "## Skip reasons (in the grids)", "", "| key | reason | cells |", "|---|---|---|"]
        for reason, key in skip_reasons.items():
            count = sum(c["skip_reason"] == reason and c["id"] in shown.shown for c in cells)
            lines.append(f"| {key} | {_md(reason)} | {count} |")

    if document["known_failures"]:
        lines += ["", "## Known failures (matrix/catalogue/known_failures.toml)", ""]
        lines += [
            "| entry | kind | upstream | known cells | fixed cells | not applicable here |",
            "|---|---|---|---|---|---|",
        ]
        for entry_id, entry in document["known_failures"].items():
            upstream = ", ".join(entry["upstream"]) or "found by this matrix"
            lines.append(
                f"| `{entry_id}`: {_md(entry['title'])} | {entry['kind']} | {upstream} "
                f"| {len(entry['cells'])} | {len(entry['fixed_cells'])} "
                f"| {len(entry.get('inapplicable_cells') or [])} |"
            )

    lines += ["", "## Failure signatures", ""]
    if document["signatures"]:
        lines += ["| signature | phase | failure | known as | cells |", "|---|---|---|---|---|"]
        for sig_id, entry in document["signatures"].items():
            failure = f"{entry['exception']}: {entry['message']} @ `{entry['origin']}`"
            known = ", ".join(f"`{k}`" for k in entry["known_as"]) or "**not in the catalogue**"
            lines.append(f"| `{sig_id}` | {entry['phase']} | {_md(failure)} | {known} | {', '.join(entry['cells'])} |")
    else:
        lines.append("No cell failed.")

    lines += curves_markdown(cells)
    lines += slowest_phases_markdown(cells)
    lines += exploration_markdown(document.get("explorations", []))
    lines += model_kinds_markdown(cells)

    lines += [
        "",
        "## Precisions",
        "",
        "| precision | weights | autocast | grad scaler | weights from | gradients |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in document["precisions"].items():
        lines.append(
            f"| {name} | {p['weights_dtype']} | {p['autocast_dtype'] or '-'} | {'yes' if p['grad_scaler'] else '-'} "
            f"| {p['weights_from']} | {p['grad_dtype'] or 'weights dtype'}"
            f"{', accumulate ' + str(p['grad_accumulation']) if p['grad_accumulation'] > 1 else ''} |"
        )
    lines += ["", "Each cell's effective settings (parameter dtypes, autocast dtype in force) are in results.json."]
    return "\n".join(lines) + "\n"


def _at(values, step) -> float | None:
    """values[step - 1] of a per-step list, as a number; None where there is no such step."""
    return recorded_float(at_step(values, step))


def share_text(share: float) -> str:
    """A deviation as a share of what its row allows: "1.4x" past the row, "37%" within it."""
    if math.isnan(share) or share == math.inf:
        return "∞" if share == math.inf else "nan"
    if share >= 1:
        return f"{share:.1f}x"
    if share == 0:
        return "0%"
    if share < 0.001:
        return "<0.1%"
    return f"{share:.0%}" if share >= 0.1 else f"{share:.1%}"


def curve_comparisons(cells: list[dict]) -> tuple[int, list[tuple[dict, str, CurveComparison]], int]:
    """Of the cells' loss curves (matrix/results/curves.py): how many cells record one; each (cell,
    reference, comparison) that was compared (it has a worst step); how many references failed
    themselves (nothing to compare with)."""
    recorded, compared, failed = 0, [], 0
    for cell in cells:
        metrics = cell.get("metrics")
        curve = CellMetrics.from_dict(metrics).curve if isinstance(metrics, dict) else None
        if not isinstance(curve, Curve):
            continue
        recorded += 1
        for key, name in CURVE_REFERENCES:
            comparison = given(getattr(curve, key))
            if not isinstance(comparison, CurveComparison):
                continue
            if given(comparison.reference_error):
                failed += 1
            elif recorded_float(given(comparison.worst_share)) is not None:
                compared.append((cell, name, comparison))
    return recorded, compared, failed


def curves_markdown(cells: list[dict]) -> list[str]:
    """The training cells' loss curves that came nearest their rows or left them (matrix/results/curves.py),
    against either reference, the largest share of what the row allows first: at most CURVE_ROWS.
    Nothing where no cell recorded a curve."""
    recorded, compared, failed = curve_comparisons(cells)
    if not recorded:
        return []
    counts = []
    for _, name in CURVE_REFERENCES:
        against = [c for _, reference, c in compared if reference == name]
        left = sum(given(c.first_step_outside) is not None for c in against)
        counts.append(f"{len(against)} against the {name} ({left} left {'its row' if left == 1 else 'their rows'})")
    # a curve identical to its reference's, step for step, came near nothing: counted, not listed
    deviating = [item for item in compared if recorded_float(given(item[2].worst_share)) != 0]
    identical = len(compared) - len(deviating)
    lines = [
        "",
        "## Loss curves: the worst deviations",
        "",
        f"{recorded} training {'cell' if recorded == 1 else 'cells'} recorded a loss curve; compared step by step, "
        f"{' and '.join(counts)}"
        + (f", {identical} of these identical to their reference step for step" if identical else "")
        + (f"; {failed} {'reference' if failed == 1 else 'references'} failed themselves" if failed else "")
        + (
            f". The {min(len(deviating), CURVE_ROWS)} nearest their rows or past them, the largest share of what "
            "the row allows first (a row allows atol + rtol x |reference| + per_step x (step - 1); a named row is "
            "derived from the measured spread of the right engines of its engine family, "
            "matrix/checks/curve_spread.json):"
            if deviating
            else "."
        ),
    ]
    if not deviating:
        return lines

    def order(item: tuple[dict, str, CurveComparison]) -> tuple:
        cell, reference, comparison = item
        share = recorded_float(given(comparison.worst_share))
        share = math.inf if share is None or math.isnan(share) else share
        return (-share, given(comparison.first_step_outside) is None, cell["id"], reference)

    lines += [
        "",
        "| cell | reference | steps compared | worst step | \\|difference\\| there | allowed there "
        "| share of allowed | row |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell, reference, comparison in sorted(deviating, key=order)[:CURVE_ROWS]:
        worst = given(comparison.worst_step)
        deviation, allowed = _at(given(comparison.deviations), worst), _at(given(comparison.allowed), worst)
        outside = given(comparison.first_step_outside)
        steps = given(comparison.steps_compared)
        if steps is None and isinstance(given(comparison.deviations), list):
            steps = len(comparison.deviations)
        share = share_text(recorded_float(comparison.worst_share))
        # the row's name where the run recorded one (matrix/checks/tolerances.py: its engine family and dtype)
        tolerance = given(comparison.tolerance)
        named = tolerance.get("row") if isinstance(tolerance, dict) else None
        row = f"the {_md(named)} row" if isinstance(named, str) and named else "the row"
        lines.append(
            f"| `{_md(cell['id'])}` | {_md(reference)} | {'-' if steps is None else steps} | "
            f"{'-' if worst is None else worst} | {'-' if deviation is None else format(deviation, '.3g')} | "
            f"{'-' if allowed is None else format(allowed, '.3g')} | {share} | "
            + (
                f"left {row} at step {outside}"
                if outside is not None
                else ("within" if row == "the row" else f"within {row}")
            )
            + " |"
        )
    return lines


def not_run_markdown(shown) -> list[str]:
    """The cells left out of the grids (matrix/results/reach.py), one line per reason."""
    if not shown.not_run:
        return []
    total = sum(len(n.cells) for n in shown.not_run)
    lines = [
        "",
        "## Not run here",
        "",
        f"{total} cells are left out of the grids below: every cell of their device, of their precision column, "
        "of their model's cells in that column (a precision the kind cannot take: left empty in the grid) or of "
        "their model x engine row skipped. Each reason says what they need, and where a machine can give it, "
        "the command that runs them (none: nothing runs them).",
        "",
        "| cells | why | which | to run them |",
        "|---|---|---|---|",
    ]
    for group in shown.not_run:
        runs = command(group, shown.axes) or "none"
        lines.append(f"| {len(group.cells)} | {_md(group.reason)} | {_md(group.scope(shown.axes))} | {_md(runs)} |")
    return lines


def kind_setups_markdown(setups: list[dict]) -> list[str]:
    """Each kind's one-time work (matrix/harness/kind_setup.py): done before its first cell, per process,
    under its own budget; the first cell's time does not include it."""
    if not setups:
        return []
    lines = [
        "",
        "## One-time work per kind",
        "",
        "Done once per kind and process before its first cell, under its own budget (--kind-setup-timeout); "
        "no cell's time or timeout includes it.",
        "",
        "| kind | for | work (s) | seconds | outcome |",
        "|---|---|---|---|---|",
    ]
    for setup in setups:
        work = ", ".join(f"{name} {value:.2f}" for name, value in setup["steps"].items()) or "-"
        outcome = setup["outcome"] + (f": {setup['error']}" if setup.get("error") else "")
        if setup["outcome"] == "timed out":
            outcome = f"**{outcome}** (budget {setup['budget_s']:g} s)"
        used_for = setup.get("for") or ("train and eval" if setup["training"] else "eval")  # a library's: its engines'
        lines.append(f"| {setup['kind']} | {used_for} | {_md(work)} | {setup['seconds']:.2f} | {_md(outcome)} |")
    return lines


def model_kinds_markdown(cells: list[dict]) -> list[str]:
    """What the harness observed about each model kind (matrix/models/observation.py) and the learning
    rate it trained at (matrix/harness/learning_rate.py), from the first cell that recorded them."""
    kinds: dict[str, KindRecord] = {}
    rates: dict[str, LearningRate] = {}
    for cell in cells:
        metrics = CellMetrics.from_dict(cell.get("metrics") or {})
        if metrics.kind is not UNSET:
            kinds.setdefault(cell["model"], metrics.kind)
        if metrics.learning_rate is not UNSET:
            rates.setdefault(cell["model"], metrics.learning_rate)
    if not kinds:
        return []
    lines = [
        "",
        "## Model kinds, as observed",
        "",
        "| model | traits | loss averages over | learning rate | fp32 fall at that rate |",
        "|---|---|---|---|---|",
    ]
    for model, kind in kinds.items():
        observed = kind.observed  # matrix/models/observation.py Observation.as_dict()
        traits = ", ".join(kind.traits) + (" (declared)" if kind.declared_traits is not None else "")
        if observed.get("error"):
            traits += f"; observing failed: {observed['error']}"
        rate = rates.get(model)
        learning = f"{rate.value:g} ({rate.source})" if rate else "-"
        fall = rate.fp32_fall["relative"] if rate else None
        fallen = "-" if fall is None else f"{fall:.1%}"
        lines.append(f"| {model} | {_md(traits)} | {observed['loss_items']} | {learning} | {fallen} |")
    return lines


def exploration_markdown(explorations: list[dict]) -> list[str]:
    if not explorations:
        return []
    ran = [e for e in explorations if e["skip_reason"] is None]
    findings = [f for e in ran for f in e["findings"]]
    lines = [
        "",
        "## Explorations (hypothesis, matrix/explore/exploration.py)",
        "",
        f"{len(ran)} targets explored, {sum(e['examples_run'] for e in ran)} variants run, "
        f"{sum(f['status'] == 'new' for f in findings)} new and {sum(f['status'] == 'known' for f in findings)} "
        "known findings. A variant that passes in fp32 must pass in the target's precision, within its tolerance.",
        "",
        "| target | variants run | fp32 failed | wall s | stopped by | findings |",
        "|---|---|---|---|---|---|",
    ]
    for e in explorations:
        if e["skip_reason"] is not None:
            lines.append(f"| `{e['target']}` | skipped: {_md(e['skip_reason'])} | | | | |")
            continue
        found = ", ".join(f"`{f['signature']['id']}` ({f['status']})" for f in e["findings"]) or "none"
        lines.append(
            f"| `{e['target']}` | {e['examples_run']} of {e['budget']['examples']} | {e['fp32_failures']} "
            f"| {e['wall_s']} | {e['stopped_by']} | {found} |"
        )
    for e in ran:
        for f in e["findings"]:
            known = f"known: `{f['known_failure']['id']}`" if f["known_failure"] else "**new**"
            changed = ", ".join(f"{k}={json.dumps(v)}" for k, v in f["differs_from_base"].items()) or "nothing"
            lines += [
                "",
                f"### `{f['signature']['id']}` in `{e['target']}` ({known})",
                "",
                f"- failure: {_md(f['signature']['text'])}",
                f"- minimal variant, changed from the base: {_md(changed)}",
            ]
            lines += [f"  - `{name}`: {_md(why)}" for name, why in f["needed"].items()]
            lines.append(f"- replay: `{f['replay']}`")
            if f.get("repro"):
                lines.append(f"- standalone script: `{f['repro']}`")
    return lines


LEAKS_SHOWN = 3  # cells listed per setting before the rest are folded


def leaked_state_markdown(leaking: list[dict]) -> list[str]:
    """The cells that left process-global state changed (their `leaked_state`), by setting: a
    finding of the cell named, whatever its outcome, never of the cell after it."""
    if not leaking:
        return []
    lines = ["", "## Left global state changed (put back before the next cell)", ""]
    by_setting = grouped(
        [(cell, leak) for cell in leaking for leak in cell["leaked_state"]], lambda pair: pair[1]["setting"]
    )
    lines += [f"{_cells(len(leaking))}, {len(by_setting)} setting{'s' if len(by_setting) != 1 else ''}:", ""]
    for setting, pairs in by_setting.items():
        lines.append(f"- `{setting}` {_cells(len(pairs))}:")
        rows = [
            f"  - `{cell['id']}` ({cell['outcome']}): {_md(leak['before'])} -> {_md(leak['after'])} "
            f"in `{leak['phase']}`" + ("" if leak["restored"] else " **(could not be put back)**")
            for cell, leak in pairs
        ]
        lines += rows[:LEAKS_SHOWN]
        if rows[LEAKS_SHOWN:]:  # a library that sets it in every cell of its own (Inductor's cache directory)
            folded = rows[LEAKS_SHOWN:]
            lines += [f"  <details><summary>{len(folded)} more</summary>", "", *folded, "", "  </details>"]
    return lines
