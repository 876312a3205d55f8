"""The standalone form of a built-in kind (matrix/models/standalone.py), which repro scripts carry
as text, computes what the kind's own model computes: the same weights give the same logits, and
the same loss where a library passes the labels (the Trainer calls model(**batch))."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from matrix.models import MODELS
from matrix.precisions.policies import PRECISIONS


def test_the_standalone_encoder_is_the_kinds_model_with_and_without_labels():
    kind = MODELS["tiny-transformer"]
    namespace: dict = {"torch": torch}
    exec(compile(kind.standalone_code(), "<standalone tiny-transformer>", "exec"), namespace)
    with tempfile.TemporaryDirectory() as workdir:
        ours = kind.build(PRECISIONS["fp32"], torch.device("cpu"), Path(workdir)).eval()
    theirs = namespace["create"]().eval()
    theirs.load_state_dict(ours.state_dict())
    batch = kind.batch(torch.device("cpu"))
    with torch.no_grad():
        assert torch.equal(
            ours(batch["input_ids"], batch["padding_mask"]), theirs(batch["input_ids"], batch["padding_mask"])
        )
        mine, script = ours(**batch), theirs(**batch)  # as the Trainer calls a model: every key, labels included
        # under no_grad too: in eval mode without autograd nn.TransformerEncoder takes its fused fast
        # path, whose last bits differ from the layer-by-layer path's on some CPUs (AVX-512 here)
        scripts_loss = namespace["loss_of"](theirs, batch)
    assert torch.equal(mine["logits"], script["logits"]) and torch.equal(mine["loss"], script["loss"])
    assert torch.equal(script["loss"], scripts_loss)
