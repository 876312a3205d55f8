"""The report writer: schema, grid, signature table, junit, and never overwriting."""

import json
import re
from pathlib import Path
from xml.etree import ElementTree

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from matrix.grid.cell import Cell
from matrix.precisions.policies import table
from matrix.results import journal
from matrix.results import records as record_builders
from matrix.results.document import results_document
from matrix.results.journal import json_safe
from matrix.results.markdown import summary_markdown
from matrix.results.records import CellRecord
from matrix.results.run_directory import write_report
from matrix.results.signatures import Signature

SCHEMA = json.loads((Path(results_document.__code__.co_filename).parent / "results.schema.json").read_text())
RUN = {
    "id": "run-a",
    "command": "pytest cases",
    "started_at": "2026-01-01T00:00:00Z",
    "finished_at": "2026-01-01T00:00:10Z",
    "duration_s": 10.0,
    "pytest_exit_status": 1,
    "selection": {"device": ["cpu"]},
    "axes": {"model": ["tiny-transformer", "tiny-llama"]},
    "git_commit": None,
    "git_dirty": None,
}
ENV = {
    "python": "3.11",
    "cpu": "x",
    "cpu_count": 2,
    "packages": {"torch": "2", "transformers": "5", "peft": "0", "accelerate": "1"},
    "cuda_devices": [],
    "selected_cuda_device": None,
    "env": {},
    "warnings": [],
}
SIG = Signature(
    "evaluate", "RuntimeError", "expected scalar type Float but found BFloat16", "torch.nn.modules.transformer:forward"
)


def failed(cell):
    record = CellRecord.of(cell, "failed").as_dict()
    record.update(phase="evaluate", signature=SIG.as_dict(), message="RuntimeError: <b>expected</b> | pipe")
    return record


def records():
    return [
        CellRecord.of(Cell("tiny-llama", "fp32", "eval", "cpu"), "passed").as_dict(),
        failed(Cell("tiny-transformer", "bf16-mixed", "eval", "cpu")),
        failed(Cell("tiny-transformer", "bf16-mixed", "train", "cpu")),
        record_builders.skipped_record(
            Cell("tiny-llama", "fp32", "eval", "cuda"), "Requires: [CUDA device] (none visible)"
        ).as_dict(),
    ]


def test_results_json_follows_the_schema(tmp_path):
    directory = write_report(tmp_path, results_document(RUN, ENV, records(), (), table()))
    document = json.loads((directory / "results.json").read_text())
    jsonschema.validate(document, SCHEMA)
    assert document["counts"] == {"passed": 1, "known": 0, "fixed": 0, "inapplicable": 0, "failed": 2, "skipped": 1}
    assert document["signatures"][SIG.id]["cells"] == [
        "tiny-transformer-bf16-mixed-eval-cpu-torch",
        "tiny-transformer-bf16-mixed-train-cpu-torch",
    ]


def test_schema_rejects_a_failed_cell_without_signature(tmp_path):
    document = results_document(RUN, ENV, records(), (), table())
    document["cells"][0]["outcome"] = "failed"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, SCHEMA)


def test_summary_has_grid_skip_reasons_and_signature_table(tmp_path):
    alone = "Requires: [gradients reduced across ranks, in bfloat16] (the torch engine runs one process)"
    cells = [
        *records(),
        record_builders.skipped_record(Cell("tiny-llama", "bf16-mixed", "eval", "cpu"), alone).as_dict(),
        # another engine ran the same model in that column: the skip is the torch engine's, not the kind's
        CellRecord.of(Cell("tiny-llama", "bf16-mixed", "eval", "cpu", "accelerate"), "passed").as_dict(),
    ]
    directory = write_report(tmp_path, results_document(RUN, ENV, cells, (), table()))
    summary = (directory / "summary.md").read_text()
    assert "## cpu · eval" in summary and "## cpu · train" in summary
    # the cuda cell skipped, and so did every other cuda cell: no grid, a line of "Not run here"
    assert "## cuda" not in summary
    not_run = summary.split("## Not run here")[1].split("\n## ")[0]
    which = "engine torch; model tiny-llama; precision fp32; device cuda; mode eval"
    assert f"| 1 | Requires: [CUDA device] (none visible) | {which} |" in not_run
    assert f"| tiny-transformer | torch | ❌ `{SIG.id}` (evaluate) |" in summary
    # a skip whose row and column ran stays in its grid
    assert "| tiny-llama | torch | ✅ | ⏭️ S1 |" in summary.split("## cpu · eval")[1]
    assert f"| S1 | {alone} | 1 |" in summary
    assert "CUDA device" not in summary.split("## Skip reasons")[1].split("\n## ")[0]
    assert f"| `{SIG.id}` | evaluate |" in summary
    # models in registry order, not alphabetical
    eval_section = summary.split("## cpu · eval")[1]
    assert eval_section.index("tiny-transformer") < eval_section.index("tiny-llama")


def test_junit_counts_and_escapes(tmp_path):
    directory = write_report(tmp_path, results_document(RUN, ENV, records(), (), table()))
    suite = ElementTree.parse(directory / "junit.xml").getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("4", "2", "1")
    failure = suite.find("testcase[@name='tiny-transformer-bf16-mixed-eval-cpu-torch']/failure")
    assert failure.get("message").startswith(SIG.id)
    assert "<b>expected</b>" in failure.text


def test_a_run_directory_is_never_overwritten(tmp_path):
    first = write_report(tmp_path, results_document(RUN, ENV, records(), (), table()))
    before = (first / "results.json").read_text()
    with pytest.raises(FileExistsError):
        write_report(tmp_path, results_document(RUN, ENV, records()[:1], (), table()))
    assert (first / "results.json").read_text() == before


def test_latest_points_at_the_newest_run(tmp_path):
    write_report(tmp_path, results_document(RUN, ENV, records(), (), table()))
    second = write_report(tmp_path, results_document({**RUN, "id": "run-b"}, ENV, records(), (), table()))
    assert (tmp_path / "latest").resolve() == second.resolve()


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_metrics_stay_strict_json(value):
    text = json.dumps(json_safe({"metrics": {"x": value, "xs": [value]}}), allow_nan=False)
    assert json.loads(text)["metrics"]["x"] in (value, str(value))


def test_run_ids_are_unique():
    assert len({journal.new_run_id() for _ in range(200)}) == 200


def test_summary_says_which_gpu_the_cuda_cells_ran_on():
    gpus = [
        {"index": 0, "name": "Tesla T4", "compute_capability": "7.5", "total_memory_gib": 14.6, "native_bf16": False},
        {
            "index": 1,
            "name": "NVIDIA A100-SXM4-40GB",
            "compute_capability": "8.0",
            "total_memory_gib": 39.4,
            "native_bf16": True,
            "pci_bus_id": "00000000:41:00.0",
        },
    ]
    env = {**ENV, "cuda_devices": gpus, "selected_cuda_device": 1, "driver_version": "570.86.15"}
    env["warnings"] = ["several different GPUs are visible"]
    text = summary_markdown(results_document(RUN, env, records(), (), table()))
    assert "- cuda cells ran on: cuda:1 NVIDIA A100-SXM4-40GB, PCI 00000000:41:00.0; driver 570.86.15" in text
    assert "- **warning:** several different GPUs are visible" in text
    per_worker = summary_markdown(results_document({**RUN, "cuda_device": "per-worker"}, env, records(), (), table()))
    assert "each xdist worker on its own GPU" in per_worker


def test_new_failures_are_grouped_by_signature_with_their_cells_folded():
    """The first GPU run listed 104 new failures one per line; they were 5 problems."""
    other = Signature("train_steps", "RuntimeError", "Expected all tensors to be on the same device", "torch:x")
    cells = []
    for model in ("tiny-llama", "gemma-cache", "lora", "tiny-transformer"):
        for precision in ("fp32", "bf16-mixed", "bf16-true"):
            cells.append(failed(Cell(model, precision, "eval", "cuda", "lightning")))
    for engine in ("torch", "accelerate"):
        record = CellRecord.of(Cell("tiny-llama", "fp32", "train", "cuda", engine), "failed").as_dict()
        record.update(phase="train_steps", signature=other.as_dict())
        cells.append(record)
    text = summary_markdown(results_document(RUN, ENV, cells, (), table()))
    section = text.split("## Not in the catalogue: 14 failures (new here)")[1].split("\n## ")[0]
    assert "only a baseline tells" in section and "`python -m matrix diff BASE NEW`" in section
    items = [line for line in section.splitlines() if line.startswith("- ")]
    assert items == [
        f"- `{SIG.id}` **12 cells**: {SIG.text}",
        f"- `{other.id}` **2 cells**: {other.text}",
    ]
    assert "14 cells, 2 signatures:" in section
    assert section.count("<details><summary>cells</summary>") == 2
    assert "`gemma-cache-bf16-true-eval-cuda-lightning`" in section  # every cell is still there, folded


def traceback_of(cell_id: str, extra: str = "") -> str:
    return (
        "Traceback (most recent call last):\n"
        '  File "/work/main/matrix/execute.py", line 110, in run_cell\n'
        "    phases[name](state)\n"
        f'  File "/site-packages/torch/nn/modules/transformer.py", line 9, in forward_of_{cell_id.replace("-", "_")}\n'
        f"    return torch._transformer_encoder_layer_fwd(src){extra}\n"
        "RuntimeError: <b>expected</b> scalar type Float but found BFloat16\n"
    )


def with_tracebacks(records: list[dict]) -> list[dict]:
    return [{**r, "traceback": traceback_of(r["id"])} if r["signature"] else r for r in records]


def test_a_failed_cells_traceback_is_in_results_json_junit_and_summary(tmp_path):
    cells = with_tracebacks(records())
    known = {**failed(Cell("tiny-llama", "bf16-mixed", "eval", "cpu")), "outcome": "known"}
    known.update(known_failure={"id": "K", "title": "t", "kind": "bug", "upstream": [], "link": "https://x.test"})
    cells.append({**known, "traceback": traceback_of(known["id"])})
    directory = write_report(tmp_path, results_document(RUN, ENV, cells, (), table()))
    document = json.loads((directory / "results.json").read_text())
    jsonschema.validate(document, SCHEMA)
    by_id = {c["id"]: c for c in document["cells"]}
    first, second = "tiny-transformer-bf16-mixed-eval-cpu-torch", "tiny-transformer-bf16-mixed-train-cpu-torch"
    assert by_id[first]["traceback"] == traceback_of(first)
    assert by_id["tiny-llama-fp32-eval-cpu-torch"]["traceback"] is None  # passed

    failure = ElementTree.parse(directory / "junit.xml").getroot().find(f"testcase[@name='{first}']/failure")
    assert failure.text == f"RuntimeError: <b>expected</b> | pipe\n\n{traceback_of(first)}"  # message, then where

    summary = (directory / "summary.md").read_text()
    new = summary.split("## Not in the catalogue: 2 failures (new here)")[1].split("\n## ")[0]
    assert new.count("<details><summary>traceback</summary>") == 1  # one per signature: the first cell's
    folded = new.split("  <details><summary>traceback</summary>\n\n")[1].split("\n\n  </details>")[0]
    # the harness's frame (matrix/execute.py: a traceback recorded before the folders) folded to a line;
    # the library's frame and the exception shown
    lines = traceback_of(first).splitlines()
    shown = [
        lines[0],
        "  ... 1 frame of the harness folded (matrix/execute.py, line 110, in run_cell)",
        *lines[3:],
    ]
    assert folded == "  ```\n" + "".join(f"  {line}\n" for line in shown) + "  ```"
    assert "forward_of_tiny_transformer_bf16_mixed_train" not in summary  # the second cell's is in results.json
    assert "forward_of_tiny_llama_bf16_mixed" not in summary  # a known failure's: none in summary.md
    assert second in by_id and by_id[second]["traceback"] == traceback_of(second)


def test_a_summary_traceback_is_condensed_and_fenced_past_its_backticks():
    from matrix.results.markdown import SUMMARY_TRACEBACK_LIMIT

    frames = "".join(f'  File "/site-packages/lib.py", line {n}, in frame_{n}\n    call()\n' for n in range(300))
    cell = failed(Cell("tiny-transformer", "bf16-mixed", "eval", "cpu"))
    cell["traceback"] = f"Traceback (most recent call last):\n{frames}RuntimeError: a ```fenced``` message\n"
    summary = summary_markdown(results_document(RUN, ENV, [cell], (), table()))
    folded = summary.split("<details><summary>traceback</summary>\n\n")[1].split("\n\n  </details>")[0]
    assert folded.startswith("  ````\n  Traceback (most recent call last):\n") and folded.endswith("\n  ````")
    assert folded.count("````") == 2  # a fence longer than any backtick run inside
    assert "  RuntimeError: a ```fenced``` message\n" in folded and "in frame_299" in folded
    assert " lines left out) ..." in folded and "in frame_150" not in folded
    assert len(folded) <= SUMMARY_TRACEBACK_LIMIT + 2 * len(folded.splitlines()) + 20  # indented, fenced


def test_a_record_keeps_at_most_the_traceback_limit():
    from matrix.results import crash_dump

    frames = "".join(f'  File "/site-packages/lib.py", line {n}, in frame_{n}\n    call()\n' for n in range(3000))
    text = f"Traceback (most recent call last):\n{frames}RuntimeError: deep\n"
    record = CellRecord.of(Cell("tiny-llama", "fp32", "eval", "cpu"), "failed", traceback=text)
    assert len(text) > 2 * crash_dump.TRACEBACK_LIMIT >= len(record.traceback)
    assert record.traceback.endswith("in frame_2999\n    call()\nRuntimeError: deep\n")
    assert CellRecord.from_dict(record.as_dict()) == record  # read back (the plugin's way), it stays as it is
    harness = record_builders.harness_failure_record(
        Cell("tiny-llama", "fp32", "eval", "cpu"), "setup", "def test():\n>   fixture()\nE   OSError: disk full"
    )
    assert harness.traceback.endswith("E   OSError: disk full") and harness.message == harness.traceback


def test_the_headline_counts_the_cells_that_ran_and_the_next_line_those_that_did_not(tmp_path):
    from matrix.results.html import html_report

    document = results_document(RUN, ENV, records(), (), table())
    directory = write_report(tmp_path, document)
    summary = (directory / "summary.md").read_text().split("\n")
    # 2 failed and 1 passed ran; the cuda cell skipped: not "of 4 cells" beside a count of skips
    assert summary[2] == (
        "**2 failures not in the catalogue, 0 fixed, 0 known failures, 1 passed** of 3 cells that ran here, in 10.0 s."
    )
    assert summary[4] == "Not run here: 1 skipped cell of the 4 selected, for 1 reason ([below](#not-run-here))."
    assert json.loads((directory / "results.json").read_text())["counts"]["skipped"] == 1  # results.json keeps it
    page = html_report(document)
    assert "</span> of 3 cells that ran here</p>" in page
    assert 'Not run here: 1 skipped cell of the 4 selected, for 1 reason (<a href="#not-run">below</a>).' in page


def test_a_run_where_nothing_ran_says_so_instead_of_a_line_of_zeros(tmp_path):
    from matrix.results.html import html_report

    skipped = [
        record_builders.skipped_record(Cell(model, "fp32", "eval", "cuda"), "Requires: [CUDA device] (none visible)")
        for model in ("tiny-transformer", "tiny-llama")
    ]
    document = results_document(RUN, ENV, [r.as_dict() for r in skipped], (), table())
    summary = (write_report(tmp_path, document) / "summary.md").read_text().split("\n")
    assert summary[2] == "**Nothing ran here: 0 of the 2 cells selected ran, so this run decides nothing** (10.0 s)."
    assert summary[4] == "Not run here: 2 skipped cells of the 2 selected, for 1 reason ([below](#not-run-here))."
    page = html_report(document)
    assert '<span class="warning nothing-ran">Nothing ran here: 0 of the 2 cells selected ran' in page
    assert "0 passed" not in page


# Records of a real run (the default CPU matrix at c2994fa), their metrics cut to what the reports read
REAL_RUN = Path(__file__).parent / "report_records" / "default-c2994fa.json"


def real(cell_id: str, **changes) -> dict:
    cells = {cell["id"]: cell for cell in json.loads(REAL_RUN.read_text())["cells"]}
    return {**cells[cell_id], **changes}


UNEXERCISED = {  # passed, but the model's first forward ran another autocast than the precision declares
    "gemma-cache-fp16-mixed-eval-cpu-accelerate": "without autocast",  # accelerate's fp16 on a CPU
    "gemma-cache-fp16-mixed-eval-cpu-lightning": "with bfloat16 autocast",  # Lightning's 16-mixed on a CPU
}


def test_a_passed_cell_that_did_not_exercise_its_precision_is_marked_named_and_counted(tmp_path):
    from matrix.results.exercised import not_exercised_line, ran_instead
    from matrix.results.html import html_report

    exercised = ["gemma-cache-fp32-eval-cpu-accelerate", "gemma-cache-bf16-mixed-eval-cpu-accelerate"]
    cells = [real(cell_id) for cell_id in [*exercised, *UNEXERCISED]]
    assert {c["id"]: ran_instead(c) for c in cells} == {**dict.fromkeys(exercised), **UNEXERCISED}
    document = results_document(RUN, ENV, cells, (), table())
    summary = (write_report(tmp_path, document) / "summary.md").read_text()
    assert json.loads((tmp_path / "latest" / "results.json").read_text())["counts"]["passed"] == 4  # as before
    # counted among the passed, and named
    assert summary.split("\n")[2] == (
        "**0 failures not in the catalogue, 0 fixed, 0 known failures, 4 passed (2 without the precision "
        "exercised)** of 4 cells that ran here, in 10.0 s."
    )
    grid = summary.split("## cpu · eval")[1]
    assert "| gemma-cache | accelerate | ✅ | ☑️ (ran without autocast) | ✅ |" in grid
    assert "| gemma-cache | lightning |  | ☑️ (ran with bfloat16 autocast) |  |" in grid
    section = summary.split("## Passed without the precision exercised")[1].split("\n## ")[0]
    asked = "- fp16-mixed asks for float16 autocast and a grad scaler; "
    assert asked + "under accelerate on cpu the model's first forward ran " in section
    assert asked + "under lightning on cpu the model's first forward ran " in section
    assert "`gemma-cache-fp32-eval-cpu-accelerate`" not in section

    dom_cell = "gemma-cache-fp16-mixed-eval-cpu-lightning"
    page = html_report(document)
    assert "4 passed (2 without the precision exercised)</span>" in page
    assert f'<td class="outcome-passed unexercised" data-cell="{dom_cell}"' in page
    assert f'<td class="outcome-passed" data-cell="{exercised[0]}"' in page
    line = not_exercised_line(real(dom_cell))
    assert line == (
        "fp16-mixed asks for float16 autocast and a grad scaler; under lightning on cpu the model's first forward "
        "ran with bfloat16 autocast, parameters float32"
    )
    assert f"<th>precision exercised</th><td><strong>no</strong>: {line}</td>" in page.replace("&#x27;", "'")
    assert 'id="unexercised"' in page


RANK_CELL = "gemma-cache-bf16-mixed-bf16-reduce-eval-cpu-ddp"  # a ddp rank's TypeError, inside torch


def test_a_rank_failures_traceback_shows_the_librarys_frames_first_and_folds_the_harness(tmp_path):
    from matrix.results.html import html_report

    # the real record, as an uncatalogued failure (summary.md shows those tracebacks)
    cell = real(RANK_CELL, outcome="failed", known_failure=None)
    traceback = cell["traceback"]
    assert "raised in the rank as:" in traceback and "replies.send(" in traceback  # our plumbing, recorded
    document = results_document(RUN, ENV, [cell], (), table())
    directory = write_report(tmp_path, document)
    assert json.loads((directory / "results.json").read_text())["cells"][0]["traceback"] == traceback  # whole
    summary = (directory / "summary.md").read_text()
    folded = summary.split("<details><summary>traceback</summary>\n\n")[1].split("\n\n  </details>")[0]
    shown = [line.removeprefix("  ") for line in folded.split("\n")[1:-1]]
    assert shown[:3] == [
        "Traceback (most recent call last):",
        "  ... 6 frames of the harness folded (innermost: matrix/engines/ddp.py, line 63, in _wrap)",
        '  File "/work/main/.nox/matrix/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", line 2253, '
        "in register_comm_hook",
    ]
    assert "TypeError: BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+ or XPU and XCCL" in shown
    assert shown[-1] == (
        "(the driver's side, 3 frames of the harness ending in matrix.rank_pool.RankFailure, folded: it passes "
        "on the rank's exception)"
    )
    for plumbing in ("replies.send", "pipeline.run_phase", "RankFailure(index", "rank_worker.py"):
        assert plumbing not in folded

    page = html_report(document)
    panel = page.split(f'id="cell-{RANK_CELL}"')[1].split("</section>")[0]
    traceback_html = panel.split('<details class="traceback">')[1]
    harness = re.findall(r'<details class="harness">.*?</details>', traceback_html, re.S)
    assert len(harness) == 2  # the rank's harness frames, the driver's side
    assert "replies.send" in harness[0] and "RankFailure" in harness[1]  # folded, still there
    unfolded = re.sub(r'<details class="harness">.*?</details>', "", traceback_html, flags=re.S)
    assert "site-packages/torch/nn/parallel/distributed.py" in unfolded and "replies.send" not in unfolded


def test_a_failure_of_the_harness_own_check_in_a_rank_names_the_check():
    from matrix.results.tracebacks import shown_text

    text = real("gemma-cache-bf16-true-eval-cpu-accelerate-fsdp2")["traceback"]
    assert shown_text(text).split("\n")[:3] == [
        "Traceback (most recent call last):",
        "  ... 6 frames of the harness folded (innermost: matrix/checks.py, line 219, in check_same_dtypes)",
        "matrix.checks.DtypeContractBroken: after reload: a buffer was torch.bfloat16, is now torch.float32",
    ]


def test_folding_keeps_every_line_of_a_traceback():
    from matrix.results.tracebacks import RANK_LINE, shown

    for cell_id in (RANK_CELL, "gemma-cache-bf16-true-eval-cpu-accelerate-fsdp2"):
        text = real(cell_id)["traceback"]
        kept = "\n".join(segment.text for segment in shown(text)).split("\n")
        assert sorted(line for line in kept if line.strip()) == sorted(
            line for line in text.split("\n") if line.strip() and line != RANK_LINE
        )
    plain = traceback_of("tiny-llama-fp32-eval-cpu-torch")  # no rank: the pieces, in order, are the traceback
    assert "\n".join(segment.text for segment in shown(plain)) + "\n" == plain


def test_known_cells_are_labelled_by_their_catalogue_entry_id_on_every_page():
    from matrix.results.html import html_report

    entry = "ddp-bf16-compress-hook-needs-nccl"
    document = results_document(RUN, ENV, [real(RANK_CELL)], (), table())
    summary = summary_markdown(document)
    assert f"| gemma-cache | ddp | ⚠️ `{entry}` (evaluate) |" in summary
    assert f"| `{entry}`: DDP's bf16_compress_hook is refused on gloo/CPU" in summary
    assert "K1" not in summary
    page = html_report(document)
    assert f'<a href="#known-{entry}">{entry}</a></td>' in page and f'<tr id="known-{entry}">' in page
    assert "K1" not in page
