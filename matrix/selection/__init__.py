"""The grid enumerated over the registries (above models/ and engines/, which fill them).

  cells.py         - axis values from the registries, --model a,b selection, enumeration, the cell a
                     test id names

It imports the axes' folders so that their registries are filled before it enumerates.
"""

from matrix.results.module_moves import forwarded


def __getattr__(name: str):  # the flat module matrix.selection's names, for one release (docs/extending.md)
    return forwarded("matrix.selection", name, __path__)
