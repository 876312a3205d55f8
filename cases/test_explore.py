"""Explorations (run with --explore), one per selected target cell; the test itself is
matrix/plugin/cases.py test_explore.

    pytest cases/test_explore.py --explore --model tiny-transformer --mode eval --engine torch
"""

from matrix.plugin.cases import test_explore  # noqa: F401  (collected here)
