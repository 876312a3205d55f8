"""A user's kind whose evaluation, under half-precision autocast, raises an exception that derives
from BaseException, not Exception, as torch.distributed.checkpoint's CheckpointException does
(-p base_exception_kind). The matrix must record it as the cell's failure, in one process and in
a rank of a process group alike, not lose the rank (tests/test_resilience.py)."""

from __future__ import annotations

from triage_kinds import TriageKind

from matrix.models import register


class LibraryAbort(BaseException):
    """A library's failure that is not an Exception (CheckpointException's base)."""


class RaisesBaseException(TriageKind):
    name = "base-exception-kind"

    def fail_if_broken(self) -> None:
        raise LibraryAbort("the library gave up on this rank")


register(RaisesBaseException())
