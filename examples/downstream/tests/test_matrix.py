# The matrix's cell test, collected here: the plugin parametrizes it with one test per cell.
from matrix.pytest_cases import test_cell  # noqa: F401
