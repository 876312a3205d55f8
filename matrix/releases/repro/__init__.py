"""Standalone reproduction scripts: `python -m matrix repro CELL [--run RUN]` writes one cell as a
script that imports the upstream libraries only and applies the matrix's own checks.

  generate.py        - the script of a cell: settings, allowances, the model's code, the parts
  parts/             - the script's code, as text: measure.py (the references and the rules),
                       engine_<name>.py (each engine's library calls), phases.py (the phases and main);
                       distributed.py (a rank's group, rows and gathered evaluation) before an engine
                       part built on its RankEngine (ddp, fsdp2, accelerate-fsdp2); library_loop.py
                       (a library's one-shot loop handed out step by step) before one built on its
                       ReplayedLoop (the Trainer, Lightning); build.py, quantized.py, float8.py (how
                       the cell's model is obtained)
"""

from matrix.releases.repro.generate import ReproError, generate

__all__ = ["ReproError", "generate"]
