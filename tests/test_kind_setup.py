"""A kind's one-time work runs before its first cell, under its own budget, with its own line in
the report (matrix/harness/kind_setup.py): the first cell's timeout covers only the cell."""

import pytest

COLD = ("-p", "cold_start", "--model", "cold-start", "--engine", "torch", "--precision", "fp32")


@pytest.fixture
def cold_run(tmp_path, monkeypatch):
    """The cold-start kind (tests/plugins/cold_start.py: its first model takes 10 s) through
    `python -m matrix run`, cell timeout 4 s: the process, its cells by id, its document."""
    from conftest import run_matrix_cpu

    monkeypatch.setenv("COLD_START_S", "10")

    def run(*args: str):
        done, document = run_matrix_cpu(tmp_path, *COLD, "--cell-timeout", "4", *args, run_id="cold")
        return done, {c["id"]: c for c in document["cells"]}, document

    return run


def test_a_kinds_first_cell_does_not_pay_for_its_one_time_work(cold_run, tmp_path):
    done, cells, document = cold_run()
    # 10 s of the kind's first model is past the cell's 4 s and past python -m matrix run's watch
    # of it (4 s + 2 s of grace): the work ran before the cell, in its own budget
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {c["outcome"] for c in cells.values()} == {"passed"}, {i: c["signature"] for i, c in cells.items()}
    assert all(c["duration_s"] < 4 for c in cells.values()), {i: c["duration_s"] for i, c in cells.items()}
    [setup] = document["kind_setups"]
    assert setup["kind"] == "cold-start" and setup["outcome"] == "done" and setup["error"] is None
    assert setup["training"] is True  # the train cell ran first: the eval cell needs no more
    assert list(setup["steps"]) == ["observation", "learning rate", "bf16 step check"]
    assert setup["steps"]["observation"] >= 10 and setup["seconds"] >= sum(setup["steps"].values()) - 0.01
    assert setup["budget_s"] == 600
    summary = (tmp_path / "cold" / "summary.md").read_text()
    line = next(row for row in summary.split("## One-time work per kind")[1].splitlines() if "cold-start" in row)
    assert "| cold-start | train and eval | observation " in line and "| done |" in line


def test_a_kind_whose_one_time_work_runs_out_of_its_budget_fails_its_cells_at_once(cold_run):
    done, cells, document = cold_run("--kind-setup-timeout", "2")
    assert done.returncode == 1  # new failures: nothing catalogues this
    [setup] = document["kind_setups"]  # the work is not started again for the next cell
    assert setup["outcome"] == "timed out"
    assert setup["error"] == "observation was running when the budget of 2 s ran out"
    assert 2 <= setup["seconds"] < 4
    for cell in cells.values():
        assert cell["outcome"] == "failed" and cell["phase"] == "kind_setup", cell["id"]
        assert cell["signature"]["exception"] == "matrix.kind_setup.KindSetupTimedOut", cell["signature"]
        text = cell["signature"]["text"]
        assert text.startswith(
            "kind_setup: matrix.kind_setup.KindSetupTimedOut: cold-start's one-time work ran past "
        ), text
        assert set(cell["phases"].values()) == {"not run"}
        assert cell["duration_s"] < 1
    assert len({c["signature"]["id"] for c in cells.values()}) == 1  # one signature, train or eval
