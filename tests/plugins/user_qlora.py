"""A user's QLoRA fine-tune, written as the README's "Quantized bases" says: a small Qwen2 from a
config in code (64 wide: real models' widths are whole 4-bit blocks), peft LoRA on every linear
layer ("all-linear"), the quantized base loaded with from_pretrained(quantization_config=...)
and prepared with peft's prepare_model_for_kbit_training, as QLoRA scripts do. Right padding,
pad labels -100. Loaded with `-p user_qlora`.
"""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from matrix.models import ModelKind, register

PAD = 0
LENGTHS = [10, 7, 10, 4]


def config():
    return Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


class UserQLoRA(ModelKind):
    name = "user-qlora"
    description = "a user's QLoRA: peft LoRA on every linear layer of a Qwen2 from a config in code"
    quantizable = True

    def create(self):
        return Qwen2ForCausalLM(config())

    def build(self, precision, device, workdir):
        from peft import get_peft_model, prepare_model_for_kbit_training

        base = super().build(precision, device, workdir)  # from_pretrained, quantized when asked
        if precision.quantization is not None:
            base = prepare_model_for_kbit_training(base)
        torch.manual_seed(0)
        return get_peft_model(base, lora_config())

    def load(self, directory, precision, device, workdir):
        from peft import PeftModel

        base = super().build(precision, device, workdir)
        if precision.quantization is not None:
            from peft import prepare_model_for_kbit_training

            base = prepare_model_for_kbit_training(base)
        return PeftModel.from_pretrained(base, directory, is_trainable=True)

    def batch(self, device):
        generator = torch.Generator().manual_seed(11)
        width = max(LENGTHS)
        input_ids = torch.full((len(LENGTHS), width), PAD)
        attention_mask = torch.zeros((len(LENGTHS), width), dtype=torch.long)
        for row, length in enumerate(LENGTHS):
            input_ids[row, :length] = torch.randint(3, 96, (length,), generator=generator)
            attention_mask[row, :length] = 1
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        return {key: value.to(device) for key, value in batch.items()}

    def loss(self, model, batch):
        return model(**batch).loss

    def evaluate(self, model, batch):
        from matrix.models.base import EvalOutput

        out = model(**batch)
        return EvalOutput(loss=out.loss, logits=out.logits)

    def save(self, model, directory):
        model.save_pretrained(directory)  # the adapters (peft), or the whole model

    def load_weights(self, directory, dtype, device):
        return Qwen2ForCausalLM.from_pretrained(directory, dtype=dtype).to(device)

    def load_quantized(self, directory, precision, device):
        from transformers import BitsAndBytesConfig

        quantization = precision.quantization
        if quantization is None:  # a checkpoint saved quantized: its config says how
            return Qwen2ForCausalLM.from_pretrained(
                directory, dtype=precision.weights_dtype, device_map={"": str(device)}
            )
        if quantization.bits == 8:
            bnb = BitsAndBytesConfig(load_in_8bit=True)
        else:
            bnb = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type=quantization.scheme,
                bnb_4bit_use_double_quant=quantization.double_quant,
                bnb_4bit_compute_dtype=quantization.compute_dtype,
            )
        return Qwen2ForCausalLM.from_pretrained(
            directory, quantization_config=bnb, dtype=precision.weights_dtype, device_map={"": str(device)}
        )

    def precision_weights(self, model):
        return {name: p for name, p in model.named_parameters() if "lora_" not in name}


register(UserQLoRA())
