"""index.html: grids per device x engine, a details panel per cell, escaping, no network, a real browser."""

import copy
import html
import json
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from matrix.grid.cell import Cell
from matrix.precisions.policies import table
from matrix.results import records as record_builders
from matrix.results.document import results_document
from matrix.results.files import SCHEMA_FILE
from matrix.results.html import html_report
from matrix.results.journal import json_safe
from matrix.results.records import CellRecord
from matrix.results.signatures import Signature

SCHEMA = json.loads(SCHEMA_FILE.read_text())
RUN = {
    "id": "run-html",
    "command": "pytest cases --device cpu",
    "started_at": "2026-01-01T00:00:00Z",
    "finished_at": "2026-01-01T00:00:10Z",
    "duration_s": 10.0,
    "pytest_exit_status": 1,
    "selection": {"device": ["cpu", "cuda"]},
    # registry order, not alphabetical; "lora" has no cells and must get no row
    "axes": {
        "model": ["tiny-transformer", "tiny-llama", "lora"],
        "precision": ["fp32", "bf16-mixed"],
        "mode": ["train", "eval"],
        "device": ["cpu", "cuda"],
        "engine": ["torch", "accelerate"],
    },
    "git_commit": "abc123",
    "git_dirty": False,
    "stack": None,
}
ENV = {
    "python": "3.11",
    "platform": "Linux",
    "cpu": "Test CPU",
    "cpu_count": 2,
    "torch_cuda": None,
    "cudnn": None,
    "driver_version": "550.54",
    "packages": {"torch": "2.13.0", "transformers": "5.0", "peft": "0.15", "accelerate": "1.5"},
    "cuda_devices": [
        {
            "index": 0,
            "name": "NVIDIA H100 80GB HBM3",
            "compute_capability": "9.0",
            "total_memory_gib": 79.2,
            "native_bf16": True,
            "pci_bus_id": "0000:01:00.0",
        }
    ],
    "selected_cuda_device": 0,
    "env": {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": None},
    "warnings": ["several different GPUs are visible"],
}
ENTRY = {
    "id": "torch-encoder-fastpath-autocast",
    "title": "fast path ignores CPU autocast",
    "kind": "bug",
    "upstream": ["pytorch/pytorch#132613"],
    "link": "https://github.com/pytorch/pytorch/issues/132613",
}
KNOWN_SIG = Signature("evaluate", "RuntimeError", "expected scalar type Float but found BFloat16", "torch.nn:forward")
NEW_SIG = Signature("evaluate", "ValueError", "loss not finite", "matrix.checks:check_finite")
NEW_TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/work/main/matrix/checks.py", line 40, in check_finite\n'
    '    raise ValueError(f"loss not finite <{loss}>")\n'
    "ValueError: loss not finite\n"
)
KNOWN_CELL = "tiny-transformer-bf16-mixed-eval-cpu-torch"
NEW_CELL = "tiny-transformer-bf16-mixed-eval-cpu-accelerate"
FIXED_CELL = "tiny-llama-bf16-mixed-train-cpu-accelerate"
SKIPPED_CELL = "tiny-llama-fp32-eval-cpu-accelerate"  # skipped alone: its row and column ran
SKIP_REASON = "Requires: [an accelerate setting for gradients in another dtype than the weights]"
NO_GPU = "Requires: [CUDA device] (none visible)"  # every cuda cell: left out of the grids
PASSED_CELL = "tiny-llama-fp32-eval-cpu-torch"

ALLOWED_TAGS = {
    *("html", "head", "meta", "title", "style", "body", "header", "section", "div", "h1", "h2", "h3", "p"),
    *("span", "code", "pre", "strong", "i", "br", "a", "ul", "li", "details", "summary"),
    *("table", "caption", "tr", "th", "td"),
}
ALLOWED_ATTRIBUTES = {
    *("lang", "charset", "name", "content", "class", "id", "href", "rel", "title"),
    *("colspan", "rowspan", "scope", "data-cell", "data-device", "data-engine"),
}


def records() -> list[dict]:
    """cpu x {torch, accelerate}: every outcome; cuda x torch: all skipped; no cuda x accelerate."""
    out = []
    for model in ("tiny-transformer", "tiny-llama"):
        for precision in ("fp32", "bf16-mixed"):
            for mode in ("train", "eval"):
                for engine in ("torch", "accelerate"):
                    cell = Cell(model, precision, mode, "cpu", engine)
                    record = CellRecord.of(cell, "passed").as_dict()
                    record["metrics"] = {"eval_loss": 1.25, "effective": {"autocast_dtype": None}}
                    if cell.id == KNOWN_CELL:
                        record.update(outcome="known", phase="evaluate", signature=KNOWN_SIG.as_dict())
                        record.update(message="RuntimeError: expected scalar type Float", known_failure=dict(ENTRY))
                    elif cell.id == NEW_CELL:
                        record.update(outcome="failed", phase="evaluate", signature=NEW_SIG.as_dict())
                        record.update(message="ValueError: loss not finite", rerun="pytest -k custom-rerun")
                        record.update(traceback=NEW_TRACEBACK)
                    elif cell.id == FIXED_CELL:
                        record.update(outcome="fixed", known_failure=dict(ENTRY))
                    elif cell.id == SKIPPED_CELL:
                        record = record_builders.skipped_record(cell, SKIP_REASON).as_dict()
                    out.append(record)
                cuda = Cell(model, precision, mode, "cuda", "torch")
                out.append(record_builders.skipped_record(cuda, NO_GPU).as_dict())
    return out


def document(run=RUN, environment=ENV) -> dict:
    return results_document(copy.deepcopy(run), copy.deepcopy(environment), records(), (), table())


# ------------------------------------------------------------------ a small DOM from html.parser


class Node:
    def __init__(self, tag: str, attrs: dict, parent=None):
        self.tag, self.attrs, self.parent, self.children = tag, attrs, parent, []

    def text(self) -> str:
        return "".join(child if isinstance(child, str) else child.text() for child in self.children)

    def iter(self):
        for child in self.children:
            if isinstance(child, Node):
                yield child
                yield from child.iter()

    def find_all(self, tag: str, **attrs) -> list["Node"]:
        wanted = {key.replace("_", "-"): value for key, value in attrs.items()}
        return [n for n in self.iter() if n.tag == tag and all(n.attrs.get(k) == v for k, v in wanted.items())]

    def child(self, tag: str) -> "Node":
        return next(c for c in self.children if isinstance(c, Node) and c.tag == tag)

    def find(self, tag: str, **attrs) -> "Node":
        found = self.find_all(tag, **attrs)
        assert len(found) == 1, f"{len(found)} <{tag} {attrs}>"
        return found[0]


class TreeBuilder(HTMLParser):
    VOID = frozenset({"meta", "br", "img", "input", "hr", "link", "col", "wbr", "source", "area", "base", "embed"})

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = self.current = Node("#document", {})
        self.tags: list[tuple[str, list]] = []  # every start tag with its raw attribute list

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, attrs))
        node = Node(tag, {name: value for name, value in attrs}, self.current)
        self.current.children.append(node)
        if tag not in self.VOID:
            self.current = node

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, attrs))
        self.current.children.append(Node(tag, dict(attrs), self.current))

    def handle_endtag(self, tag):
        node = self.current
        while node is not self.root and node.tag != tag:
            node = node.parent
        assert node is not self.root, f"</{tag}> closes nothing"
        self.current = node.parent

    def handle_data(self, data):
        self.current.children.append(data)


def parse(page: str) -> TreeBuilder:
    builder = TreeBuilder()
    builder.feed(page)
    builder.close()
    assert builder.current is builder.root, f"<{builder.current.tag}> left open"
    return builder


def detail_rows(dom: Node, cell_id: str) -> dict[str, Node]:
    """A cell's details panel as label -> the <td> beside it."""
    section = dom.find("section", id=f"cell-{cell_id}")
    rows = {}
    for tr in section.child("table").children:
        if isinstance(tr, Node) and tr.tag == "tr":
            th, td = (c for c in tr.children if isinstance(c, Node))
            rows[th.text()] = td
    return rows


# ------------------------------------------------------------------ structure


def test_document_is_a_valid_results_document():
    jsonschema.validate(json_safe(document()), SCHEMA)


def test_one_grid_per_device_and_engine_with_models_as_rows():
    dom = parse(html_report(document())).root
    grids = dom.find_all("table", **{"class": "grid"})
    # cuda · torch skipped in every cell: not a grid, a line of "Not run here"
    placed = [(g.attrs["data-device"], g.attrs["data-engine"]) for g in grids]
    assert placed == [("cpu", "torch"), ("cpu", "accelerate")]
    assert [g.find("caption").text() for g in grids] == ["cpu · torch", "cpu · accelerate"]
    for grid in grids:
        header, subheader, *rows = grid.find_all("tr")
        assert [th.text() for th in header.find_all("th")] == ["model", "fp32", "bf16-mixed"]
        assert [th.text() for th in subheader.find_all("th")] == ["train", "eval", "train", "eval"]
        assert [row.find("th").text() for row in rows] == ["tiny-transformer", "tiny-llama"]  # axes order
        assert all(len(row.find_all("td")) == 4 for row in rows)  # 2 precisions x 2 modes


def test_each_grid_cell_is_coloured_by_its_outcome_and_links_to_its_details():
    doc = document()
    dom = parse(html_report(doc)).root
    tds = [td for td in dom.find_all("td") if "data-cell" in td.attrs]
    on_cpu = [c for c in doc["cells"] if c["device"] == "cpu"]
    assert sorted(td.attrs["data-cell"] for td in tds) == sorted(c["id"] for c in on_cpu)
    for cell in on_cpu:
        td = dom.find("td", data_cell=cell["id"])
        assert td.attrs["class"] == f"outcome-{cell['outcome']}"
        assert td.find("a").attrs["href"] == f"#cell-{cell['id']}"
        assert cell["id"] in td.attrs["title"]
    assert dom.find("td", data_cell=NEW_CELL).text() == NEW_SIG.id
    assert NEW_SIG.text in dom.find("td", data_cell=NEW_CELL).attrs["title"]
    # the catalogue entry's own id, the same on every page (no per-page K-number)
    assert dom.find("td", data_cell=KNOWN_CELL).text() == ENTRY["id"]
    assert dom.find("td", data_cell=FIXED_CELL).text() == f"fixed {ENTRY['id']}"
    assert dom.find("td", data_cell=PASSED_CELL).text() == "✓"
    assert dom.find("td", data_cell=SKIPPED_CELL).text() == "skip"
    assert SKIP_REASON in dom.find("td", data_cell=SKIPPED_CELL).attrs["title"]


def test_every_cell_in_a_grid_has_a_details_panel_with_signature_entry_metrics_and_rerun():
    doc = document()
    dom = parse(html_report(doc)).root
    panels = {section.attrs["id"] for section in dom.find_all("section", **{"class": "detail"})}
    assert panels == {f"cell-{c['id']}" for c in doc["cells"] if c["device"] == "cpu"}
    new = detail_rows(dom, NEW_CELL)
    assert NEW_SIG.id in new["signature"].text() and NEW_SIG.text in new["signature"].text()
    assert new["message"].find("pre").text() == "ValueError: loss not finite"
    folded = new["traceback"].find_all("details")[0]  # folded: a click opens it
    assert folded.child("summary").text() == "4 lines, 1 frame of the harness folded"
    # the harness's frame folded in a <details> of its own; in order, the pieces are the whole traceback
    harness = folded.find("details", **{"class": "harness"})
    assert (
        harness.child("summary").text()
        == "... 1 frame of the harness folded (matrix/checks.py, line 40, in check_finite)"
    )
    pieces = [c.child("pre") if c.tag == "details" else c for c in folded.children if isinstance(c, Node)][1:]
    assert "\n".join(piece.text() for piece in pieces) + "\n" == NEW_TRACEBACK
    assert "traceback" not in detail_rows(dom, PASSED_CELL)
    assert new["re-run"].text() == "pytest -k custom-rerun"  # the record's own command wins
    known = detail_rows(dom, KNOWN_CELL)
    assert known["outcome"].text() == "known" and known["phase"].text() == "evaluate"
    assert json.loads(known["metrics"].find("pre").text()) == {"eval_loss": 1.25, "effective": {"autocast_dtype": None}}
    assert known["re-run"].text() == f"pytest 'cases/test_cells.py::test_cell[{KNOWN_CELL}]'"
    entry_links = {a.attrs["href"] for a in known["catalogue entry"].find_all("a")}
    assert {ENTRY["link"], "https://github.com/pytorch/pytorch/issues/132613", "#known-" + ENTRY["id"]} <= entry_links
    assert detail_rows(dom, SKIPPED_CELL)["skip reason"].text() == SKIP_REASON


def test_signature_and_catalogue_tables_list_their_cells():
    dom = parse(html_report(document())).root
    new_row = dom.find("tr", id=f"signature-{NEW_SIG.id}")
    assert "not in the catalogue" in new_row.text() and NEW_CELL in new_row.text()
    known_row = dom.find("tr", id=f"signature-{KNOWN_SIG.id}")
    assert ENTRY["id"] in known_row.text() and KNOWN_CELL in known_row.text()
    entry_row = dom.find("tr", id=f"known-{ENTRY['id']}")
    assert [a.attrs["href"] for a in entry_row.find_all("a")] == [
        "https://github.com/pytorch/pytorch/issues/132613",
        ENTRY["link"],
        f"#cell-{KNOWN_CELL}",
        f"#cell-{FIXED_CELL}",
    ]


def test_header_environment_merged_runs_and_explorations():
    run = {**RUN, "incomplete": True, "merged_from": [{"id": "night-1", "shard": "1/2", "cuda_devices": []}]}
    doc = document(run=run)
    doc["explorations"] = [
        {"target": KNOWN_CELL, "examples_run": 7, "budget": {"examples": 50}, "fp32_failures": 0, "stopped_by": "x"}
        | {"wall_s": 1.5, "skip_reason": None, "findings": [{"status": "known", "signature": KNOWN_SIG.as_dict()}]},
        {"target": NEW_CELL, "skip_reason": "Requires: [time]", "findings": []},
    ]
    dom = parse(html_report(doc)).root
    header = dom.find("header").text()
    for expected in ("run-html", "incomplete run", "warning: several different GPUs are visible", "abc123"):
        assert expected in header
    assert (
        "1 failure not in the catalogue" in header
        and "1 fixed" in header
        and "1 known" in header
        and "9 skipped" in header
    )
    assert "NVIDIA H100 80GB HBM3 (compute capability 9.0, 79.2 GiB, native bf16: yes)" in header
    environment = dom.find("section", id="environment").text()
    for expected in ("driver_version", "550.54", "pci_bus_id", "0000:01:00.0", "CUDA_VISIBLE_DEVICES", "2.13.0"):
        assert expected in environment
    assert "night-1" in dom.find("section", id="merged-from").text()
    explorations = dom.find("section", id="explorations").text()
    assert "7 of 50" in explorations and f"{KNOWN_SIG.id} (known)" in explorations
    assert "Requires: [time]" in explorations


def test_a_merged_device_not_in_the_axes_gets_its_own_grid_after_the_listed_ones():
    doc = document()
    for cell in doc["cells"]:
        if cell["device"] == "cuda":
            cell["device"] = "cuda-a100-sxm4-40gb"
            cell["id"] = cell["id"].replace("-cuda-", "-cuda-a100-sxm4-40gb-")
        if cell["id"] == "tiny-llama-fp32-train-cuda-a100-sxm4-40gb-torch":
            cell.update(outcome="passed", skip_reason=None)  # one cell ran there: it has a grid
    grids = parse(html_report(doc)).root.find_all("table", **{"class": "grid"})
    assert [g.attrs["data-device"] for g in grids] == ["cpu", "cpu", "cuda-a100-sxm4-40gb"]


def test_cells_that_could_not_run_here_are_one_line_per_reason_not_a_grid():
    doc = document()
    dom = parse(html_report(doc)).root
    section = dom.find("section", id="not-run")
    assert section.find("h2").text() == "Not run here: 8 cells"
    reach = dom.find("p", **{"class": "reach"})
    assert reach.text() == (
        "Not run here: 9 skipped cells of the 24 selected: 8 for 1 reason (below), "
        "1 in the grids beside cells that ran."
    )
    assert reach.find("a").attrs["href"] == "#not-run"
    # the headline counts the 15 cells that ran; the skipped ones are the line above's
    headline = dom.find("header").find("p", **{"class": "counts"}).text()
    assert headline.endswith(" passed of 15 cells that ran here") and "skipped" not in headline
    _, *rows = section.find("table").find_all("tr")
    gpu_machine = "on a machine with a CUDA GPU and a CUDA build of torch (docs/GPU.md): "
    run_them = "python -m matrix run cases --engine torch --device cuda"
    assert [[td.text() for td in row.find_all("td")] for row in rows] == [
        ["8", NO_GPU, "engine torch; device cuda", gpu_machine + run_them]
    ]
    assert rows[0].find_all("td")[3].find("code").text() == run_them
    assert not [td for td in dom.find_all("td") if "-cuda-" in td.attrs.get("data-cell", "")]
    # the one skip whose row and column ran stays in its grid
    assert dom.find("td", data_cell=SKIPPED_CELL).text() == "skip"


def test_each_kinds_one_time_work_has_its_line():
    doc = document()
    doc["kind_setups"] = [
        {"kind": "tiny-llama", "training": True, "budget_s": 600.0, "steps": {"observation": 1.5}}
        | {"seconds": 10.75, "outcome": "done", "error": None, "pid": 7},
        {"kind": "minilm-bert", "training": False, "budget_s": 5.0, "steps": {}, "seconds": 5.0}
        | {"outcome": "timed out", "error": "observation was running when the budget of 5 s ran out", "pid": 7},
    ]
    jsonschema.validate(json_safe(doc), SCHEMA)
    _, *rows = parse(html_report(doc)).root.find("section", id="kind-setups").find("table").find_all("tr")
    cells = [[td.text() for td in row.find_all("td")] for row in rows]
    assert cells[0][:4] == ["tiny-llama", "train and eval", "observation 1.50 s", "10.75 s"]
    assert cells[1][0] == "minilm-bert" and "timed out: observation was running" in cells[1][4]
    assert "budget 5.00 s" in cells[1][4]


def test_an_outcome_outside_the_known_set_gets_a_neutral_class():
    doc = document()
    doc["cells"][0]["outcome"] = 'x" onmouseover="alert(1)'
    dom = parse(html_report(doc)).root
    assert dom.find("td", data_cell=doc["cells"][0]["id"]).attrs["class"] == "outcome-other"


# ------------------------------------------------------------------ escaping and links


def assert_inert(builder: TreeBuilder) -> None:
    assert {tag for tag, _ in builder.tags} <= ALLOWED_TAGS
    names = {name for _, attrs in builder.tags for name, _ in attrs}
    assert names <= ALLOWED_ATTRIBUTES
    assert not any(name.startswith("on") for name in names)
    for _, attrs in builder.tags:
        for name, value in attrs:
            if name == "href":
                assert value.startswith(("#", "https://", "http://")), value


def hostile_document(text: str, metrics: dict) -> dict:
    doc = document()
    cells = {cell["id"]: cell for cell in doc["cells"]}
    cells[NEW_CELL]["message"] = text
    cells[NEW_CELL]["traceback"] = text
    cells[NEW_CELL]["signature"]["text"] = text
    cells[NEW_CELL]["rerun"] = text
    cells[SKIPPED_CELL]["skip_reason"] = text
    cells[PASSED_CELL]["metrics"] = metrics
    cells[KNOWN_CELL]["known_failure"]["title"] = text
    doc["signatures"][NEW_SIG.id]["message"] = text
    doc["environment"]["packages"][text] = text
    doc["environment"]["warnings"] = [text]
    return doc


@given(
    st.text(min_size=1),
    st.dictionaries(st.text(), st.one_of(st.text(), st.integers(), st.none(), st.lists(st.text(), max_size=3))),
)
def test_document_text_never_becomes_markup(text, metrics):
    page = html_report(hostile_document(text, metrics))
    builder = parse(page)
    assert_inert(builder)
    dom = builder.root
    new = detail_rows(dom, NEW_CELL)
    assert new["message"].find("pre").text() == text
    assert new["traceback"].find("pre").text() == text
    assert new["re-run"].text() == text
    assert text in new["signature"].text()
    assert text in dom.find("td", data_cell=NEW_CELL).attrs["title"]
    assert detail_rows(dom, SKIPPED_CELL)["skip reason"].text() == text
    assert text in dom.find("td", data_cell=SKIPPED_CELL).attrs["title"]
    if metrics:
        assert json.loads(detail_rows(dom, PASSED_CELL)["metrics"].find("pre").text()) == metrics
    assert text in dom.find("section", id="environment").text()


def test_script_injection_comes_out_inert():
    attack = '<script>alert(1)</script>"><img src=x onerror=alert(1)>'
    doc = hostile_document(attack, {"<b>k</b>": attack})
    page = html_report(doc)
    builder = parse(page)
    assert_inert(builder)
    assert "<script" not in page and "<img" not in page
    assert html.escape(attack, quote=True) in page
    assert detail_rows(builder.root, NEW_CELL)["message"].text() == attack


def test_only_http_links_become_links():
    doc = document()
    for cell in doc["cells"]:
        if cell["known_failure"]:
            cell["known_failure"].update(link="javascript:alert(1)", upstream=["found here", "data:text/html,x"])
    dom = parse(html_report(doc)).root
    entry = detail_rows(dom, KNOWN_CELL)["catalogue entry"]
    assert "javascript:alert(1)" in entry.text() and "data:text/html,x" in entry.text()
    assert [a.attrs["href"] for a in entry.find_all("a")] == [f"#known-{ENTRY['id']}"]
    assert not any(a.attrs.get("href", "").startswith(("javascript", "data")) for a in dom.find_all("a"))


def test_the_page_fetches_nothing():
    doc = document()
    page = html_report(doc)
    builder = parse(page)
    upstream = {"https://github.com/pytorch/pytorch/issues/132613", ENTRY["link"]}
    for tag, attrs in builder.tags:
        attrs = dict(attrs)
        assert "src" not in attrs and tag not in ("script", "link", "img", "iframe", "object")
        if tag == "a" and not attrs["href"].startswith("#"):
            assert attrs["href"] in upstream
    assert "@import" not in page and "url(" not in page
    assert "http" not in builder.root.find("style").text()


# ------------------------------------------------------------------ a real browser

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def browser() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    pytest.skip(f"Requires: [chromium] (none of {', '.join(BROWSERS)} on PATH)")


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    command = [
        browser(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'profile'}",
        *args,
    ]
    env = {**os.environ, "HOME": str(home)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_chromium_renders_the_page(tmp_path):
    page = tmp_path / "index.html"
    page.write_text(html_report(document()), encoding="utf-8")
    dom = parse(chromium(tmp_path, "--dump-dom", page.as_uri()).stdout).root
    grids = dom.find_all("table", **{"class": "grid"})
    assert [g.find("caption").text() for g in grids] == ["cpu · torch", "cpu · accelerate"]
    assert dom.find("td", data_cell=KNOWN_CELL).attrs["class"] == "outcome-known"
    assert "8" in dom.find("section", id="not-run").find("h2").text()
    assert dom.find("section", id=f"cell-{KNOWN_CELL}")

    shots = []
    for name, url in (("shot.png", page.as_uri()), ("detail.png", f"{page.as_uri()}#cell-{KNOWN_CELL}")):
        chromium(tmp_path, f"--screenshot={tmp_path / name}", "--window-size=1400,2000", "--hide-scrollbars", url)
        shots.append((tmp_path / name).read_bytes())
    assert all(shot.startswith(b"\x89PNG\r\n\x1a\n") and len(shot) > 1000 for shot in shots)
    assert shots[0] != shots[1]  # :target shows the cell's details panel
