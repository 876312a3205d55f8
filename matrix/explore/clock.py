"""The explorations' wall-time budget (--explore-seconds) shared out over the targets of a run."""

from __future__ import annotations

import time


class ExploreClock:
    """Shares the explorations' wall-time budget out: each target gets what is left divided
    by the targets still to run, so time a quick target leaves goes to the next ones."""

    def __init__(self, total_seconds: float, targets: int) -> None:
        self.total, self.targets, self.started = total_seconds, targets, None

    def next_share(self) -> float:
        if self.started is None:
            self.started = time.monotonic()
        left = max(0.0, self.total - (time.monotonic() - self.started))
        share = left / max(1, self.targets)
        self.targets = max(0, self.targets - 1)
        return share
