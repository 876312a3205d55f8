"""Three model kinds of a user's, loaded with `-p triage_kinds`, whose eval cells under autocast
fail in the matrix for three different reasons (tests/test_triage.py triages a run of them):

  triage-real-bug       its evaluate raises under half-precision autocast, in the matrix and
                        outside it alike: a bug of the code under test (reproduces without the
                        harness)
  triage-off-fp32       its evaluation under half-precision autocast is off the fp32 one's by far
                        more than the tolerance (a check of the matrix fails, in and out of it:
                        reproduces, the numbers in the drafts)
  triage-harness-only   its evaluate raises only while the harness's cell pipeline is loaded
                        (matrix.harness.pipeline in sys.modules): a stand-in for a bug of the harness
                        (does not reproduce)
  triage-other-failure  its evaluate raises one exception inside the harness and another outside
                        it (another failure)

Each is the docs' two-layer classifier (tests/plugins/docs_model.py) with another evaluate; in
fp32 (no autocast: the kind's one-time work, the fp32 reference) every one of them evaluates.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from matrix.models import EvalOutput, ModelKind, register

HARNESS_MODULE = "matrix.harness.pipeline"  # the harness's cell pipeline: a standalone script never imports it


def under_half_autocast() -> bool:
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in (torch.bfloat16, torch.float16)


def in_the_harness() -> bool:
    return HARNESS_MODULE in sys.modules


class TriageKind(ModelKind):
    description = "a two-layer classifier whose evaluation fails under autocast (test only)"
    learning_rate = 1e-2  # declared: nothing to search for these eval-only kinds

    def create(self):
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def batch(self, device):
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn(8, 16, generator=generator)
        labels = torch.randint(0, 4, (8,), generator=generator)
        return {"inputs": inputs.to(device), "labels": labels.to(device)}

    def logits(self, model, batch):
        return model(batch["inputs"].to(next(model.parameters()).dtype))

    def loss(self, model, batch):
        return nn.functional.cross_entropy(self.logits(model, batch).float(), batch["labels"])

    def fail_if_broken(self) -> None:
        """Raise where this kind's evaluation is broken."""

    def evaluate(self, model, batch):
        if under_half_autocast():
            self.fail_if_broken()
        logits = self.logits(model, batch)
        return EvalOutput(loss=nn.functional.cross_entropy(logits.float(), batch["labels"]), logits=logits)

    def save(self, model, directory: Path):
        torch.save(model.state_dict(), directory / "model.pt")

    def load_weights(self, directory: Path, dtype, device):
        model = self.create()
        model.load_state_dict(torch.load(directory / "model.pt", map_location="cpu", weights_only=True))
        return model.to(dtype=dtype, device=device)


class RealBug(TriageKind):
    name = "triage-real-bug"

    def fail_if_broken(self) -> None:
        raise ValueError("the classifier's head cannot evaluate under half-precision autocast")


class OffFp32(TriageKind):
    name = "triage-off-fp32"

    def evaluate(self, model, batch):
        found = super().evaluate(model, batch)
        if under_half_autocast():  # a loss scaled by mistake on the half-precision path only
            found.loss = found.loss * 1.5
        return found


class HarnessOnly(TriageKind):
    name = "triage-harness-only"

    def fail_if_broken(self) -> None:
        if in_the_harness():
            raise RuntimeError("evaluation broken by the harness's own pipeline")


class OtherFailure(TriageKind):
    name = "triage-other-failure"

    def fail_if_broken(self) -> None:
        if in_the_harness():
            raise RuntimeError("evaluation fails one way inside the harness")
        raise LookupError("and another way outside it")


register(RealBug())
register(OffFp32())
register(HarnessOnly())
register(OtherFailure())
