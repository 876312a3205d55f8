"""No label is predicted from a pad position, in the grid's batches and in every batch
exploration can draw.

A pad query attends to nothing; what an attention kernel outputs for such a fully masked row
is its own business (on CUDA, SDPA's half-precision kernels and its fp32 one disagree there by
0.28 nats: docs/gpu-runs/h100-2026-11-22/pad-row-probe-output.txt). A loss that reads it
compares kernels, not precisions. The property is checked on the model itself: whatever the
outputs at pad positions are, the loss is the same.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from matrix.engines import ENGINES
from matrix.explore.strategies import variants
from matrix.harness.measurements import position_deviations
from matrix.models import MODELS
from matrix.models.causal_lm import IGNORE_INDEX, next_token_targets
from matrix.precisions.policies import PRECISIONS

BUILT_IN = ("tiny-transformer", "tiny-llama", "lora", "gemma-cache")
CPU = torch.device("cpu")


def per_position_output_module(kind, model):
    """The module whose output holds one vector per position, right before the loss."""
    return model.encoder if kind.name == "tiny-transformer" else model.get_output_embeddings()


def loss_with_pad_outputs_replaced(kind, model, batch, seed: int) -> torch.Tensor:
    """The kind's own training loss, with every pad position's output vector replaced by
    random numbers drawn from `seed` (not a constant: constant logits are a uniform
    prediction whatever the constant)."""
    pad = batch["padding_mask"] if "padding_mask" in batch else batch["attention_mask"] == 0

    def replace(module, args, output):
        noise = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed)) * 10
        return torch.where(pad.unsqueeze(-1), noise.to(output.dtype), output)

    handle = per_position_output_module(kind, model).register_forward_hook(replace)
    try:
        with torch.no_grad():
            return kind.loss(model, batch)
    finally:
        handle.remove()


@pytest.mark.parametrize("model_name", BUILT_IN)
def test_the_grid_batch_asks_for_no_prediction_from_a_pad_position(model_name):
    kind = MODELS[model_name]
    model = kind.build(PRECISIONS["fp32"], CPU, None)
    batch = kind.batch(CPU)
    losses = [loss_with_pad_outputs_replaced(kind, model.eval(), batch, seed) for seed in (0, 1, 2)]
    assert losses[0] == losses[1] == losses[2]


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), model_name=st.sampled_from(BUILT_IN))
def test_no_drawn_batch_asks_for_a_prediction_from_a_pad_position(data, model_name):
    kind = MODELS[model_name]
    variant = data.draw(variants(kind, ENGINES["torch"]))
    configured = kind.with_variant(variant)
    batch = configured.batch(CPU)
    if "labels" in batch and batch["labels"].dim() == 2:  # a causal LM: label t+1 is predicted at t
        mask = batch["attention_mask"]
        predicted_from = batch["labels"][:, 1:] != IGNORE_INDEX
        assert not (predicted_from & (mask[:, :-1] == 0)).any(), variant
    if variant.padding == "none" or not any(variant.pad_counts):
        return
    model = configured.build(PRECISIONS["fp32"], CPU, None).eval()
    seed = data.draw(st.integers(0, 2**16))
    assert loss_with_pad_outputs_replaced(configured, model, batch, seed) == loss_with_pad_outputs_replaced(
        configured, model, batch, seed + 1
    )


def test_left_padding_masks_the_first_real_token_of_a_padded_row():
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0]])
    assert next_token_targets(mask).tolist() == [
        [True, True, True, True],
        [False, False, False, True],  # the pad at 1 would predict the token at 2
        [True, True, False, False],  # right padding: the last real token predicts a pad, ignored anyway
    ]


def test_pad_and_real_position_deviations_are_recorded_apart():
    mask = torch.tensor([[0, 1, 1]])
    reference = torch.zeros(1, 3, 5)
    logits = reference.clone()
    logits[0, 0] += 0.28  # a fully masked row where a kernel returns something else
    logits[0, 2, 1] += 0.001
    deviations = position_deviations(logits, reference, mask)
    assert deviations["pad_position_logits_max_abs_deviation"] == pytest.approx(0.28)
    assert deviations["real_position_logits_max_abs_deviation"] == pytest.approx(0.001)
    assert position_deviations(logits[:, 0], reference[:, 0], mask) == {}  # not per-position outputs
