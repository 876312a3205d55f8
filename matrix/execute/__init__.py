"""Running a cell: in this process, or in the ranks of the run's process group. No pytest.

  cell_run.py      - running a cell (run_cell) and its record classified against the catalogue
                     (run_and_record)
  ranks.py         - a distributed engine's cell on the ranks: the driver's side (a phase is one
                     call to every rank) and the rank's (the harness's pipeline on a real process
                     group)
  rank_pool.py     - the run's group of rank processes, started once and reused across cells
  rank_worker.py   - a rank process: it runs what the driver sends it
  environment_variables.py - the environment variables the cells run under, set only while they run

The pytest plugin (matrix/plugin/) and python -m matrix replay both call these.
"""

from matrix.results.module_moves import forwarded


def __getattr__(name: str):  # the flat module matrix.execute's names, for one release (docs/extending.md)
    return forwarded("matrix.execute", name, __path__)
