"""lora: peft LoRA adapters on tiny-llama; adapters saved and loaded with peft's own API.

peft keeps adapter weights in fp32 when the base model is in half precision
(autocast_adapter_dtype=True, its default): only the frozen base weights carry the
precision's weights dtype, and the report records the adapters' dtype.
"""

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from matrix.models.base import INIT_SEED
from matrix.models.causal_lm import CausalLMKind
from matrix.models.tiny_llama import TinyLlama

LORA_RANK = 4
TARGET_MODULES = ("q_proj", "v_proj")


class Lora(CausalLMKind):
    name = "lora"
    description = "peft LoRA (r=4, q_proj/v_proj) on tiny-llama"
    base_kind = TinyLlama()

    def build(self, precision, device, workdir):
        config = LoraConfig(
            r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules=list(TARGET_MODULES)
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)  # adapter initialisation
            return get_peft_model(self.base_kind.build(precision, device, workdir), config)

    def create(self):
        raise NotImplementedError("lora is built on top of tiny-llama, see build()")

    def save(self, model, directory: Path) -> None:
        model.save_pretrained(directory)  # adapter weights only, safetensors

    def load(self, directory: Path, precision, device, workdir):
        # As peft users do: the base model obtained as before, then the saved adapter on top.
        base = self.base_kind.build(precision, device, workdir)
        return PeftModel.from_pretrained(base, directory, is_trainable=True)

    def load_weights(self, directory: Path, dtype, device):
        raise NotImplementedError("a LoRA checkpoint holds adapters only, see load()")

    def precision_weights(self, model):
        return {name: p for name, p in model.named_parameters() if "lora_" not in name}
