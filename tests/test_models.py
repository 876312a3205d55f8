"""The model kinds exercise what the issue asks of them (real libraries, real code paths)."""

import torch

from matrix.execute.cell_run import run_cell
from matrix.grid.cell import Cell
from matrix.models import MODELS
from matrix.precisions.policies import PRECISIONS


def test_gemma_has_sliding_and_global_layers_and_a_window_the_batch_exceeds():
    kind = MODELS["gemma-cache"]
    config = kind.config()
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert config.sliding_window == kind.variant.sliding_window < max(kind.variant.lengths)
    assert config.use_cache


def test_gemma_eval_uses_the_kv_cache_and_generates(tmp_path):
    result = run_cell(Cell("gemma-cache", "fp32", "eval", "cpu"), tmp_path)
    assert result.outcome == "passed", result.message
    assert result.metrics.eval_cache_type.endswith("Cache")
    assert result.metrics.generated_tokens == 4
    assert result.metrics.generation_matches_fp32 is True


def test_lora_checkpoint_holds_adapters_only(tmp_path):
    result = run_cell(Cell("lora", "bf16-true", "train", "cpu"), tmp_path)
    assert result.outcome == "passed", result.message
    assert "adapter_model.safetensors" in result.metrics.checkpoint_files
    assert "model.safetensors" not in result.metrics.checkpoint_files
    assert result.metrics.effective.trainable_parameter_dtypes == {"float32": 896}


def test_encoder_batch_is_padded_with_a_key_padding_mask():
    kind = MODELS["tiny-transformer"]
    batch = kind.batch(torch.device("cpu"))
    lengths = (~batch["padding_mask"]).sum(dim=1).tolist()
    assert lengths == [8, 5, 2] == list(kind.variant.lengths)


def test_causal_lm_batches_are_left_padded_with_ignored_labels():
    batch = MODELS["tiny-llama"].batch(torch.device("cpu"))
    assert (batch["attention_mask"][:, -1] == 1).all()
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()


BUILT_IN = ("tiny-transformer", "tiny-llama", "lora", "gemma-cache")


def test_every_model_passes_fp32_in_both_modes(tmp_path):
    for name in BUILT_IN:
        for mode in ("train", "eval"):
            result = run_cell(Cell(name, "fp32", mode, "cpu"), tmp_path / f"{name}-{mode}")
            assert result.outcome == "passed", f"{name} {mode}: {result.message}"
            assert result.metrics.fp32_deviation_abs == 0.0
            assert all(state == "passed" for state in result.phases.values())
            assert set(result.metrics.effective.parameter_dtypes) == {"float32"}
            assert PRECISIONS["fp32"].settings() == result.metrics.declared
