"""The run journal: what a reader sees while it grows, and after its writer died mid-line."""

import os

import pytest

from matrix.results import journal

AXES = {"model": "lora", "precision": "fp32", "mode": "eval", "device": "cpu", "engine": "torch"}
CELL = "lora-fp32-eval-cpu-torch"


def test_a_started_cell_without_a_record_is_in_flight(tmp_path):
    log = journal.Journal(tmp_path)
    log.header({"id": "r"}, {"cpu": "x"}, {"fp32": {"weights_dtype": "float32"}})
    log.started(CELL, AXES, "pytest 'cases/test_cells.py::test_cell[lora-fp32-eval-cpu-torch]'")
    tail = journal.Tail(tmp_path)
    assert list(tail.update().in_flight()) == [CELL]
    # what a fold needs besides the records: the precision table and the cell's re-run command
    assert tail.state.precisions == {"fp32": {"weights_dtype": "float32"}}
    assert tail.state.reruns[CELL].startswith("pytest 'cases/test_cells.py::test_cell[")
    log.cell({"id": CELL, "outcome": "passed", "metrics": {"loss": float("nan")}})
    state = tail.update()  # only the new line is read
    assert state.in_flight() == {} and state.records[CELL]["metrics"]["loss"] == "nan"
    assert journal.read(tmp_path).records == state.records


def test_a_torn_last_line_waits_for_its_end(tmp_path):
    log = journal.Journal(tmp_path)
    log.header({"id": "r"}, {}, {})
    log.started(CELL, AXES)
    log.close()
    with open(tmp_path / journal.JOURNAL, "a") as file:
        file.write('{"event": "cell", "record": {"id": "lora-fp3')  # the writer died here
    tail = journal.Tail(tmp_path)
    assert list(tail.update().in_flight()) == [CELL]
    with open(tmp_path / journal.JOURNAL, "a") as file:
        file.write('2-eval-cpu-torch"}}\n')
    assert tail.update().in_flight() == {}


def test_a_restart_request_is_seen(tmp_path):
    log = journal.Journal(tmp_path)
    log.write("restart", reason="cuda context lost")
    assert len(journal.read(tmp_path).restarts) == 1


NO_DEV_FULL = "Requires: [/dev/full] (a device whose writes fail with ENOSPC)"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason=NO_DEV_FULL)
def test_a_full_disk_refuses_the_line_and_every_line_after_it(tmp_path):
    """/dev/full answers every write with ENOSPC, as a full disk does: the refusal names the file and
    the error; a later write is refused without reaching the file (a line after a lost one would read
    as complete), and closing does not raise the same refusal again."""
    (tmp_path / journal.JOURNAL).symlink_to("/dev/full")
    log = journal.Journal(tmp_path)
    with pytest.raises(journal.ReportNotWritten) as refused:
        log.header({"id": "r"}, {}, {})
    message = str(refused.value)
    path = tmp_path / journal.JOURNAL
    assert message.startswith(f"ReportNotWritten: OSError: ENOSPC No space left on device: {path}")
    assert f"python -m matrix fold {tmp_path}" in message
    with pytest.raises(journal.ReportNotWritten) as again:
        log.started(CELL, AXES)
    assert again.value is refused.value
    log.close()
