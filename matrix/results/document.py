"""results.json's document: the run, its machine, the precision table, the cells, and the
indexes a reader starts from (counts, signatures, catalogue entries)."""

from __future__ import annotations

from matrix.results import SCHEMA_VERSION
from matrix.results.files import OUTCOMES


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
    """Catalogue entry id -> the entry and the cells it explained (known), missed (fixed) or
    selected where its hardware condition does not hold (inapplicable)."""
    index: dict[str, dict] = {}
    bucket = {"fixed": "fixed_cells", "inapplicable": "inapplicable_cells"}
    for record in records:
        known = record.get("known_failure")
        if known:
            fields = {key: value for key, value in known.items() if key != "not_holding"}  # per cell
            entry = index.setdefault(known["id"], {**fields, "cells": [], "fixed_cells": [], "inapplicable_cells": []})
            entry[bucket.get(record["outcome"], "cells")].append(record["id"])
    return index


def results_document(
    run: dict,
    environment: dict,
    records: list[dict],
    explorations: list[dict],
    precisions: dict,
    kind_setups: list[dict] = (),
    missing: list[dict] = (),
) -> dict:
    """The whole run; `precisions` is the table the cells ran with (matrix/precisions/policies.py table());
    `kind_setups`: each kind's one-time work, per process (matrix/harness/kind_setup.py); `missing`: the
    cells selected (by this run or, merged, by its shards' plan) that never reported, each with
    the shard that was to run it."""
    records = sorted(records, key=lambda r: (r["device"], r["mode"], r["model"], r["engine"], r["precision"]))
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
        "kind_setups": sorted(kind_setups, key=lambda s: (s["kind"], s["training"], s["pid"])),
        "missing": sorted(missing, key=lambda m: m["id"]),
    }
