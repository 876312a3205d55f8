"""Explorations (run with --explore), one per selected target cell; the test itself is
matrix/pytest_cases.py test_explore.

    pytest cases/test_explore.py --explore --model tiny-transformer --mode eval --engine torch
"""

from matrix.pytest_cases import test_explore  # noqa: F401  (collected here)
