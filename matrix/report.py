"""Cell and exploration records and the report directory: results.json, summary.md, junit.xml.

results.json follows matrix/results.schema.json (schema_version below). A report directory is
never overwritten: each run gets reports/<run-id>/, and reports/latest points at the newest.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections import Counter
from pathlib import Path
from xml.etree import ElementTree

from matrix import SCHEMA_VERSION, crash_dump, devices
from matrix.cells import Cell
from matrix.environment import cpu_name
from matrix.html_report import html_report
from matrix.journal import json_safe
from matrix.phases import CellResult
from matrix.precisions import PRECISIONS
from matrix.results_file import OUTCOMES, known_failure_keys
from matrix.signatures import Signature, signature_of_crash

# ------------------------------------------------------------------ records


def _base_record(cell: Cell, outcome: str) -> dict:
    return {
        "id": cell.id,
        **cell.axes(),
        "outcome": outcome,
        "phase": None,
        "phases": {},
        "signature": None,
        "message": None,
        "skip_reason": None,
        "known_failure": None,
        "duration_s": 0.0,
        "metrics": {},
        "cuda_index": None,
        "device_name": None,
        "rerun": None,
    }


def device_placement(cell: Cell, cuda_index: int) -> dict:
    """Which device a cell ran on: the GPU index and name (cuda), or the CPU's name."""
    if cell.device == "cuda":
        gpus = devices.cuda_devices()
        name = gpus[cuda_index]["name"] if cuda_index < len(gpus) else None
        return {"cuda_index": cuda_index, "device_name": name}
    return {"cuda_index": None, "device_name": cpu_name()}


def result_record(result: CellResult) -> dict:
    record = _base_record(result.cell, result.outcome)
    record.update(
        phase=result.phase,
        phases=result.phases,
        signature=result.signature.as_dict() if result.signature else None,
        message=result.message,
        duration_s=result.duration_s,
        metrics=result.metrics,
    )
    return record


def known_failure_record(entry) -> dict:
    return {
        "id": entry.id,
        "title": entry.title,
        "kind": entry.kind,
        "upstream": list(entry.upstream),
        "link": entry.link,
    }


def skipped_record(cell: Cell, reason: str) -> dict:
    record = _base_record(cell, "skipped")
    record["skip_reason"] = reason
    return record


def exploration_record(exploration, catalogue) -> dict:
    """One explored target (matrix/explore.py): its budget, what ran, and each finding."""
    findings = []
    for finding in exploration.findings:
        entry = catalogue.by_id(finding.known_as) if finding.known_as else None
        findings.append(
            {
                "status": finding.status,
                "signature": finding.result.signature.as_dict(),
                "phase": finding.result.phase,
                "message": finding.result.message,
                "known_failure": known_failure_record(entry) if entry else None,
                "variant": finding.variant.only(exploration.fields),
                "differs_from_base": finding.differs_from_base,
                "needed": finding.needed,
                "replay": finding.replay,
                "repro": finding.repro,
                "metrics": finding.result.metrics,
            }
        )
    budget = exploration.budget
    return {
        "target": exploration.target.id,
        **exploration.target.axes(),
        "skip_reason": None,
        "budget": {
            "examples": budget.examples,
            "seconds": budget.seconds,
            "seed": budget.seed,
            "findings": budget.findings,
        },
        "explored_fields": list(exploration.fields),
        "base_variant": exploration.base.only(exploration.fields),
        "examples_run": exploration.examples_run,
        "fp32_runs": exploration.fp32_runs,
        "fp32_failures": exploration.fp32_failures,
        "fp32_failure_examples": exploration.fp32_failure_examples,
        "stopped_by": exploration.stopped_by,
        "wall_s": exploration.wall_s,
        "findings": findings,
    }


def skipped_exploration_record(target: Cell, reason: str) -> dict:
    return {"target": target.id, **target.axes(), "skip_reason": reason, "findings": []}


def harness_failure_record(cell: Cell, phase: str, description: str, duration_s: float = 0.0) -> dict:
    """A cell that failed outside run_cell: a fixture error, or a worker process that died."""
    record = _base_record(cell, "failed")
    signature = signature_of_crash(phase, description.strip().splitlines()[-1] if description.strip() else phase)
    record.update(phase=phase, signature=signature.as_dict(), message=description[-4000:], duration_s=duration_s)
    return record


TIMEOUT_SIGNATURE_MESSAGE = "the cell did not finish within the per-cell timeout"


def timeout_record(cell: Cell, timeout_s: float, stacks: str) -> dict:
    """A cell stopped after --cell-timeout; `stacks` is where it was (pytest-timeout or faulthandler)."""
    record = _base_record(cell, "failed")
    signature = Signature("timeout", "Timeout", TIMEOUT_SIGNATURE_MESSAGE, "<cell timeout>")
    record.update(
        phase="timeout",
        signature=signature.as_dict(),
        message=f"stopped after {timeout_s:g} s\n{crash_dump.condense(stacks)}",
        duration_s=float(timeout_s),
    )
    return record


def crash_record(cell: Cell, cause: str, stacks: str, duration_s: float) -> dict:
    """A cell whose process died: `cause` names the signal (SIGSEGV) or the exit status."""
    record = _base_record(cell, "failed")
    signature = Signature("crash", "ProcessDied", cause, crash_dump.crash_origin(stacks))
    record.update(
        phase="crash",
        signature=signature.as_dict(),
        message=f"the process running this cell died: {cause}\n{crash_dump.condense(stacks)}",
        duration_s=round(duration_s, 4),
    )
    return record


# ------------------------------------------------------------------ results.json


def signature_index(records: list[dict]) -> dict[str, dict]:
    index: dict[str, dict] = {}
    for record in records:
        signature = record["signature"]
        if signature:
            entry = index.setdefault(signature["id"], {**signature, "cells": [], "known_as": []})
            entry["cells"].append(record["id"])
            known = record.get("known_failure")
            if record["outcome"] == "known" and known["id"] not in entry["known_as"]:
                entry["known_as"].append(known["id"])
    return dict(sorted(index.items(), key=lambda item: (-len(item[1]["cells"]), item[0])))


def known_failure_index(records: list[dict]) -> dict[str, dict]:
    """Catalogue entry id -> the entry and the cells it explained (known) or missed (fixed)."""
    index: dict[str, dict] = {}
    for record in records:
        known = record.get("known_failure")
        if known:
            entry = index.setdefault(known["id"], {**known, "cells": [], "fixed_cells": []})
            entry["fixed_cells" if record["outcome"] == "fixed" else "cells"].append(record["id"])
    return index


def results_document(
    run: dict, environment: dict, records: list[dict], explorations: list[dict] = (), precisions: dict | None = None
) -> dict:
    """The whole run; `precisions` is the table the cells ran with (default: this version's)."""
    records = sorted(records, key=lambda r: (r["device"], r["mode"], r["model"], r["engine"], r["precision"]))
    if precisions is None:
        precisions = {name: {**p.settings(), "summary": p.summary} for name, p in PRECISIONS.items()}
    return {
        "schema_version": SCHEMA_VERSION,
        "run": run,
        "environment": environment,
        "precisions": precisions,
        "counts": {outcome: sum(r["outcome"] == outcome for r in records) for outcome in OUTCOMES},
        "cells": records,
        "signatures": signature_index(records),
        "known_failures": known_failure_index(records),
        "explorations": list(explorations),
    }


# ------------------------------------------------------------------ summary.md


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def grouped(cells: list[dict], key) -> dict[str, list[dict]]:
    """Cells by key, the largest group first (then by key): a nightly reader sees the problems,
    not one line per cell."""
    groups: dict[str, list[dict]] = {}
    for cell in cells:
        groups.setdefault(key(cell), []).append(cell)
    return dict(sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])))


def _cells(count: int) -> str:
    return f"**{count} cell{'s' if count != 1 else ''}**"


def folded_cells(line: str, cells: list[dict]) -> list[str]:
    """One list item, with its cells folded below it (a <details> block, as GitHub renders)."""
    ids = ", ".join(f"`{c['id']}`" for c in cells)
    return [line, "  <details><summary>cells</summary>", "", f"  {ids}", "", "  </details>"]


def ran_as_note(cell: dict) -> str:
    """' (ran as fp32)' where the engine put another autocast dtype in force than declared."""
    declared = cell["metrics"].get("declared", {}).get("autocast_dtype")
    effective = cell["metrics"].get("effective", {})
    if "autocast_dtype_in_forward" not in effective:
        return ""
    actual = effective["autocast_dtype_in_forward"]
    if actual == declared:
        return ""
    return f" (ran {'without autocast' if actual is None else 'with ' + actual + ' autocast'})"


def summary_markdown(document: dict) -> str:
    run, env, cells = document["run"], document["environment"], document["cells"]
    packages = env.get("packages", {})
    stack = ", ".join(f"{name} {version}" for name, version in packages.items() if version)
    counts = document["counts"]
    lines = [
        f"# Mixed-precision matrix: run {run['id']}",
        "",
        f"**{counts['failed']} new failures, {counts['fixed']} fixed, {counts['known']} known failures, "
        f"{counts['passed']} passed, {counts['skipped']} skipped** "
        f"of {len(cells)} cells in {run.get('duration_s', 0):.1f} s.",
        "",
        f"- command: `{run['command']}`",
        f"- stack: {stack}",
        f"- machine: {env.get('cpu')}, {env.get('cpu_count')} CPUs; "
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
    lines += [f"- **warning:** {w}" for w in env.get("warnings", [])]
    if run.get("incomplete"):
        lines.append("- **incomplete run:** not every selected cell reported")

    known_keys = known_failure_keys(document)
    fixed = [c for c in cells if c["outcome"] == "fixed"]
    if fixed:
        lines += ["", "## Fixed: the catalogue says these fail, but they pass (narrow the entries)", ""]
        by_entry = grouped(fixed, lambda c: c["known_failure"]["id"])
        lines += [f"{len(fixed)} cells, {len(by_entry)} entries:", ""]
        for entry_id, group in by_entry.items():
            lines += folded_cells(f"- entry `{entry_id}`: {_cells(len(group))}", group)
    new = [c for c in cells if c["outcome"] == "failed"]
    if new:
        lines += ["", "## New failures (no catalogue entry explains them)", ""]
        by_signature = grouped(new, lambda c: c["signature"]["id"])
        lines += [f"{len(new)} cells, {len(by_signature)} signatures:", ""]
        for sig_id, group in by_signature.items():
            lines += folded_cells(f"- `{sig_id}` {_cells(len(group))}: {_md(group[0]['signature']['text'])}", group)

    skip_reasons: dict[str, str] = {}
    for device, mode in sorted(
        {(c["device"], c["mode"]) for c in cells}, key=lambda dm: (dm[0] != "cpu", dm[1] != "train")
    ):
        group = [c for c in cells if c["device"] == device and c["mode"] == mode]
        precisions = [p for p in PRECISIONS if any(c["precision"] == p for c in group)]
        precisions += sorted({c["precision"] for c in group} - set(precisions))
        present = {c["model"] for c in group}
        models = [m for m in run.get("axes", {}).get("model", []) if m in present]
        models += sorted(present - set(models))
        engines_present = {c["engine"] for c in group}
        engines = [e for e in run.get("axes", {}).get("engine", []) if e in engines_present]
        engines += sorted(engines_present - set(engines))
        lines += ["", f"## {device} · {mode}", "", "| model | engine | " + " | ".join(precisions) + " |"]
        lines.append("|---|---|" + "---|" * len(precisions))
        by_key = {(c["model"], c["engine"], c["precision"]): c for c in group}
        for model in models:
            for engine in engines:
                row = []
                for precision in precisions:
                    cell = by_key.get((model, engine, precision))
                    if cell is None:
                        row.append("")
                    elif cell["outcome"] == "failed":
                        row.append(f"❌ `{cell['signature']['id']}` ({cell['phase']})")
                    elif cell["outcome"] == "known":
                        row.append(f"⚠️ {known_keys[cell['known_failure']['id']]} ({cell['phase']})")
                    elif cell["outcome"] == "fixed":
                        row.append(f"❗ fixed {known_keys[cell['known_failure']['id']]}")
                    elif cell["outcome"] == "skipped":
                        key = skip_reasons.setdefault(cell["skip_reason"], f"S{len(skip_reasons) + 1}")
                        row.append(f"⏭️ {key}")
                    else:
                        row.append("✅")
                    if cell is not None and cell["outcome"] != "skipped":
                        row[-1] += ran_as_note(cell)
                lines.append(f"| {model} | {engine} | " + " | ".join(row) + " |")

    if skip_reasons:
        lines += ["", "## Skip reasons", "", "| key | reason | cells |", "|---|---|---|"]
        for reason, key in skip_reasons.items():
            count = sum(c["skip_reason"] == reason for c in cells)
            lines.append(f"| {key} | {_md(reason)} | {count} |")

    if document["known_failures"]:
        lines += ["", "## Known failures (matrix/known_failures.toml)", ""]
        lines += ["| key | entry | kind | upstream | known cells | fixed cells |", "|---|---|---|---|---|---|"]
        for entry_id, entry in document["known_failures"].items():
            upstream = ", ".join(entry["upstream"]) or "found by this matrix"
            lines.append(
                f"| {known_keys[entry_id]} | `{entry_id}`: {_md(entry['title'])} | {entry['kind']} | {upstream} "
                f"| {len(entry['cells'])} | {len(entry['fixed_cells'])} |"
            )

    lines += ["", "## Failure signatures", ""]
    if document["signatures"]:
        lines += ["| signature | phase | failure | known as | cells |", "|---|---|---|---|---|"]
        for sig_id, entry in document["signatures"].items():
            failure = f"{entry['exception']}: {entry['message']} @ `{entry['origin']}`"
            known = ", ".join(f"`{k}`" for k in entry["known_as"]) or "**new**"
            lines.append(f"| `{sig_id}` | {entry['phase']} | {_md(failure)} | {known} | {', '.join(entry['cells'])} |")
    else:
        lines.append("No cell failed.")

    lines += exploration_markdown(document.get("explorations", []))

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


def exploration_markdown(explorations: list[dict]) -> list[str]:
    if not explorations:
        return []
    ran = [e for e in explorations if e["skip_reason"] is None]
    findings = [f for e in ran for f in e["findings"]]
    lines = [
        "",
        "## Explorations (hypothesis, matrix/explore.py)",
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


# ------------------------------------------------------------------ junit.xml


def junit_xml(document: dict) -> bytes:
    cells = document["cells"]
    suite = ElementTree.Element(
        "testsuite",
        name="precision-matrix",
        tests=str(len(cells)),
        failures=str(document["counts"]["failed"]),
        skipped=str(document["counts"]["skipped"] + document["counts"]["known"]),
        errors="0",
        time=f"{sum(c['duration_s'] for c in cells):.3f}",
    )
    for cell in cells:
        case = ElementTree.SubElement(
            suite,
            "testcase",
            classname=f"matrix.{cell['device']}.{cell['engine']}.{cell['mode']}",
            name=cell["id"],
            time=f"{cell['duration_s']:.3f}",
        )
        if cell["outcome"] == "known":
            ElementTree.SubElement(
                case, "skipped", type="pytest.xfail", message=f"known: {cell['known_failure']['id']}"
            )
        elif cell["outcome"] == "failed":
            failure = ElementTree.SubElement(
                case, "failure", message=f"{cell['signature']['id']} {cell['signature']['text']}"
            )
            failure.text = cell["message"] or ""
        elif cell["outcome"] == "skipped":
            ElementTree.SubElement(case, "skipped", message=cell["skip_reason"] or "")
    return ElementTree.tostring(suite, encoding="utf-8", xml_declaration=True)


# ------------------------------------------------------------------ the directory


def create_run_directory(reports_root: Path, run_id: str) -> Path:
    """reports/<run-id>/, created exclusively: a run never writes into another's directory."""
    reports_root.mkdir(parents=True, exist_ok=True)
    directory = reports_root / run_id
    directory.mkdir()  # FileExistsError rather than overwrite
    return directory


def point_latest(reports_root: Path, directory: Path) -> None:
    link = reports_root / "latest"
    temporary = reports_root / f".latest-{secrets.token_hex(4)}"
    try:
        temporary.symlink_to(directory.name, target_is_directory=True)
        os.replace(temporary, link)  # atomic: readers see the old or the new run, never neither
    except OSError:  # no symlinks here (some Windows setups): leave a pointer file instead
        temporary.unlink(missing_ok=True)
        (reports_root / "LATEST").write_text(directory.name + "\n")


def write_documents(directory: Path, document: dict) -> None:
    """results.json, summary.md, junit.xml and index.html of one run, into `directory`."""
    (directory / "results.json").write_text(json.dumps(json_safe(document), indent=2, allow_nan=False) + "\n")
    (directory / "summary.md").write_text(summary_markdown(document))
    (directory / "junit.xml").write_bytes(junit_xml(document))
    (directory / "index.html").write_text(html_report(json_safe(document)), encoding="utf-8")


def write_report(
    reports_root: Path, run: dict, environment: dict, records: list[dict], explorations: list[dict] = ()
) -> Path:
    directory = create_run_directory(reports_root, run["id"])
    write_documents(directory, results_document(run, environment, records, explorations))
    point_latest(reports_root, directory)
    return directory


def fold_journal(directory: Path, incomplete: bool = True) -> dict:
    """results.json and the rest from a run directory's journal (its controller was killed)."""
    from matrix import journal

    state = journal.read(directory)
    if state.run is None:
        raise ValueError(f"{directory / journal.JOURNAL}: no run header: not a run's journal")
    run = {**state.run, "incomplete": incomplete or bool(state.in_flight())}
    run.setdefault("finished_at", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    records = list(state.records.values())
    for _, axes in state.in_flight().values():
        records.append(crash_record(Cell(**axes), "found running when the run's process died", "", 0.0))
    run.setdefault("duration_s", 0.0)
    run.setdefault("pytest_exit_status", None)
    document = results_document(run, state.environment, records, state.explorations)
    write_documents(directory, document)
    point_latest(directory.parent, directory)
    return document


def write_new_directory(target: Path, document: dict) -> None:
    """All of a run's files appear at `target` at once, or none do (built beside it, renamed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.parent / f".{target.name}.partial-{secrets.token_hex(4)}"
    scratch.mkdir()
    try:
        write_documents(scratch, document)
        if target.exists():  # appeared meanwhile: rename would replace an empty directory
            raise FileExistsError(f"{target} exists")
        scratch.rename(target)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch)


def outcome_counts(records: list[dict]) -> Counter:
    return Counter(r["outcome"] for r in records)
