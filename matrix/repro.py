"""Standalone reproduction scripts: `python -m matrix repro <cell-id> [--run reports/<run-id>]`.

The script imports only the upstream libraries (torch, transformers, peft, safetensors), with
the model config, the batch, the precision's settings and the phases up to the failing one
written out, and the pins of the run in its docstring. It exits 1 and prints the exception
when the bug is present, 0 when every phase completes.

Written so far for the torch engine (the hand-written loop, which is plain torch already) and
for failures the stack raises; a failure found by one of the matrix's own checks
(matrix.checks.*) has no exception of the stack's to reproduce.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from matrix.cells import cell_from_id
from matrix.environment import package_versions
from matrix.models import MODELS, ModelKind, base
from matrix.models.causal_lm import DTYPE_ARGUMENT
from matrix.models.tiny_transformer import NUM_CLASSES
from matrix.phases import LEARNING_RATE, MAX_STEP_ATTEMPTS, PHASE_NAMES, TRAIN_STEPS
from matrix.precisions import PRECISIONS
from matrix.variants import InvalidVariant
from matrix.variants import from_json as variant_from_json

PINNED = ("torch", "transformers", "peft", "accelerate", "safetensors", "triton", "liger-kernel")


class ReproError(ValueError):
    """This cell cannot be written as a standalone script (yet): one line, exit status 2."""


def _dtype(dtype: torch.dtype | None) -> str:
    return f"torch.{str(dtype).removeprefix('torch.')}" if dtype is not None else "None"


def _batch_literal(kind: ModelKind) -> str:
    batch = kind.batch(torch.device("cpu"))
    lines = ["BATCH = {"]
    for key, tensor in batch.items():
        lines.append(f"    {key!r}: torch.tensor({tensor.tolist()!r}, dtype={_dtype(tensor.dtype)}).to(DEVICE),")
    lines.append("}")
    return "\n".join(lines)


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

    def forward(self, input_ids, padding_mask=None):
        hidden = self.encoder(self.embed(input_ids), src_key_padding_mask=padding_mask)
        if padding_mask is None:
            return self.head(hidden.mean(dim=1))
        keep = (~padding_mask).unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * keep).sum(dim=1) / keep.sum(dim=1))


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
    return loss_of(model, batch)
"""

DECODER = """
from transformers import {config_class}, {model_class}

CONFIG = {config!r}


def create():
    return {model_class}({config_class}(**CONFIG))


def save(model, directory):
    model.save_pretrained(directory)


def load_weights(directory, dtype):
    return {model_class}.from_pretrained(directory, {dtype_argument}=dtype)


def loss_of(model, batch):
    return model(**batch, use_cache=False).loss


def evaluate_model(model, batch):
    out = model(**batch, use_cache={use_cache})
    {generate}
    return out.loss
"""

GENERATE = (
    'model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], '
    "max_new_tokens={tokens}, do_sample=False, use_cache={use_cache}, pad_token_id={pad})"
)

LORA = """
from peft import LoraConfig, PeftModel, get_peft_model

build_base = build  # the base model in the precision, as for tiny-llama; peft keeps the adapters fp32


def build():
    base = build_base()
    torch.manual_seed(0)
    config = LoraConfig(r={rank}, lora_alpha={alpha}, lora_dropout={dropout}, target_modules={targets!r})
    return get_peft_model(base, config)


def reload(directory):
    return PeftModel.from_pretrained(build_base(), directory, is_trainable=True)
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


def _model_code(kind: ModelKind) -> str:
    variant = kind.variant
    if kind.name == "tiny-transformer":
        return ENCODER.format(
            vocab=base.VOCAB_SIZE,
            hidden=variant.hidden_size,
            pad=base.PAD_TOKEN_ID,
            heads=variant.num_heads,
            intermediate=variant.intermediate_size,
            dropout=variant.dropout,
            layers=variant.num_layers,
            classes=NUM_CLASSES,
        )
    if kind.name not in ("tiny-llama", "gemma-cache", "lora", "liger-llama"):
        raise ReproError(f"model kind {kind.name!r} has no standalone form")
    decoder = kind.base if kind.name == "lora" else kind
    generate = "pass"
    if decoder.generate_tokens:
        generate = GENERATE.format(
            tokens=decoder.generate_tokens, use_cache=variant.use_cache_in_eval, pad=base.PAD_TOKEN_ID
        )
    code = DECODER.format(
        config_class=decoder.config_class.__name__,
        model_class=decoder.model_class.__name__,
        config=decoder.config_kwargs(),
        dtype_argument=DTYPE_ARGUMENT,
        use_cache=variant.use_cache_in_eval,
        generate=generate,
    )
    if kind.name == "liger-llama":
        code += LIGER
    if kind.name == "lora":
        code += LORA.format(
            rank=variant.lora_rank,
            alpha=2 * variant.lora_rank,
            dropout=variant.dropout,
            targets=list(variant.lora_targets),
        )
    return code


PHASES = """
WEIGHTS_DTYPE = {weights}
AUTOCAST_DTYPE = {autocast}
GRAD_SCALER = {scaler}
WEIGHTS_FROM = {weights_from!r}  # "cast": module.to(dtype); "load": from_pretrained(dtype=...) of fp32 weights
DEVICE = {device!r}
WORKDIR = tempfile.mkdtemp()


def autocast():
    if AUTOCAST_DTYPE is None:
        return contextlib.nullcontext()
    return torch.autocast(DEVICE, dtype=AUTOCAST_DTYPE)


def build():
    torch.manual_seed(0)
    model = create()
    if WEIGHTS_FROM == "load":
        os.makedirs(WORKDIR + "/fp32", exist_ok=True)
        save(model, WORKDIR + "/fp32")
        return load_weights(WORKDIR + "/fp32", WEIGHTS_DTYPE).to(DEVICE)
    return model.to(device=DEVICE, dtype=WEIGHTS_DTYPE)


def reload(directory):
    return load_weights(directory, WEIGHTS_DTYPE).to(DEVICE)


def train_steps(state):
    model = state["model"] = build()
    model.train()
    optimizer = state["optimizer"] = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr={lr})
    scaler = state["scaler"] = torch.amp.GradScaler(DEVICE) if GRAD_SCALER else None
    applied = attempts = 0
    while applied < {steps} and attempts < {attempts}:
        attempts += 1
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_of(model, BATCH)
        if scaler is None:
            loss.backward()
            optimizer.step()
            applied += 1
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            applied += scaler.get_scale() >= scale


def evaluate_now(state):
    model = state["model"]
    model.eval()
    with torch.no_grad(), autocast():
        return evaluate_model(model, BATCH)


def mid_training_eval(state):
    evaluate_now(state)
    state["model"].train()


def checkpoint_save(state):
    os.makedirs(WORKDIR + "/checkpoint", exist_ok=True)
    save(state["model"], WORKDIR + "/checkpoint")


def checkpoint_reload(state):
    state["model"] = reload(WORKDIR + "/checkpoint")
"""

MAIN = """

def main():
    state = {{}}
    for phase in {phases}:
        print("phase", phase.__name__, flush=True)
        try:
            phase(state)
        except Exception as exc:
            traceback.print_exc()
            print(f"REPRODUCED in {{phase.__name__}}: {{type(exc).__name__}}: {{exc}}")
            return 1
    print("not reproduced: every phase completed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
"""


def generate(cell_id: str, run: Path | None = None, variant: str | None = None) -> str:
    """The script for a cell; `variant` (JSON, as an exploration records it) changes its settings."""
    cell = cell_from_id(cell_id)
    if cell is None:
        raise ReproError(f"no cell {cell_id!r} (ids look like tiny-transformer-bf16-mixed-eval-cpu-torch)")
    if cell.engine != "torch":
        raise ReproError(f"{cell_id}: only torch-engine cells are written as standalone scripts so far")
    kind = MODELS[cell.model]
    if variant is not None:
        try:
            kind = kind.with_variant(variant_from_json(variant, kind.grid_variant))
        except (InvalidVariant, ValueError) as error:
            raise ReproError(f"--variant: {error}") from None
    unsupported = [
        name
        for name, value in (
            ("grad_accumulation", kind.variant.grad_accumulation),
            ("eval_grad_mode", kind.variant.eval_grad_mode),
        )
        if value not in (None, 1, "no_grad")
    ]
    if unsupported:
        raise ReproError(f"--variant: {', '.join(unsupported)} are not written into standalone scripts yet")
    precision = PRECISIONS[cell.precision]
    if precision.contradictions():
        raise ReproError(f"{cell_id}: precision {precision.name!r} fails in the matrix's own policy check")
    versions, record = package_versions(), None
    if run is not None:
        path = run / "results.json" if run.is_dir() else run
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ReproError(f"--run: cannot read {path}: {error}") from None
        versions = document.get("environment", {}).get("packages", versions)
        record = next((c for c in document.get("cells", []) if c.get("id") == cell_id), None)
        if record is None:
            raise ReproError(f"--run: {path} has no cell {cell_id!r}")
    phase = record["phase"] if record and record.get("phase") else None
    if record and record["signature"] and record["signature"]["exception"].startswith("matrix."):
        raise ReproError(
            f"{cell_id}: failed a matrix check ({record['signature']['exception']}), not a stack exception"
        )
    names = PHASE_NAMES[cell.mode]
    wanted = list(names[: names.index(phase) + 1]) if phase in names else list(names)
    runnable = [n for n in wanted if n != "resumed_step"]
    pins = " ".join(f"{name}=={versions[name]}" for name in PINNED if versions.get(name))
    seen = f"\nSignature in the matrix run: {record['signature']['text']}" if record and record["signature"] else ""
    variant_line = (
        f"\n\nSettings changed from the matrix grid's (an exploration's finding): {variant}" if variant else ""
    )
    interpreter = ""
    if cell.model == "liger-llama" and cell.device == "cpu":  # before triton is imported
        interpreter = '\nos.environ.setdefault("TRITON_INTERPRET", "1")  # Liger\'s Triton kernels on CPU tensors\n'
    header = f'''#!/usr/bin/env python3
"""Standalone reproduction of precision-matrix cell {cell_id}.{seen}

    pip install {pins}

Model {cell.model}, precision {cell.precision} ({precision.summary}), mode {cell.mode}, device
{cell.device}; phases: {", ".join(wanted)}. Exits 1 printing the exception when the failure
is present, 0 when every phase completes. Imports nothing but the upstream libraries.{variant_line}
"""

import contextlib
import os
import sys
import tempfile
import traceback
{interpreter}
import torch
'''
    evaluate_phase = "\n\ndef evaluate(state):\n    state['model'] = build()\n    evaluate_now(state)\n"
    body = _model_code(kind) + "\n" + _batch_literal(kind)
    phases = PHASES.format(
        weights=_dtype(precision.weights_dtype),
        autocast=_dtype(precision.autocast_dtype),
        scaler=precision.grad_scaler,
        weights_from=precision.weights_from,
        device=cell.device,
        lr=LEARNING_RATE,
        steps=TRAIN_STEPS,
        attempts=MAX_STEP_ATTEMPTS,
    )
    return header + phases + body + evaluate_phase + MAIN.format(phases="[" + ", ".join(runnable) + "]")
