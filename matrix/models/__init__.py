"""The model axis: a registry of model kinds (matrix/models/base.py ModelKind), one file each.

  base.py          - what a model kind provides (ModelKind), what no variant changes (vocabulary,
                     special tokens, seeds), the traits catalogue selectors match, MODELS
  causal_lm.py     - what the transformers causal LMs share (CausalLMKind)
  hf.py            - transformers, imported when a cell first builds a model
  tiny_transformer.py - tiny-transformer: a torch nn.TransformerEncoder classifier, padded batch
  tiny_llama.py    - tiny-llama: LlamaForCausalLM from a tiny config
  gemma_cache.py   - gemma-cache: Gemma3 text, sliding-window layers, KV cache and generate()
  lora.py          - lora: peft LoRA adapters on tiny-llama
  qlora.py         - qlora: QLoRA's adapters over a 64-wide tiny-llama (the quantized precisions)
  liger_llama.py   - liger-llama: tiny-llama through Liger-Kernel's fused linear cross entropy
  minilm_bert.py   - minilm-bert: a real pretrained BERT (all-MiniLM-L6-v2) from an installed wheel
  hf_architecture.py - hf:<model_type> and hf:<path>: any transformers architecture, made on demand
  hf_shrink.py, hf_shrink_rules.toml - tiny configs for any causal LM's model_type: the rules, as
                     data, and their interpreter
  standalone.py    - the kinds written out with the upstream libraries alone, for repro scripts
  observation.py   - what the harness observes on a model kind: traits, loss items, frozen and
                     gradless parameters
  declared_dtypes.py - the dtypes weights must have, with what an architecture keeps in fp32
  initial_weights.py - the saved initial weights and batch a run's models start from (--initial-weights)

A new built-in kind is one file here that defines a ModelKind and calls register(); a
downstream project's kind registers from its plugin or conftest the same way, and then runs
through every precision, mode, device and engine like the built-in ones.
"""

from __future__ import annotations

from matrix.grid.registry import load_modules
from matrix.models.base import MODELS, EvalOutput, ModelKind, register

load_modules(__name__, skip=("base", "causal_lm", "hf", "hf_shrink"))

__all__ = ["MODELS", "EvalOutput", "ModelKind", "register"]
