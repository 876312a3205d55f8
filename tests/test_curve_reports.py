"""A training cell's loss curve in the reports: drawn in its index.html panel (an inline SVG and its
lines), and summary.md's "Loss curves: the worst deviations" table. The cells are plain dicts
shaped like results.json's, their comparisons made by matrix/results/curves.py as a run makes them."""

import math
from html.parser import HTMLParser

from test_report import ENV, RUN  # the run header and environment every report test uses

from matrix.grid.cell import Cell
from matrix.precisions.policies import table
from matrix.results.curves import FP32_TWIN, TORCH_ENGINE, CurveTolerance, compare
from matrix.results.document import results_document
from matrix.results.html import curve_figure, curve_svg, html_report
from matrix.results.markdown import CURVE_ROWS, curves_markdown, summary_markdown
from matrix.results.records import CellRecord

ROW = CurveTolerance(atol=1e-05, rtol=1e-05, per_step=1e-05)
# tiny-llama's fp32 curve under hf-trainer against the torch engine's (a real run's): step 3 leaves
CELL = [4.578830242156982, 4.13830041885376, 3.8820600509643555]
TORCH = [4.578830242156982, 4.138333797454834, 3.884514808654785]
TWIN = [4.578830242156982, 4.1381, 3.8822]
SVG_TAGS = {"svg", "rect", "line", "text", "polyline", "circle", "polygon"}


def comparison(losses, reference, name=TORCH_ENGINE, row=ROW) -> dict:
    return compare(losses, reference, row, name).as_dict()


def curve_metrics(losses=CELL, torch_engine=None, fp32_twin=None) -> dict:
    curve = {"steps": 3, "random_numbers": "forward j seeded with 20261123 + j", "golden_tolerance": ROW.as_dict()}
    if torch_engine is not None:
        curve["torch_engine"] = torch_engine
    if fp32_twin is not None:
        curve["fp32_twin"] = fp32_twin
    metrics = {"curve": curve}
    if losses is not None:
        metrics["train_losses"] = losses
    return metrics


class Tags(HTMLParser):
    """Every start tag with its attributes, and the text."""

    def __init__(self, markup: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def all(self, tag: str, **attrs) -> list[dict]:
        return [a for t, a in self.tags if t == tag and all(a.get(k) == v for k, v in attrs.items())]


def polylines(svg: str) -> dict[str, list[tuple[float, float]]]:
    """series -> its points, as drawn."""
    return {
        line["data-series"]: [tuple(map(float, point.split(","))) for point in line["points"].split()]
        for line in Tags(svg).all("polyline")
    }


# ------------------------------------------------------------------ index.html: the SVG


def test_one_polyline_per_recorded_curve_with_a_point_per_step_and_a_legend():
    metrics = curve_metrics(torch_engine=comparison(CELL, TORCH), fp32_twin=comparison(CELL, TWIN, FP32_TWIN))
    svg = curve_svg(metrics)
    lines = polylines(svg)
    assert list(lines) == ["cell", "torch_engine", "fp32_twin"]
    assert all(len(points) == 3 for points in lines.values())
    # x is the step: left to right; y the loss: a falling loss goes down the page (SVG's y grows downward)
    xs = [x for x, _ in lines["cell"]]
    ys = [y for _, y in lines["cell"]]
    assert xs == sorted(xs) and ys == sorted(ys) and len(set(xs)) == 3
    text = " ".join(Tags(svg).text)
    for label in ("the cell", "torch engine", "fp32 twin", "step", "loss"):
        assert label in text
    # the axes' ticks: the first and last step, the lowest and highest loss drawn
    assert {"1", "3", f"{min(CELL + TORCH + TWIN):.5g}", f"{max(CELL + TORCH + TWIN):.5g}"} <= set(Tags(svg).text)
    colours = {line["stroke"] for line in Tags(svg).all("polyline")}
    assert len(colours) == 3
    assert 'width="320" height="160"' in svg


def test_a_reference_not_compared_draws_nothing_and_its_reason_is_said():
    unchecked = {"reference": FP32_TWIN, "unchecked": "the cell trains in fp32: it is its own fp32 twin"}
    failed = {"reference": TORCH_ENGINE, "reference_error": "sig-1234abcd train_steps: RuntimeError: boom"}
    metrics = curve_metrics(torch_engine=failed, fp32_twin=unchecked)
    assert list(polylines(curve_svg(metrics))) == ["cell"]
    figure = curve_figure(metrics)
    assert "not compared with the fp32 twin: the cell trains in fp32: it is its own fp32 twin" in figure
    assert "the torch engine's own run failed" in figure and "RuntimeError: boom" in figure


def test_the_first_step_outside_the_row_is_marked_red_and_named_with_both_losses_and_the_allowance():
    torch_engine = comparison(CELL, TORCH)
    assert torch_engine["first_step_outside"] == 3
    metrics = curve_metrics(torch_engine=torch_engine)
    svg = curve_svg(metrics)
    (ring,) = Tags(svg).all("circle", **{"class": "outside"})
    assert ring["data-step"] == "3" and ring["stroke"] == "#dc2626"
    # on the cell's own point at that step
    assert (float(ring["cx"]), float(ring["cy"])) == polylines(svg)["cell"][2]
    figure = curve_figure(metrics)
    allowed = f"{torch_engine['allowed'][2]:.2g}"
    assert allowed == "6.9e-05"
    assert f"leaves the torch engine's curve at step 3: 3.8821 vs 3.8845 (|difference| 0.0025), allowed {allowed}" in (
        figure
    )


def test_a_curve_within_its_row_has_no_red_mark_and_says_how_near_it_came():
    metrics = curve_metrics(losses=TORCH, torch_engine=comparison(TORCH, TORCH))
    assert not Tags(curve_svg(metrics)).all("circle", **{"class": "outside"})
    assert "within the torch engine's row over 3 steps; nearest at step 1, 0.0% of what it allows" in (
        curve_figure(metrics)
    )


def test_a_flat_curve_is_drawn_level_without_dividing_by_zero():
    flat = [2.5, 2.5, 2.5]
    svg = curve_svg(curve_metrics(losses=flat, torch_engine=comparison(flat, flat)))
    lines = polylines(svg)
    assert len({y for points in lines.values() for _, y in points}) == 1
    assert all(math.isfinite(v) for points in lines.values() for point in points for v in point)
    assert Tags(svg).text.count("2.5") == 1  # one tick: the lowest loss is the highest


def test_a_single_step_sits_in_the_middle():
    metrics = curve_metrics(losses=[1.5], fp32_twin=comparison([1.5], [1.25], FP32_TWIN))
    lines = polylines(curve_svg(metrics))
    assert [len(points) for points in lines.values()] == [1, 1]
    assert lines["cell"][0][0] == lines["fp32_twin"][0][0]
    assert lines["cell"][0][1] < lines["fp32_twin"][0][1]  # the higher loss higher up


def test_points_that_are_not_finite_are_left_out_and_said():
    losses = [4.0, "nan", float("inf"), 3.0, "-inf"]
    reference = [4.1, 3.5, 3.2, 3.1, float("nan")]
    # as compared where the cell's losses were finite: step 2 left the row
    torch_engine = {**comparison([4.1, 3.9, 3.2, 3.1], reference[:4]), "reference_losses": reference}
    metrics = curve_metrics(losses=losses, torch_engine=torch_engine)
    lines = polylines(curve_svg(metrics))
    assert [len(lines["cell"]), len(lines["torch_engine"])] == [2, 4]
    assert all(math.isfinite(v) for points in lines.values() for point in points for v in point)
    figure = curve_figure(metrics)
    assert "not drawn, not finite: the cell at step 2 (nan); the cell at step 3 (inf); the cell at step 5 (-inf); " in (
        figure
    )
    assert "torch engine at step 5 (nan)" in figure
    # the first step outside is a step the cell's loss is not finite at: the ring goes on the reference's point
    (ring,) = Tags(curve_svg(metrics)).all("circle", **{"class": "outside"})
    assert int(ring["data-step"]) == torch_engine["first_step_outside"] == 2
    assert (float(ring["cx"]), float(ring["cy"])) == lines["torch_engine"][1]
    allowed = f"{torch_engine['allowed'][1]:.2g}"
    assert f"leaves the torch engine's curve at step 2: nan vs 3.5, allowed {allowed}</p>" in figure


def test_nothing_finite_to_draw_is_said_not_drawn():
    metrics = curve_metrics(losses=["nan", "nan"], torch_engine={"reference": TORCH_ENGINE, "unchecked": "none"})
    assert curve_svg(metrics) == ""
    assert "no finite loss to draw" in curve_figure(metrics)


def test_a_curve_without_references_or_without_its_own_losses_draws_what_there_is():
    assert list(polylines(curve_svg({"train_losses": CELL}))) == ["cell"]
    # the cell failed before its steps: its references' curves still show
    metrics = curve_metrics(losses=None, torch_engine={"reference": TORCH_ENGINE, "reference_losses": TORCH})
    assert list(polylines(curve_svg(metrics))) == ["torch_engine"]


def test_an_eval_cell_an_older_run_and_malformed_records_get_no_figure_and_no_error():
    assert curve_figure({"eval_loss": 1.25}) == ""
    assert curve_figure(None) == "" and curve_svg({}) == ""
    for junk in (
        {"curve": "x", "train_losses": "y"},
        {"curve": {"torch_engine": "z", "fp32_twin": {"reference_losses": "w", "first_step_outside": "3"}}},
        {"train_losses": [None, "abc", [1], True, 10**400]},
        {"train_losses": [1.0, 2.0], "curve": {"torch_engine": {"first_step_outside": 9, "reference_losses": [1.0]}}},
    ):
        curve_figure(junk)  # no exception
    svg = curve_svg({"train_losses": [1.0, 2.0], "curve": {"torch_engine": {"first_step_outside": 9}}})
    assert not Tags(svg).all("circle", **{"class": "outside"})


def test_document_text_is_escaped_and_the_svg_stays_inert():
    attack = '<script>alert(1)</script>"><img src=x onerror=alert(1)>'
    torch_engine = {**comparison(CELL, TORCH), "reference": attack}
    fp32_twin = {"reference": FP32_TWIN, "reference_error": attack}
    metrics = curve_metrics(losses=[*CELL, attack], torch_engine=torch_engine, fp32_twin=fp32_twin)
    figure = curve_figure(metrics)
    assert "<script" not in figure and "<img" not in figure
    assert figure.count("&lt;script&gt;") == 3  # the reference's name, its failure, the point not drawn
    parsed = Tags(figure)
    assert {tag for tag, _ in parsed.tags} <= SVG_TAGS | {"div", "p"}
    assert not any(name.startswith("on") or name in ("href", "src") for _, a in parsed.tags for name in a)
    assert "http" not in figure and "url(" not in figure


def test_the_cells_panel_in_index_html_holds_its_curve():
    trained = CellRecord.of(Cell("tiny-llama", "fp32", "train", "cpu", "hf-trainer"), "passed").as_dict()
    trained["metrics"] = curve_metrics(torch_engine=comparison(CELL, TORCH))
    evaluated = CellRecord.of(Cell("tiny-llama", "fp32", "eval", "cpu", "hf-trainer"), "passed").as_dict()
    page = html_report(results_document(RUN, ENV, [trained, evaluated], (), table()))
    panel = page.split(f'id="cell-{trained["id"]}"')[1].split("</section>")[0]
    assert "<th>loss curve</th>" in panel and panel.count("<polyline") == 2
    assert "leaves the torch engine's curve at step 3" in panel
    other = page.split(f'id="cell-{evaluated["id"]}"')[1].split("</section>")[0]
    assert "loss curve" not in other and "<svg" not in other


# ------------------------------------------------------------------ summary.md: the worst deviations


def training_cell(cell_id: str, outcome: str = "passed", **comparisons) -> dict:
    curve = {"steps": 3, "golden_tolerance": ROW.as_dict(), **comparisons}
    return {"id": cell_id, "outcome": outcome, "metrics": {"train_losses": CELL, "curve": curve}}


def shared(share: float, outside: int | None = None, name: str = TORCH_ENGINE) -> dict:
    """A comparison whose worst step (2) used `share` of the 0.01 its row allows there."""
    return {
        "reference": name,
        "reference_losses": TORCH,
        "tolerance": {"atol": 0.01, "rtol": 0.0, "per_step": 0.0},
        "steps_compared": 3,
        "deviations": [0.0, float(share) * 0.01, 0.0],
        "allowed": [0.01, 0.01, 0.01],
        "first_step_outside": outside,
        "worst_step": 2,
        "worst_share": share,
    }


def table_rows(lines: list[str]) -> list[list[str]]:
    rows = [line for line in lines if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def test_the_table_lists_both_references_largest_share_first_and_says_where_a_curve_left_its_row():
    cells = [
        training_cell("a", torch_engine=shared(0.37), fp32_twin=shared(0.05, name=FP32_TWIN)),
        training_cell("b", "failed", torch_engine=shared(1.4, outside=2)),
        training_cell(
            "c", fp32_twin=shared(0.8, name=FP32_TWIN), torch_engine={"unchecked": "the cell is the torch engine"}
        ),
        training_cell("d", torch_engine=shared("inf", outside=1)),  # a loss that was not finite
    ]
    rows = table_rows(curves_markdown(cells))
    assert [(row[0], row[1]) for row in rows] == [
        ("`d`", "torch engine"),
        ("`b`", "torch engine"),
        ("`c`", "fp32 twin"),
        ("`a`", "torch engine"),
        ("`a`", "fp32 twin"),
    ]
    assert rows[1] == ["`b`", "torch engine", "3", "2", "0.014", "0.01", "1.4x", "left the row at step 2"]
    assert rows[0][6:] == ["∞", "left the row at step 1"]
    assert rows[3][6:] == ["37%", "within"]
    assert rows[4][6] == "5.0%"


def test_the_line_before_the_table_counts_the_curves_per_reference_and_those_that_left():
    cells = [
        training_cell("a", torch_engine=shared(0.37), fp32_twin=shared(0.05, name=FP32_TWIN)),
        training_cell("b", torch_engine=shared(1.4, outside=2), fp32_twin={"reference_error": "sig-1 boom"}),
        training_cell("c", torch_engine=shared(0.0)),
    ]
    lines = curves_markdown(cells)
    assert lines[1] == "## Loss curves: the worst deviations"
    intro = lines[3]
    assert intro.startswith(
        "3 training cells recorded a loss curve; compared step by step, 3 against the torch engine (1 left its row) "
        "and 1 against the fp32 twin (0 left their rows), 1 of these identical to their reference step for step; "
        "1 reference failed themselves. The 3 nearest their rows"
    )
    assert [row[0] for row in table_rows(lines)] == ["`b`", "`a`", "`a`"]  # the identical curve is not listed


def test_the_table_holds_at_most_ten_comparisons_the_nearest_kept():
    cells = [training_cell(f"cell-{i:02d}", torch_engine=shared(i / 20)) for i in range(1, CURVE_ROWS + 3)]
    rows = table_rows(curves_markdown(cells))
    assert CURVE_ROWS == 10 and len(rows) == 10
    assert [row[0] for row in rows] == [f"`cell-{i:02d}`" for i in range(CURVE_ROWS + 2, 2, -1)]


def test_no_curve_no_section():
    assert curves_markdown([{"id": "x", "outcome": "passed", "metrics": {"eval_loss": 1.0}}]) == []
    evaluated = CellRecord.of(Cell("tiny-llama", "fp32", "eval", "cpu"), "passed").as_dict()
    assert "Loss curves" not in summary_markdown(results_document(RUN, ENV, [evaluated], (), table()))


def test_curves_none_compared_get_their_line_and_no_table():
    cells = [training_cell("a", torch_engine={"unchecked": "the cell is the torch engine"})]
    lines = curves_markdown(cells)
    assert lines[-1].endswith(
        "0 against the torch engine (0 left their rows) and 0 against the fp32 twin (0 left their rows)."
    )
    assert not table_rows(lines)


def test_the_section_follows_the_failure_signatures_in_summary_md():
    trained = CellRecord.of(Cell("tiny-llama", "fp32", "train", "cpu", "hf-trainer"), "passed").as_dict()
    trained["metrics"] = curve_metrics(torch_engine=comparison(CELL, TORCH))
    summary = summary_markdown(results_document(RUN, ENV, [trained], (), table()))
    assert summary.index("## Failure signatures") < summary.index("## Loss curves: the worst deviations")
    assert summary.index("## Loss curves: the worst deviations") < summary.index("## Precisions")
    row = f"| `{trained['id']}` | torch engine | 3 | 3 | 0.00245 | 6.88e-05 | 35.7x | left the row at step 3 |"
    assert row in summary
