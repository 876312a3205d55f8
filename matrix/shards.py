"""--shard K/N: which of the selected cells one machine runs. Standard library only (merge reads
a shard's report without the stack)."""

from __future__ import annotations

from matrix.cell import Cell, SelectionError


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'K/N' -> (K, N) with 1 <= K <= N; None or '' -> None (no sharding)."""
    if not text:
        return None
    k, slash, n = text.partition("/")
    if not (slash and k.strip().isdigit() and n.strip().isdigit() and 1 <= int(k) <= int(n)):
        raise SelectionError(f"--shard: {text!r} is not K/N with 1 <= K <= N (for example 1/2)")
    return int(k), int(n)


def shard_cells(cells: list[Cell], shard: tuple[int, int] | None) -> list[Cell]:
    """Shard K of N: the cells at positions K-1, K-1+N, K-1+2N, ... of the selection's order.

    Dealt round-robin rather than cut in blocks, so each shard gets a similar mix of devices,
    engines and models (a block would give one machine every cuda cell). The split depends only
    on the selection, so N machines given the same selection and shards 1/N..N/N run every
    cell exactly once.
    """
    if shard is None:
        return cells
    k, n = shard
    return cells[k - 1 :: n]
