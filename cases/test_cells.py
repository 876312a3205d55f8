"""The matrix: one test per cell, parametrized by the matrix's pytest plugin (matrix/plugin/hooks.py)
from the selected axes; the test itself is matrix/plugin/cases.py test_cell.

    pytest cases -k "bf16-mixed and eval" --device cpu
"""

from matrix.plugin.cases import test_cell  # noqa: F401  (collected here)
