"""lora: peft LoRA adapters on tiny-llama; adapters saved and loaded with peft's own API.

peft keeps adapter weights in fp32 when the base model is in half precision
(autocast_adapter_dtype=True, its default): only the frozen base weights carry the
precision's weights dtype, and the report records the adapters' dtype.
"""

from pathlib import Path

import torch

from matrix.grid.variants import LORA_MODULES, InvalidVariant, Variant
from matrix.models.base import INIT_SEED, local_directory, register
from matrix.models.causal_lm import DECODER_FIELDS, CausalLMKind
from matrix.models.tiny_llama import TinyLlama


class Lora(CausalLMKind):
    name = "lora"
    axis_position = 2
    description = "peft LoRA (r=4, q_proj/v_proj) on tiny-llama"
    variant_fields = (*DECODER_FIELDS, "lora_rank", "lora_targets")
    base_kind = TinyLlama()
    quantizable = True
    requires = (*CausalLMKind.requires, "peft")

    def standalone_code(self) -> str:
        from matrix.models.standalone import lora_code

        return self.base.standalone_code() + lora_code(self.variant)

    @property
    def base(self) -> TinyLlama:
        """tiny-llama built with this kind's variant."""
        return self.base_kind.with_variant(self.variant)

    def check_variant(self, variant: Variant) -> None:
        self.base_kind.check_variant(variant)
        if variant.lora_rank < 1:
            raise InvalidVariant("lora_rank must be at least 1")
        if not variant.lora_targets or set(variant.lora_targets) - set(LORA_MODULES):
            raise InvalidVariant(f"lora_targets must be a non-empty subset of {', '.join(LORA_MODULES)}")

    def lora_config(self):
        from peft import LoraConfig  # peft imports transformers' model classes: only when built

        variant = self.variant
        return LoraConfig(
            r=variant.lora_rank,
            lora_alpha=2 * variant.lora_rank,
            lora_dropout=variant.dropout,
            target_modules=list(variant.lora_targets),
        )

    def build(self, precision, device, workdir):
        self.require(precision)
        from peft import get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)  # adapter initialisation
            return get_peft_model(self.base_model(precision, device, workdir), self.lora_config())

    def base_model(self, precision, device, workdir):
        """The base as the precision obtains it; a quantized one prepared for training as QLoRA
        scripts prepare it (matrix/precisions/quantization.py)."""
        base = self.base.build(precision, device, workdir)
        if precision.quantization is None:
            return base
        from matrix.precisions.quantization import prepare_for_training

        return prepare_for_training(base, precision.quantization)

    def create(self):
        raise NotImplementedError("lora is built on top of tiny-llama, see build()")

    def pretrained(self, workdir: Path) -> Path:
        return self.base.pretrained(workdir)  # what base_model() loads

    def save(self, model, directory: Path) -> None:
        model.save_pretrained(directory)  # adapter weights only, safetensors

    def load(self, directory: Path, precision, device, workdir):
        # As peft users do: the base model obtained as before, then the saved adapter on top, from
        # the local directory (one that is missing is an error here, not a Hub repository to look up).
        self.require(precision)
        local_directory(directory)
        from peft import PeftModel

        base = self.base_model(precision, device, workdir)
        return PeftModel.from_pretrained(base, directory, is_trainable=True, local_files_only=True)

    def load_quantized(self, directory: Path, precision, device):
        return self.base.load_quantized(directory, precision, device)

    def loaded_in_dtype(self, precision, reloaded: bool) -> bool:
        # the base comes back the way build() obtained it; the adapters are peft's
        return precision.weights_from == "load"

    def load_weights(self, directory: Path, dtype, device):
        raise NotImplementedError("a LoRA checkpoint holds adapters only, see load()")

    def precision_weights(self, model):
        return {name: p for name, p in model.named_parameters() if "lora_" not in name}


register(Lora())
