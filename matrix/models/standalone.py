"""Standalone forms of the built-in model kinds, for reproduction scripts (matrix/releases/repro/):
the code that defines create(), save(), load_weights(), loss_of() and evaluate_model() with
the upstream libraries alone (a decoder also load_quantized(), for a quantized base under LoRA:
matrix/releases/repro/parts/quantized.py). Each kind's standalone_code() fills one in (models/base.py); a
plugin's kind gets code that builds it through its own module (plugin_code)."""

from __future__ import annotations

ENCODER = """
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F


class EncoderClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding({vocab}, {hidden}, padding_idx={pad})
        layer = nn.TransformerEncoderLayer(
            d_model={hidden}, nhead={heads}, dim_feedforward={intermediate}, dropout={dropout}, batch_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers={layers})
        self.head = nn.Linear({hidden}, {classes})

    def forward(self, input_ids, padding_mask=None, labels=None):
        # with labels, a {{"loss", "logits"}} dict, as the transformers Trainer calls model(**batch)
        hidden = self.encoder(self.embed(input_ids), src_key_padding_mask=padding_mask)
        if padding_mask is None:
            pooled = hidden.mean(dim=1)
        else:
            keep = (~padding_mask).unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * keep).sum(dim=1) / keep.sum(dim=1)
        logits = self.head(pooled)
        if labels is None:
            return logits
        return {{"loss": F.cross_entropy(logits.float(), labels), "logits": logits}}


def create():
    return EncoderClassifier()


def save(model, directory):
    save_file({{k: v.contiguous() for k, v in model.state_dict().items()}}, f"{{directory}}/model.safetensors")


def load_weights(directory, dtype):
    model = EncoderClassifier().to(dtype)
    model.load_state_dict(load_file(f"{{directory}}/model.safetensors"))
    return model


def loss_of(model, batch):
    return F.cross_entropy(model(batch["input_ids"], batch.get("padding_mask")).float(), batch["labels"])


def evaluate_model(model, batch):
    logits = model(batch["input_ids"], batch.get("padding_mask"))
    return F.cross_entropy(logits.float(), batch["labels"]), logits
"""

DECODER = """
import transformers
from packaging.version import Version
from transformers import {config_class}, {model_class}

CONFIG = {config!r}
# from_pretrained's dtype keyword where the script runs: transformers 4.56 renamed torch_dtype to dtype
DTYPE = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def create():
    return {model_class}({config_class}(**CONFIG))


def save(model, directory):
    model.save_pretrained(directory)


def load_weights(directory, dtype):
    return {model_class}.from_pretrained(directory, **{{DTYPE: dtype}})


def load_quantized(directory, dtype, quantization_config=None):
    # as QLoRA scripts load: the quantization config (None: a checkpoint saved quantized, whose
    # config carries it), the dtype of the unquantized weights, and a device map (bitsandbytes
    # quantizes where it places a model, it is not moved after)
    quantized = {{}} if quantization_config is None else {{"quantization_config": quantization_config}}
    return {model_class}.from_pretrained(directory, **quantized, **{{DTYPE: dtype}}, device_map={{"": DEVICE}})


def loss_of(model, batch):
    return model(**batch, use_cache=False).loss


def evaluate_model(model, batch):
    out = model(**batch, use_cache={use_cache})
    {generate}
    return out.loss, out.logits
"""

GENERATE = (
    'model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], '
    "max_new_tokens={tokens}, do_sample=False, use_cache={use_cache}, pad_token_id={pad})"
)

LORA = """
# -- builds on build()
from peft import LoraConfig, PeftModel, get_peft_model

build_base = build  # the base model in the precision, as for tiny-llama; peft keeps the adapters fp32


def build(precision):
    base = build_base(precision)
    with torch.random.fork_rng(devices=RNG_DEVICES):
        torch.manual_seed(INIT_SEED)  # the adapters' initialisation
        config = LoraConfig(r={rank}, lora_alpha={alpha}, lora_dropout={dropout}, target_modules={targets!r})
        return get_peft_model(base, config)


def reload(directory, precision):
    return PeftModel.from_pretrained(build_base(precision), directory, is_trainable=True)
"""


LIGER = """
import types

from liger_kernel.transformers.model.llama import lce_forward  # Liger's own Llama forward

create_plain, load_plain = create, load_weights


def with_liger(model):  # as apply_liger_kernel_to_llama(fused_linear_cross_entropy=True, model=model) does
    model.forward = types.MethodType(lce_forward, model)
    return model


def create():
    return with_liger(create_plain())


def load_weights(directory, dtype):
    return with_liger(load_plain(directory, dtype))
"""

PLUGIN = """
# Model kind {name!r} is defined in {module} (a plugin of the precision matrix): this script
# builds it through that module, so it needs the module importable and precision-matrix installed.
import importlib
from pathlib import Path

from matrix.models import MODELS

importlib.import_module({module!r})
KIND = MODELS[{name!r}]


def create():
    return KIND.initialise()


def save(model, directory):
    KIND.save(model, Path(directory))


def load_weights(directory, dtype):
    return KIND.load_weights(Path(directory), dtype, torch.device("cpu"))


def loss_of(model, batch):
    return KIND.loss(model, batch)


def evaluate_model(model, batch):
    result = KIND.evaluate(model, batch)
    return result.loss, result.logits
"""


def encoder_code(variant, vocab: int, pad: int, classes: int) -> str:
    return ENCODER.format(
        vocab=vocab,
        hidden=variant.hidden_size,
        pad=pad,
        heads=variant.num_heads,
        intermediate=variant.intermediate_size,
        dropout=variant.dropout,
        layers=variant.num_layers,
        classes=classes,
    )


def decoder_code(decoder, pad: int) -> str:
    variant = decoder.variant
    generate = "pass"
    if decoder.generate_tokens:
        generate = GENERATE.format(tokens=decoder.generate_tokens, use_cache=variant.use_cache_in_eval, pad=pad)
    return DECODER.format(
        config_class=decoder.config_class.__name__,
        model_class=decoder.model_class.__name__,
        config=decoder.config_kwargs(),
        use_cache=variant.use_cache_in_eval,
        generate=generate,
    )


def lora_code(variant) -> str:
    return LORA.format(
        rank=variant.lora_rank, alpha=2 * variant.lora_rank, dropout=variant.dropout, targets=list(variant.lora_targets)
    )


def plugin_code(kind) -> str:
    return PLUGIN.format(name=kind.name, module=type(kind).__module__)
