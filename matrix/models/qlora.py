"""qlora: LoRA as QLoRA fine-tunes (r=8 on every linear layer) over a tiny-llama whose layers are
64 wide. 64 is bitsandbytes' 4-bit block and divides every real model's widths; lora's 32-wide
layers are below it, which is where bitsandbytes' CPU inference packing breaks (the catalogue's
bnb-cpu-4bit-inference-needs-whole-blocks)."""

from matrix.grid.variants import LORA_MODULES, Variant
from matrix.models.base import register
from matrix.models.lora import Lora


class Qlora(Lora):
    name = "qlora"
    axis_position = 6
    description = "peft LoRA (r=8, every linear layer) on a 64-wide tiny-llama, as QLoRA fine-tunes"
    grid_variant = Variant(
        padding="left", hidden_size=64, intermediate_size=128, lora_rank=8, lora_targets=LORA_MODULES
    )


register(Qlora())
