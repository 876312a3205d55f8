#!/usr/bin/env python3
"""Standalone reproduction of precision-matrix cell lora-int8-fp16-mixed-train-cuda-fsdp2.
The matrix saw no failure (or no run was given).

    pip install torch==2.11.0 transformers==5.17.0 peft==0.21.0 accelerate==1.15.0 safetensors==0.8.0 triton==3.6.0 bitsandbytes==0.50.2
    python lora-int8-fp16-mixed-train-cuda-fsdp2.py [--json out.json]

Model lora, precision int8-fp16-mixed (LLM.int8 base (load_in_8bit), fp16 weights loaded, fp16 autocast, GradScaler), mode train, engine
fsdp2, device cuda. Every comparison prints its numbers and allowance (lines
CHECK ...). Exit 1: the matrix's failure shows (the same check or exception, same phase);
0: every check held; 2: another failure. Imports nothing but the upstream libraries.

NEEDS A GPU (cuda): the cell ran there; the script runs on cuda only.

Made on (this machine, when the script was written):
  accelerate 1.15.0, bitsandbytes 0.50.2, hypothesis 6.168.3, lightning 2.6.6, numpy 2.5.2, peft 0.21.0, pytest 9.1.1, pytest-xdist 3.8.0, safetensors 0.8.0, torch 2.11.0, transformers 5.17.0, triton 3.6.0
  bitsandbytes_cpu_avx512_bf16 False, bitsandbytes_detection bitsandbytes.functional.has_avx512bf16(), cpu_amx_fp16 False, cpu_amx_tile True, cpu_avx2 True, cpu_avx512 True, cpu_avx512_bf16 True, cpu_capability AVX512, cpu_vnni True, cuda_compute_capabilities ['9.0'], cuda_device_names ['NVIDIA H100 80GB HBM3'], selected_cuda_device 0
"""

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import tempfile
import traceback

import torch

# ---------------------------------------------------------------- the cell's settings

CELL_ID = 'lora-int8-fp16-mixed-train-cuda-fsdp2'
ENGINE_NAME = 'fsdp2'
MODE = 'train'
PHASE_ORDER = ['train_steps', 'mid_training_eval', 'checkpoint_save', 'checkpoint_reload', 'resumed_step']
TRAINING = True
DEVICE = 'cuda:0'
DEVICE_TYPE = 'cuda'
CELL = {'name': 'int8-fp16-mixed', 'weights': torch.float16, 'autocast': torch.float16, 'grad_scaler': True, 'weights_from': 'load', 'grad_accumulation': 1, 'grad_dtype': None, 'quantization': {'scheme': 'int8', 'bits': 8, 'compute_dtype': None, 'double_quant': False, 'prepare_for_kbit_training': True}, 'float8': None}
FP32 = {'name': 'fp32', 'weights': torch.float32, 'autocast': None, 'grad_scaler': False, 'weights_from': 'cast', 'grad_accumulation': 1, 'grad_dtype': None, 'quantization': None, 'float8': None}
FP32_TWIN = {'name': 'fp32', 'weights': torch.float32, 'autocast': None, 'grad_scaler': False, 'weights_from': 'cast', 'grad_accumulation': 1, 'grad_dtype': None, 'quantization': None, 'float8': None}
RUN_AUTOCAST = torch.float16
STEPS = 3
LEARNING_RATE = 0.01
MAX_GRAD_NORM = None
DECAYED_NAMES = None
GRADLESS = ['base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight', 'base_model.model.model.layers.0.self_attn.v_proj.lora_A.default.weight', 'base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight', 'base_model.model.model.layers.1.self_attn.v_proj.lora_A.default.weight']
FROZEN = ['base_model.model.model.embed_tokens.weight', 'base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight', 'base_model.model.model.layers.0.self_attn.k_proj.weight', 'base_model.model.model.layers.0.self_attn.v_proj.base_layer.weight', 'base_model.model.model.layers.0.self_attn.o_proj.weight', 'base_model.model.model.layers.0.mlp.gate_proj.weight', 'base_model.model.model.layers.0.mlp.up_proj.weight', 'base_model.model.model.layers.0.mlp.down_proj.weight', 'base_model.model.model.layers.0.input_layernorm.weight', 'base_model.model.model.layers.0.post_attention_layernorm.weight', 'base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight', 'base_model.model.model.layers.1.self_attn.k_proj.weight', 'base_model.model.model.layers.1.self_attn.v_proj.base_layer.weight', 'base_model.model.model.layers.1.self_attn.o_proj.weight', 'base_model.model.model.layers.1.mlp.gate_proj.weight', 'base_model.model.model.layers.1.mlp.up_proj.weight', 'base_model.model.model.layers.1.mlp.down_proj.weight', 'base_model.model.model.layers.1.input_layernorm.weight', 'base_model.model.model.layers.1.post_attention_layernorm.weight', 'base_model.model.model.norm.weight', 'base_model.model.lm_head.weight']
LOSS_ITEMS = 'next-token labels'
EVAL_GRAD_MODE = None
EVAL_ROW = {'atol': 0.005, 'rtol': 0.005}
CURVE_VS_TORCH_ENGINE = {'atol': 0.0029, 'rtol': 0.0, 'per_step': 0.0029, 'row': 'casts-parameters float16'}
CURVE_VS_FP32_TWIN = {'atol': 0.0026, 'rtol': 0.0, 'per_step': 0.0026, 'row': 'torch int8'}
LOSS_FALL = 0.00506709032009675
RESUME_ROW = {'loss': {'atol': 0.001, 'rtol': 0.001}, 'tensors': {'atol': 0.0001, 'rtol': 0.002}}
ENGINE_SETTINGS = {'param_dtype': None, 'reduce_dtype': None, 'output_dtype': None, 'autocast': 'float16', 'grad_scaler': True}
DISTRIBUTED = True
WORLD_SIZE = 1
SPLIT_DRAWS = False
COMPILED = False
EAGER_ROW = None
COMPILE_BACKEND = 'inductor'
INIT_SEED = 0
FIRST_FORWARD_SEED = 20261123
RESUME_SEED = 20261125
MAX_STEP_ATTEMPTS = 16
TARGET = None
RNG_DEVICES = [0]
WORKDIR = os.environ.setdefault('REPRO_WORKDIR', tempfile.mkdtemp(prefix='repro-'))
DECAYED = lambda model: None if DECAYED_NAMES is None else set(DECAYED_NAMES)  # noqa: E731

# ---------------------------------------------------------------- the model kind

import transformers
from packaging.version import Version
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = {'vocab_size': 99, 'hidden_size': 32, 'intermediate_size': 64, 'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'attention_dropout': 0.0, 'max_position_embeddings': 64, 'pad_token_id': 0, 'bos_token_id': 1, 'eos_token_id': 2}
# from_pretrained's dtype keyword where the script runs: transformers 4.56 renamed torch_dtype to dtype
DTYPE = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def create():
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def save(model, directory):
    model.save_pretrained(directory)


def load_weights(directory, dtype):
    return LlamaForCausalLM.from_pretrained(directory, **{DTYPE: dtype})


def load_quantized(directory, dtype, quantization_config=None):
    # as QLoRA scripts load: the quantization config (None: a checkpoint saved quantized, whose
    # config carries it), the dtype of the unquantized weights, and a device map (bitsandbytes
    # quantizes where it places a model, it is not moved after)
    quantized = {} if quantization_config is None else {"quantization_config": quantization_config}
    return LlamaForCausalLM.from_pretrained(directory, **quantized, **{DTYPE: dtype}, device_map={"": DEVICE})


def loss_of(model, batch):
    return model(**batch, use_cache=False).loss


def evaluate_model(model, batch):
    out = model(**batch, use_cache=False)
    pass
    return out.loss, out.logits


def build(precision):
    """The kind's model in `precision`, obtained as the precision says: created from the seed
    and cast, or saved in fp32 and loaded in the dtype (from_pretrained(dtype=...)), quantized
    where the precision quantizes its base."""
    with torch.random.fork_rng(devices=RNG_DEVICES):
        torch.manual_seed(INIT_SEED)
        model = create()
    if precision["weights_from"] == "load":
        directory = os.path.join(WORKDIR, "pretrained-fp32")
        if not os.path.isdir(directory):
            os.makedirs(directory)
            save(model, directory)
        if precision.get("quantization") is not None:
            return quantized_base(directory, precision)  # bitsandbytes places it: no .to() after
        return load_weights(directory, precision["weights"]).to(DEVICE)
    model = model.to(DEVICE)
    if any(p.dtype != precision["weights"] for p in model.parameters()):
        model = model.to(dtype=precision["weights"])
    return model


def reload(directory, precision):
    """The kind's own load of a checkpoint directory in the precision's dtype."""
    return load_weights(directory, precision["weights"]).to(DEVICE)

from peft import LoraConfig, PeftModel, get_peft_model

build_base = build  # the base model in the precision, as for tiny-llama; peft keeps the adapters fp32


def build(precision):
    base = build_base(precision)
    with torch.random.fork_rng(devices=RNG_DEVICES):
        torch.manual_seed(INIT_SEED)  # the adapters' initialisation
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=['q_proj', 'v_proj'])
        return get_peft_model(base, config)


def reload(directory, precision):
    return PeftModel.from_pretrained(build_base(precision), directory, is_trainable=True)

BATCH = {
    'input_ids': torch.tensor([[18, 54, 9, 56, 47, 55, 27, 60], [0, 0, 0, 82, 84, 90, 76, 61], [0, 0, 0, 0, 0, 0, 97, 78]], dtype=torch.int64).to(DEVICE),
    'attention_mask': torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]], dtype=torch.int64).to(DEVICE),
    'labels': torch.tensor([[18, 54, 9, 56, 47, 55, 27, 60], [-100, -100, -100, -100, 84, 90, 76, 61], [-100, -100, -100, -100, -100, -100, -100, 78]], dtype=torch.int64).to(DEVICE),
}

# ---------------------------------------------------------------- the harness's measurements and rules

class CheckFailed(AssertionError):
    """A rule of the cell did not hold: its name is the matrix's check (OutOfTolerance, ...)."""

    def __init__(self, name, message, details=""):
        super().__init__(message)  # the stable message, as the matrix's signature has it
        self.name, self.details = name, details


CHECKS = []  # every comparison the script made, in order
NOW = {"phase": None}


def compared(name, what, value, reference, allowance, held):
    CHECKS.append(
        {
            "name": name,
            "phase": NOW["phase"],
            "what": what,
            "value": value,
            "reference": reference,
            "allowance": allowance,
            "held": held,
        }
    )
    verdict = "held" if held else "FAILED"
    print(f"CHECK {NOW['phase']} {name}: {what}: {value} against {reference}, allowed {allowance}: {verdict}")


def allowance_of(row, reference):
    return row["atol"] + row["rtol"] * abs(reference)


def finite_loss(loss, what):
    value = float(loss.float().item()) if isinstance(loss, torch.Tensor) else float(loss)
    if not math.isfinite(value):
        raise CheckFailed("NonFiniteValue", f"{what} is {value}")
    return value


def within(name, what, value, reference, row, message):
    """|value - reference| <= atol + rtol * |reference|, as the matrix's tolerance rows allow."""
    allowed = allowance_of(row, reference)
    held = math.isfinite(value) and abs(value - reference) <= allowed
    compared(name, what, value, reference, f"{allowed:.3g} (atol {row['atol']:g} + rtol {row['rtol']:g} * |ref|)", held)
    if not held:
        raise CheckFailed(name, message, f"{value:.6g} vs {reference:.6g}, |difference| {abs(value - reference):.3g}")


def outputs_equal(what, expected, actual):
    """Bit for bit, as the matrix compares a reload (CHECKPOINT_ROUND_TRIP: atol 0, rtol 0)."""
    if expected.dtype != actual.dtype:
        compared("CheckpointMismatch", what + " dtype", str(actual.dtype), str(expected.dtype), "equal", False)
        raise CheckFailed("CheckpointMismatch", f"{what}: dtype {actual.dtype} after reload, {expected.dtype} before")
    difference = (expected.float() - actual.float()).abs()
    differing = ~(difference <= 0)
    worst = difference[torch.isfinite(difference)].max().item() if torch.isfinite(difference).any() else float("nan")
    held = not bool(differing.any())
    compared("CheckpointMismatch", what, f"max |difference| {worst:.3g}", "the saved run's", "0 (bit for bit)", held)
    if not held:
        raise CheckFailed(
            "CheckpointMismatch",
            f"{what} differ after reload",
            f"{int(differing.sum())} of {difference.numel()} values, max abs difference {worst:.3g}",
        )
    return worst


def tensor_dtypes(model):
    found = {f"parameter {n}": p.dtype for n, p in model.named_parameters()}
    found.update({f"buffer {n}": b.dtype for n, b in model.named_buffers()})
    return found


def same_dtypes(before, model, what, fp32_names=()):
    after = tensor_dtypes(model)
    wanted = {n: torch.float32 if n in fp32_names else d for n, d in before.items()}
    changed = sorted(n for n in before if after.get(n) != wanted[n])
    compared("DtypeContractBroken", what, f"{len(changed)} tensors changed dtype", "0", "none", not changed)
    if changed:
        name = changed[0]
        raise CheckFailed(
            "DtypeContractBroken",
            f"{what}: a {name.split()[0]} was {before[name]}, is now {after.get(name)}",
            f"{len(changed)} tensors changed dtype, first {name}",
        )


def declared_fp32(model):
    """Names from_pretrained keeps in fp32 by the class's _keep_in_fp32_modules(_strict)."""
    patterns = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    patterns += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    found = set()
    for kind, tensors in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, _ in tensors:
            if any(p in name.split(".") or name.startswith(p + ".") or f".{p}." in f".{name}" for p in patterns):
                found.add(f"{kind} {name}")
    return found


def parameters_changed(before, model):
    after = dict(model.named_parameters())
    unchanged = sorted(n for n, old in before.items() if torch.equal(old, after[n].detach().to(old.device)))
    compared("ParametersUnchanged", "trainable tensors unchanged", len(unchanged), 0, "0", not unchanged)
    if unchanged:
        raise CheckFailed(
            "ParametersUnchanged",
            "trainable tensors did not change in training",
            f"{len(unchanged)} of {len(before)}, first {unchanged[0]}",
        )


def finite_parameters(model, when):
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.detach().float()).all()]
    if bad:
        raise CheckFailed("NonFiniteValue", f"parameters are not finite {when}", f"{len(bad)}, first {bad[0]}")


# ---------------------------------------------------------------- the precision, as the matrix defines it


def autocast(precision):
    if precision["autocast"] is None:
        return contextlib.nullcontext()
    return torch.autocast(DEVICE_TYPE, dtype=precision["autocast"])


def eval_grad_mode():
    return torch.inference_mode() if EVAL_GRAD_MODE == "inference_mode" else torch.no_grad()


def outputs_of(result):
    """(loss, logits) of evaluate_model's result."""
    if isinstance(result, tuple):
        return result[0], result[1]
    return result, result.detach().reshape(1)


def evaluate_in(precision, model, around=None):
    """Evaluation as the precision defines it: eval mode, no_grad, its autocast."""
    model.eval()
    with eval_grad_mode(), autocast(precision) if around is None else around:
        return outputs_of(evaluate_model(model, BATCH))


def fp32_evaluation(model):
    """The same weights in an fp32 model of the kind, no autocast: the reference of every eval."""
    reference = build(FP32)
    reference.load_state_dict({name: t.float() for name, t in model.state_dict().items()})
    reference.eval()
    with torch.no_grad():
        return outputs_of(evaluate_model(reference, BATCH))


def forward_seed(step, micro=0):
    return FIRST_FORWARD_SEED + 1000 * step + micro


class SeededForwards:
    """Seeds the global generator before each training forward of `model` in the first STEPS
    steps, from forward_seed(steps applied, micro-batch): the dropout masks every engine draws
    alike. A global hook: a library's wrapper whose .module (or ._orig_mod) is the model counts."""

    def __init__(self, model):
        self.model, self.applied, self.micro, self.done = model, 0, 0, False
        self.seeded = 0  # training forwards seeded so far
        # the model's mode in its first forward: a library may train it in eval mode (dropout off)
        self.training_in_first_forward = None
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self.seed)

    def is_model(self, module):
        """The matrix's rule: the model, torch.compile's wrapper of it, or (in a compiled twin) a
        library's wrapper whose .module is the model; an eager wrapper's call (DDP's) is not
        seeded, the model's own call inside it is (seeding both would draw other masks)."""
        if module is self.model or getattr(module, "_orig_mod", None) is self.model:
            return True
        return COMPILED and getattr(module, "module", None) is self.model

    def seed(self, module, args):
        if self.done or torch.compiler.is_compiling() or not self.is_model(module):
            return
        if self.training_in_first_forward is None:
            self.training_in_first_forward = module.training
        if not module.training:
            if not self.seeded:  # trained in eval mode: no dropout draws to give
                self.stop()
            return
        torch.manual_seed(forward_seed(self.applied, self.micro))
        self.micro, self.seeded = self.micro + 1, self.seeded + 1

    def step_ended(self, applied):
        self.applied += bool(applied)
        self.micro = 0
        if self.applied >= STEPS:
            self.stop()

    def stop(self):
        self.done = True
        self.handle.remove()


def torch_step(precision, model, optimizer, scaler, max_grad_norm=None):
    """One optimizer step of the torch loop: autocast around the forward, the grad scaler around
    backward and step, micro-batches of the precision's accumulation. (loss, applied)."""
    optimizer.zero_grad(set_to_none=True)
    accumulation = precision["grad_accumulation"]
    losses = []
    for _ in range(accumulation):
        with autocast(precision):
            loss = loss_of(model, BATCH) / accumulation
        losses.append(finite_loss(loss, "training loss") * accumulation)
        (loss if scaler is None else scaler.scale(loss)).backward()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if precision["grad_dtype"] is not None:
            for _, p in named:
                if p.grad is not None and p.grad.dtype != precision["grad_dtype"]:
                    p.grad.data = p.grad.data.to(precision["grad_dtype"])
    if scaler is None:
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], max_grad_norm)
        optimizer.step()
        applied = True
    else:
        scaler.unscale_(optimizer)
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], max_grad_norm)
        overflow = any(p.grad is not None and not torch.isfinite(p.grad).all() for _, p in named)
        scaler.step(optimizer)
        scaler.update()
        applied = not overflow
    finite_parameters(model, "after the optimizer step")
    return sum(losses) / len(losses), applied


def new_optimizer(model, decayed=None):
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if decayed is None:
        return torch.optim.AdamW([p for _, p in trainable], lr=LEARNING_RATE)
    groups = [
        {"params": [p for n, p in trainable if n in decayed]},
        {"params": [p for n, p in trainable if n not in decayed], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=LEARNING_RATE)


def new_scaler(precision):
    return torch.amp.GradScaler(DEVICE_TYPE) if precision["grad_scaler"] else None


def take_steps(step, steps):
    """step() -> (loss, applied) until `steps` were applied: every attempt's (loss, applied)."""
    attempts = []
    while sum(applied for _, applied in attempts) < steps:
        if len(attempts) == MAX_STEP_ATTEMPTS:
            raise CheckFailed("NonFiniteValue", "gradients kept overflowing: the grad scaler skipped every step")
        attempts.append(step())
    return attempts


def torch_loop_curve(precision):
    """The torch loop's losses over the first STEPS applied steps in `precision`, on a fresh
    model: the reference of every engine's curve (the matrix's reference_curve)."""
    with torch.random.fork_rng(devices=RNG_DEVICES):
        model = build(precision)
        optimizer = new_optimizer(model, DECAYED(model))
        scaler = new_scaler(precision)
        model.train()
        seeds = SeededForwards(model)
        try:

            def step():
                taken = torch_step(precision, model, optimizer, scaler, MAX_GRAD_NORM)
                seeds.step_ended(taken[1])
                return taken

            return [loss for loss, applied in take_steps(step, STEPS) if applied]
        finally:
            seeds.stop()


def seeded_training_loss(precision, model):
    """The loss as the first training forward measures it: train mode, autocast, the draws of
    FIRST_FORWARD_SEED, no gradients."""
    was = model.training
    model.train()
    try:
        with torch.no_grad(), autocast(precision), torch.random.fork_rng(devices=RNG_DEVICES):
            torch.manual_seed(FIRST_FORWARD_SEED)
            return float(loss_of(model, BATCH).float().item())
    finally:
        model.train(was)


def half_dtype_of(values):
    """The half dtype every finite value is exactly a number of (the losses were handed over in
    it; an fp32 loss lands on a bfloat16 number with probability 2^-16), else None."""
    finite = torch.tensor([v for v in values if math.isfinite(v)], dtype=torch.float64)
    if len(finite) == 0 or not torch.equal(finite.float().double(), finite):
        return None
    for dtype in (torch.bfloat16, torch.float16):
        normal = (finite == 0).logical_or(finite.abs() >= torch.finfo(dtype).tiny).all()
        if torch.equal(finite.float().to(dtype).double(), finite) and bool(normal):
            return dtype
    return None


def half_step(dtype, around):
    """Half the spacing of `dtype`'s numbers at `around` (0 for None: a float32 curve)."""
    if dtype is None or around == 0 or not math.isfinite(around):
        return 0.0
    return 2.0 ** (math.floor(math.log2(abs(around))) - {torch.bfloat16: 7, torch.float16: 10}[dtype]) / 2


def curve_within(name, losses, reference, row, what):
    """Step s (1-based) may differ by atol + rtol * |reference| + per_step * (s - 1), plus half a
    step of a half dtype at the larger loss for each side whose losses are all numbers of it (as
    the matrix: it judges the arithmetic, not the rounding of the number an engine reports)."""
    first_outside, worst_share = None, 0.0
    rounded = [half_dtype_of(losses), half_dtype_of(reference)]
    for side, dtype in zip(("losses", "reference"), rounded, strict=True):
        if dtype is not None:
            print(f"       the {what} comparison's {side} are {dtype} numbers: half a step of it added per step")
    for step, (loss, ref) in enumerate(zip(losses, reference, strict=False), start=1):
        allowed = row["atol"] + row["rtol"] * abs(ref) + row["per_step"] * (step - 1)
        allowed += sum(half_step(dtype, max(abs(loss), abs(ref))) for dtype in rounded)
        share = abs(loss - ref) / allowed if allowed else math.inf
        worst_share = max(worst_share, share)
        held = abs(loss - ref) <= allowed
        compared(name, f"{what}, step {step}", loss, ref, f"{allowed:.3g}", held)
        if not held and first_outside is None:
            first_outside = step
    if len(losses) < len(reference):
        first_outside = first_outside or len(losses) + 1
    if first_outside is not None:
        return CheckFailed(
            "CurveDiverged",
            f"the training loss curve leaves the {what}'s at step {first_outside}",
            f"losses {losses} against {reference}",
        )
    print(f"       the worst step used {worst_share:.0%} of its allowance")
    return None


def model_holding(weights, into=None):
    """A model of the kind in the cell's precision holding `weights` (a full state dict) in their
    own dtypes: a tensor of another dtype than the fresh model's replaces its data."""
    model = build(CELL) if into is None else into
    found = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, tensor in weights.items():
            target = found.get(name)
            if target is None or not target.is_floating_point():
                continue
            value = tensor.to(DEVICE)
            if target.dtype == value.dtype and target.shape == value.shape:
                target.copy_(value)
            else:
                target.data = value
    return model


# ---------------------------------------------------------------- the engine

import datetime

import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 600  # a collective that waits longer raises in the rank (the matrix's own limit)
IGNORE_INDEX = -100  # the label torch's cross entropy (and so transformers' losses) skips
LOSS_ITEM_RULES = {
    "next-token labels": lambda batch: (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1),
    "labels": lambda batch: (batch["labels"] != IGNORE_INDEX).reshape(len(batch["labels"]), -1).sum(dim=1),
    "attention mask": lambda batch: batch["attention_mask"].reshape(len(batch["attention_mask"]), -1).sum(dim=1),
    "rows": lambda batch: torch.ones(len(next(iter(batch.values()))), dtype=torch.long),
}
RANK = {"rank": 0}  # this process's rank, set by setup_rank


class RankEngine:
    """What every distributed engine's part shares: joining the group in each rank."""

    owns_loop = False

    def setup_rank(self, rank):
        """Join the process group as the matrix's ranks do: one intra-op thread per rank (the ranks
        share the machine's cores), the rank's own GPU on CUDA, a timeout on every collective."""
        global DEVICE, BATCH, RNG_DEVICES
        RANK["rank"] = rank
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # as torchrun sets it, for accelerate
        backend = "gloo"
        if DEVICE_TYPE == "cuda":  # nccl: one GPU per rank (written for CUDA, not run on a CPU-only machine)
            backend = "nccl"
            DEVICE = f"cuda:{rank}"
            torch.cuda.set_device(DEVICE)
            BATCH = {key: value.to(DEVICE) for key, value in BATCH.items()}
            RNG_DEVICES = [rank]
        dist.init_process_group(
            backend, rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        )
        if CELL["weights_from"] == "load":  # one pretrained checkpoint, written by rank 0, that every rank loads
            if rank == 0:
                build(CELL)
            dist.barrier()


def rank_rows(batch):
    """This rank's rows: contiguous, the first ranks taking one more where they do not divide evenly."""
    return {key: torch.tensor_split(value, WORLD_SIZE)[RANK["rank"]] for key, value in batch.items()}


def loss_items(batch):
    return int(LOSS_ITEM_RULES[LOSS_ITEMS](batch).sum())


def loss_weight(rows):
    """A rank's loss is multiplied by this before backward: the ranks' averaged gradients are then
    the gradient of the whole batch's mean loss."""
    return loss_items(rows) * WORLD_SIZE / loss_items(BATCH)


def collective_device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def group_mean(value, items):
    """The whole batch's mean from each rank's mean over its `items` items."""
    pair = torch.tensor([value * items, float(items)], dtype=torch.float64, device=collective_device())
    dist.all_reduce(pair)
    return (pair[0] / pair[1]).item()


def group_any(flag):
    value = torch.tensor([1.0 if flag else 0.0], device=collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def gathered_objects(value):
    every = [None] * WORLD_SIZE
    dist.all_gather_object(every, value)
    return every


def writes():
    """Whether this rank writes what is written once for the group."""
    return RANK["rank"] == 0


def evaluate_rows(model, with_autocast=True):
    """Each rank evaluates its rows (eval mode, the eval grad mode, the precision's autocast unless
    the model's forward brings its own); the whole batch's mean loss and every row's logits, gathered."""
    rows = rank_rows(BATCH)
    model.eval()
    with eval_grad_mode(), autocast(CELL) if with_autocast else contextlib.nullcontext():
        loss, logits = outputs_of(evaluate_model(model, rows))
    every = gathered_objects({"loss": loss.detach().float().item(), "items": loss_items(rows), "logits": logits.cpu()})
    total = sum(part["items"] for part in every)
    mean = sum(part["loss"] * part["items"] for part in every) / total
    return torch.tensor(mean), torch.cat([part["logits"] for part in every]).to(DEVICE)


def rank_step(model, optimizer, scaler, with_autocast=True):
    """One optimizer step on this rank's rows, as the matrix's train_step takes it in a group: the
    loss weighted by the rank's share, the grad scaler's skip decided alike on every rank.
    (the whole batch's mean loss, applied)."""
    rows = rank_rows(BATCH)
    optimizer.zero_grad(set_to_none=True)
    with autocast(CELL) if with_autocast else contextlib.nullcontext():
        loss = loss_of(model, rows)
    value = finite_loss(loss, "training loss")
    loss = loss * loss_weight(rows)
    (loss if scaler is None else scaler.scale(loss)).backward()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # after backward (FSDP2 swaps them)
    bad = [n for n, p in named if p.grad is not None and not torch.isfinite(p.grad).all()]
    if scaler is None:
        if bad:
            raise CheckFailed("NonFiniteValue", "gradients are not finite", f"{len(bad)} tensors, first {bad[0]}")
        optimizer.step()
        applied = True
    else:
        scaler.unscale_(optimizer)
        overflow = group_any(bool(bad))  # such a step is skipped by design, on every rank
        scaler.step(optimizer)
        scaler.update()
        applied = not overflow
    finite_parameters(model, "after the optimizer step")
    return group_mean(value, loss_items(rows)), applied


def rank_steps(step, steps, seeds):
    """step() until `steps` were applied, each attempt's end told to the seeded forwards."""

    def one():
        taken = step()
        if seeds is not None:
            seeds.step_ended(taken[1])
        return taken

    return take_steps(one, steps)


def dropout_off_rows_loss(model, with_autocast=True):
    """The whole batch's training loss with dropout off (eval mode), each rank on its rows: what
    the first step is compared by where the kind draws dropout masks (each rank draws its rows')."""
    rows = rank_rows(BATCH)
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(CELL) if with_autocast else contextlib.nullcontext():
            value = float(loss_of(model, rows).float().item())
    finally:
        model.train(was)
    return group_mean(value, loss_items(rows))


def gathered_weights(run, sharded):
    """A sharded run's weights whole, in a plain model, gathered (on every rank) once per step."""
    if run.get("gathered") is None or run["gathered_at"] != run["steps"]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
        run["gathered"] = model_holding({k: v.detach().clone() for k, v in full.items()}, run.get("gathered"))
        run["gathered_at"] = run["steps"]
    return run["gathered"]


SCALER_FILE = "grad_scaler.pt"


class FSDP2Loop(RankEngine):
    def shard(self, model):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        def dtype(name):
            return None if ENGINE_SETTINGS.get(name) is None else getattr(torch, ENGINE_SETTINGS[name])

        policy = MixedPrecisionPolicy(
            param_dtype=dtype("param_dtype"), reduce_dtype=dtype("reduce_dtype"), output_dtype=dtype("output_dtype")
        )
        layers = [layer for module in model.modules() if isinstance(module, torch.nn.ModuleList) for layer in module]
        for layer in layers:
            if COMPILED:
                layer.compile(backend=COMPILE_BACKEND)
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model

    def start(self, model, training):
        sharded = self.shard(model)
        run = {"model": sharded, "optimizer": None, "scaler": None, "steps": 0}
        if training:
            sharded.train()
            run["optimizer"] = new_optimizer(sharded, DECAYED(sharded))
            run["scaler"] = new_scaler(CELL)
        return run

    def train(self, run, steps, seeds=None):
        run["model"].train()

        def step():
            run["steps"] += 1
            return rank_step(run["model"], run["optimizer"], run["scaler"])

        return rank_steps(step, steps, seeds)

    def evaluate(self, run):
        return evaluate_rows(run["model"])

    def dropout_off_loss(self, run):
        return dropout_off_rows_loss(run["model"])

    def weights(self, run):
        return gathered_weights(run, run["model"])

    def optimizer_state(self, run):
        return optimizer_tensors(run["optimizer"])

    def scaler_state(self, run):
        return None if run["scaler"] is None else run["scaler"].state_dict()

    def save(self, run, directory):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if run["optimizer"] is not None:
            model_state, optimizer_state = get_state_dict(run["model"], run["optimizer"])
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)
        else:
            dcp.save({"model": get_model_state_dict(run["model"])}, checkpoint_id=directory)
        if run["scaler"] is not None and writes():
            torch.save(run["scaler"].state_dict(), os.path.join(directory, SCALER_FILE))

    def export(self, run, directory, checkpoint):
        weights = self.weights(run)  # on every rank: gathering the shards is a collective
        if writes():
            os.makedirs(directory, exist_ok=True)
            save(weights, directory)
        return directory

    def restore(self, directory, training):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

        resumed = self.shard(build(CELL))
        if not training:
            model_state = get_model_state_dict(resumed)
            dcp.load({"model": model_state}, checkpoint_id=directory)
            set_state_dict(resumed, (), model_state_dict=model_state, optim_state_dict={})
            return {"model": resumed, "optimizer": None, "scaler": None, "steps": 0}
        optimizer = new_optimizer(resumed, DECAYED(resumed))
        model_state, optimizer_state = get_state_dict(resumed, optimizer)
        dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)
        set_state_dict(resumed, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
        scaler = new_scaler(CELL)
        if scaler is not None:
            scaler.load_state_dict(torch.load(os.path.join(directory, SCALER_FILE), weights_only=True))
        return {"model": resumed.train(), "optimizer": optimizer, "scaler": scaler, "steps": 0}


ENGINE = FSDP2Loop()


# ---------------------------------------------------------------- the phases

class Cell:
    """What the phases hand on: the run, the saved outputs, the restored run."""

    run = restored = evaluation = exported = exported_logits = None
    point = checkpoint = export = None


def plain_of(module):
    return getattr(module, "_orig_mod", module)


def compiled_if_asked(model):
    return torch.compile(model, backend=COMPILE_BACKEND) if COMPILED else model


def optimizer_tensors(optimizer):
    if optimizer is None:
        return {}
    inner = getattr(optimizer, "optimizer", optimizer)
    found = {}
    for g, group in enumerate(inner.param_groups):
        for i, parameter in enumerate(group["params"]):
            for key, value in inner.state.get(parameter, {}).items():
                if isinstance(value, torch.Tensor):
                    local = value.to_local() if hasattr(value, "to_local") else value
                    found[f"group {g}, parameter {i}: {key}"] = local.detach().clone()
    return found


def trainable_snapshot(model):
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad and not any(n == g or n.endswith("." + g) for g in GRADLESS)
    }


def evaluate_as_run(model):
    """A plain model evaluated under the autocast the engine's run had in its forward."""
    return evaluate_in({"autocast": RUN_AUTOCAST}, model)


def check_against_fp32(label, loss, model):
    value = finite_loss(loss, f"{label} loss")
    reference, _ = fp32_evaluation(model)
    reference = finite_loss(reference, f"fp32 reference {label} loss")
    within(
        "OutOfTolerance",
        f"{label} loss against an fp32 copy of the same weights",
        value,
        reference,
        EVAL_ROW,
        f"{label} loss is off the fp32 reference",
    )


def check_against_torch_engine(what, value, reference):
    if ENGINE_NAME == "torch":
        return
    within(
        "EngineDisagreement",
        f"{what} against the torch engine's",
        value,
        reference,
        EVAL_ROW,
        f"{what} disagrees with the torch engine's beyond tolerance",
    )


def torch_engine_dropout_off_loss(model):
    """The whole batch's training loss with dropout off (eval mode), under the precision's
    autocast, no gradients: the torch engine's side where a distributed engine's is taken so."""
    model.eval()
    with torch.no_grad(), autocast(CELL):
        return float(loss_of(model, BATCH).float().item())


def agreed(work):
    """work() in every rank of a distributed cell, then every rank learns whether it worked
    everywhere and waits for the others (what one rank wrote is there to read): a rank that failed
    raises its own error, the others PeerFailed, and none is left waiting in a collective."""
    if WORLD_SIZE == 1:
        return work()
    import torch.distributed as dist

    result = error = None
    try:
        result = work()
    except Exception as exc:  # raised below, once every rank knows
        error = exc
    failed = [None] * WORLD_SIZE
    dist.all_gather_object(failed, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    elsewhere = [(rank, what) for rank, what in enumerate(failed) if what is not None]
    if elsewhere:
        rank, what = elsewhere[0]
        raise CheckFailed("PeerFailed", f"rank {rank} failed where every rank works together", what)
    dist.barrier()
    return result


def frozen_kept(model, when):
    """The parameters the model is created frozen with (requires_grad=False) are still frozen."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    thawed = [name for name in FROZEN if name in trainable]
    compared(
        "FrozenParameterThawed", f"{when}: created-frozen parameters now trainable", len(thawed), 0, "0", not thawed
    )
    if thawed:
        raise CheckFailed(
            "FrozenParameterThawed",
            f"{when}: a parameter the model is created with requires_grad=False is trainable",
            f"{len(thawed)} of {len(FROZEN)}, first {thawed[0]}",
        )


def train_steps(cell):
    model = build(CELL)
    frozen_kept(model, "after build")
    cell.run = run = ENGINE.start(model, True)
    weights = ENGINE.weights(run)
    before, dtypes = trainable_snapshot(weights), tensor_dtypes(weights)
    dtypes.update(getattr(ENGINE, "dtype_changes", lambda run: {})(run))  # casts a library declares it makes later
    # a distributed engine whose kind draws dropout: each rank draws its rows' masks, so its first
    # step is compared with dropout off (eval mode), through the run's model before any step
    dropout_off = ENGINE.dropout_off_loss(run) if SPLIT_DRAWS else None
    seeds = SeededForwards(model)
    try:
        attempts = ENGINE.train(run, STEPS, seeds)
    finally:
        seeds.stop()
    losses = [loss for loss, _ in attempts]
    for loss in losses:
        finite_loss(loss, "training loss")
    applied = [loss for loss, taken in attempts if taken]
    diverged = None
    references = ((CELL, CURVE_VS_TORCH_ENGINE, "torch engine"), (FP32_TWIN, CURVE_VS_FP32_TWIN, "fp32 twin"))
    for precision, row, name in references:
        if row is None:
            continue
        try:
            reference = torch_loop_curve(precision)
        except Exception as exc:  # the yardstick fails: the torch engine cell's finding, as the matrix records it
            print(f"       the {name}'s curve could not be taken ({type(exc).__name__}: {exc}): not compared")
            continue
        found = curve_within("CurveDiverged", applied, reference, row, name)
        diverged = diverged or found
    weights = ENGINE.weights(run)
    first = seeds.training_in_first_forward
    mode = {True: "train", False: "eval", None: "not observed"}[first]
    held = first is not False
    compared("TrainedInEvalMode", "the model's mode in its first training forward", mode, "train", "train", held)
    if first is False:
        raise CheckFailed("TrainedInEvalMode", "the model was in eval mode in its first training forward (dropout off)")
    finite_parameters(weights, "after training")
    parameters_changed(before, weights)
    same_dtypes(dtypes, weights, "after training")
    fresh = seeded_training_loss(CELL, build(CELL))
    if LOSS_FALL is not None:
        after = seeded_training_loss(CELL, weights)
        fall = (fresh - after) / fresh if fresh else 0.0
        held = fresh > 0 and fall >= LOSS_FALL
        compared(
            "LossNotDecreasing",
            "relative fall of the training loss",
            f"{fall:.2%}",
            f"{fresh:.6g} -> {after:.6g}",
            f"at least {LOSS_FALL:.2%}",
            held,
        )
        if not held:
            raise CheckFailed(
                "LossNotDecreasing",
                "the training loss fell less than its bound over training",
                f"{fresh:.6g} -> {after:.6g}: {fall:.2%}, bound {LOSS_FALL:.2%}",
            )
    if dropout_off is None:
        check_against_torch_engine("first step loss", losses[0], fresh)
    else:
        reference = torch_engine_dropout_off_loss(build(CELL))
        check_against_torch_engine("first step loss dropout off", dropout_off, reference)
    if diverged is not None:
        raise diverged


def check_against_eager(cell, evaluation):
    """A compiled twin's evaluation against its eager twin: the same weights evaluated with every
    compiled module running eagerly, as the run evaluates. The logits' dtype is the same; the loss
    is within the compiled-vs-eager row of the compute dtype (EAGER_ROW)."""
    if not COMPILED:
        return
    owns_loop = getattr(ENGINE, "owns_loop", False)
    with torch.compiler.set_stance("force_eager"):
        if owns_loop:  # the library's evaluation was taken after step k: the weights held there
            eager = evaluate_as_run(getattr(ENGINE, "exported", ENGINE.weights)(cell.run))
        else:
            eager = ENGINE.evaluate(cell.run)
    value = finite_loss(evaluation[0], "compiled eval loss")
    reference = finite_loss(eager[0], "eager twin's eval loss")
    if not owns_loop:  # a library's loop evaluates through wrappers the plain model lacks
        same = evaluation[1].dtype == eager[1].dtype
        compared("DtypeContractBroken", "compiled eval logits dtype", str(evaluation[1].dtype), str(eager[1].dtype),
                 "the eager twin's", same)  # fmt: skip
        if not same:
            raise CheckFailed(
                "DtypeContractBroken",
                "compiled eval logits have another dtype than the eager twin's",
                f"compiled {evaluation[1].dtype}, eager {eager[1].dtype}",
            )
    within(
        "OutOfTolerance",
        "compiled eval loss against the eager twin",
        value,
        reference,
        EAGER_ROW,
        f"compiled eval loss against the eager twin {value:.6g} is off {reference:.6g}",
    )


def mid_training_eval(cell):
    cell.evaluation = ENGINE.evaluate(cell.run)
    check_against_fp32("mid-training eval", cell.evaluation[0], ENGINE.weights(cell.run))
    check_against_eager(cell, cell.evaluation)


def evaluate(cell):
    model = build(CELL)
    frozen_kept(model, "after build")
    cell.run = ENGINE.start(model, False)
    cell.evaluation = ENGINE.evaluate(cell.run)
    check_against_fp32("eval", cell.evaluation[0], ENGINE.weights(cell.run))
    check_against_eager(cell, cell.evaluation)
    if ENGINE_NAME == "torch":
        return
    try:
        torch_engine = evaluate_in(CELL, build(CELL))[0]
    except Exception as exc:  # the yardstick itself fails: the torch engine cell's finding, not this cell's
        print(f"the torch engine's evaluation fails ({type(exc).__name__}: {exc}): not compared, as the matrix records")
        return
    torch_engine = finite_loss(torch_engine, "torch engine eval loss")
    check_against_torch_engine("eval loss", finite_loss(cell.evaluation[0], "eval loss"), torch_engine)


def checkpoint_save(cell):
    run = cell.run
    cell.run_logits = (cell.evaluation or ENGINE.evaluate(run))[1]
    if TRAINING:
        cell.point = (ENGINE.optimizer_state(run), plain_scaler_state(ENGINE.scaler_state(run)))
    # what export() must read back as (an engine whose export is not its weights view says so)
    cell.exported = getattr(ENGINE, "exported", ENGINE.weights)(run)
    cell.exported_dtypes = tensor_dtypes(cell.exported)
    cell.exported_logits = evaluate_as_run(cell.exported)[1]
    cell.checkpoint = os.path.join(WORKDIR, "checkpoint")
    os.makedirs(cell.checkpoint, exist_ok=True)
    agreed(lambda: ENGINE.save(run, cell.checkpoint))  # every rank's part written before anyone reads
    cell.export = agreed(lambda: ENGINE.export(run, os.path.join(WORKDIR, "export"), cell.checkpoint))


def checkpoint_reload(cell):
    reloaded = reload(cell.export, CELL)
    declared = declared_fp32(reloaded) if CELL["weights_from"] == "load" else ()
    same_dtypes(cell.exported_dtypes, reloaded, "after reload", declared)
    frozen_kept(reloaded, "after reload")
    outputs_equal("eval logits", cell.exported_logits, evaluate_as_run(reloaded)[1])
    cell.restored = ENGINE.restore(cell.checkpoint, TRAINING)
    outputs_equal("eval logits of the resumed run", cell.run_logits, ENGINE.evaluate(cell.restored)[1])


def step_tensors(run):
    found = {f"parameter {n}": p.detach().clone() for n, p in ENGINE.weights(run).named_parameters() if p.requires_grad}
    found.update({f"optimizer {k}": v for k, v in ENGINE.optimizer_state(run).items()})
    return found


def step_on(run):
    with torch.random.fork_rng(devices=RNG_DEVICES):
        torch.manual_seed(RESUME_SEED)
        attempts = ENGINE.train(run, 1)
    return [loss for loss, _ in attempts], step_tensors(run)


def plain_scaler_state(state):
    """A loss scaler's state with its one-element tensors as numbers, comparable with ==."""
    if state is None:
        return None
    return {k: v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for k, v in state.items()}


def resumed_step(cell):
    saved, saved_scaler = cell.point
    restored_state = ENGINE.optimizer_state(cell.restored)
    restored_scaler = plain_scaler_state(ENGINE.scaler_state(cell.restored))  # right after the restore
    missing = [name for name in saved if name not in restored_state]
    different = [
        n for n, v in saved.items() if n in restored_state and not torch.equal(v, restored_state[n].to(v.device))
    ]
    mismatch = None
    if missing or different:
        what = "missing" if missing else "differs"
        mismatch = CheckFailed(
            "CheckpointMismatch",
            f"optimizer state {what} after reload",
            f"{len(missing or different)} of {len(saved)} tensors, first {(missing or different)[0]}",
        )
    elif saved_scaler is not None:
        same = restored_scaler == saved_scaler
        compared("CheckpointMismatch", "grad scaler state after reload", restored_scaler, saved_scaler, "equal", same)
        if not same:
            mismatch = CheckFailed(
                "CheckpointMismatch",
                "grad scaler state differs after reload",
                f"{saved_scaler} before, {restored_scaler} after",
            )
    before = trainable_snapshot(ENGINE.weights(cell.restored))
    uninterrupted, after_uninterrupted = step_on(cell.run)
    resumed, after_resume = step_on(cell.restored)
    if mismatch is not None:
        raise mismatch
    held = (
        resumed == uninterrupted
        if RESUME_ROW is None
        else all(
            abs(a - b) <= allowance_of(RESUME_ROW["loss"], b) for a, b in zip(resumed, uninterrupted, strict=False)
        )
    )
    compared(
        "ResumeDiverged",
        "step k+1 loss, resumed against uninterrupted",
        resumed,
        uninterrupted,
        "bit for bit" if RESUME_ROW is None else RESUME_ROW["loss"],
        held and len(resumed) == len(uninterrupted),
    )
    if not held or len(resumed) != len(uninterrupted):
        raise CheckFailed(
            "ResumeDiverged",
            "the resumed step's loss differs from the uninterrupted run's",
            f"{resumed} vs {uninterrupted}",
        )
    differing, worst = [], 0.0
    for name, expected in after_uninterrupted.items():
        got = after_resume.get(name)
        if got is None or got.shape != expected.shape or got.dtype != expected.dtype:
            differing.append(name)
            continue
        difference = (got.double() - expected.double()).abs()
        worst = max(worst, difference.max().item() if difference.numel() else 0.0)
        if RESUME_ROW is None:
            same = torch.equal(got, expected)
        else:
            row = RESUME_ROW["tensors"]
            same = bool((difference <= row["atol"] + row["rtol"] * expected.double().abs()).all())
        if not same:
            differing.append(name)
    compared("ResumeDiverged", "tensors after step k+1 differing", len(differing), 0, "none", not differing)
    if differing:
        raise CheckFailed(
            "ResumeDiverged",
            "parameters or optimizer state after the resumed step differ from the uninterrupted run's",
            f"{len(differing)} of {len(after_uninterrupted)} tensors, first {differing[0]}, "
            f"max abs difference {worst:.3g}",
        )
    parameters_changed(before, ENGINE.weights(cell.restored))


PHASES = [globals()[name] for name in PHASE_ORDER]  # the cell's phases, in the matrix's order


def environment():
    found = {"python": platform.python_version(), "torch": torch.__version__, "device": DEVICE}
    for name in ("transformers", "peft", "accelerate", "lightning", "deepspeed", "bitsandbytes", "torchao"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            pass
    found["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name()
    return found


def run_phases():
    """Every phase of the mode in order, up to the first failure: {"failure": ..., "checks": ...}."""
    cell, failure = Cell(), None
    for phase in PHASES:
        NOW["phase"] = phase.__name__
        print("phase", phase.__name__, flush=True)
        try:
            phase(cell)
        except Exception as exc:  # the cell's failure, or another: named below with its traceback
            name = exc.name if isinstance(exc, CheckFailed) else type(exc).__name__
            failure = {"phase": phase.__name__, "name": name, "message": str(exc).splitlines()[0] if str(exc) else ""}
            if getattr(exc, "details", ""):
                print(f"       {exc.details}")
                failure["details"] = exc.details
            if not isinstance(exc, CheckFailed):
                traceback.print_exc()
            break
    return {"failure": failure, "checks": CHECKS}


def rank_main(rank, port, out):
    """One rank of a distributed engine's cell: the process group's environment, the engine's
    own setup (ENGINE.setup_rank), the phases; rank 0 writes what happened to `out`."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        LOCAL_WORLD_SIZE=str(WORLD_SIZE),
    )
    if rank != 0:  # rank 0's checks are the script's output; the other ranks' errors still go to stderr
        sys.stdout = open(os.devnull, "w")  # for the rank's whole life
    ENGINE.setup_rank(rank)
    result = run_phases()
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(result, handle, default=str)


def launch():
    """WORLD_SIZE ranks of this script, started by it (torch.multiprocessing; the engine's backend:
    gloo on a CPU): rank 0's outcome is the script's."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    out = os.path.join(WORKDIR, "rank0.json")
    if os.path.exists(out):
        os.remove(out)  # another run's, in a REPRO_WORKDIR given again
    try:
        torch.multiprocessing.start_processes(rank_main, args=(port, out), nprocs=WORLD_SIZE, start_method="spawn")
    except Exception as exc:  # a rank died (a signal, an error outside the phases): the matrix's RankDied
        if not os.path.exists(out):
            message = (str(exc).strip().splitlines() or [""])[0]
            return {"failure": {"phase": "launch", "name": "RankDied", "message": message}, "checks": []}
    with open(out) as handle:
        return json.load(handle)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the outcome, every check's numbers and the environment here")
    args = parser.parse_args()
    result = launch() if DISTRIBUTED else run_phases()
    failure = result["failure"]
    if failure is None:
        outcome, line, status = "holds", "HOLDS: every check of the cell held", 0
    elif TARGET is None or (failure["phase"], failure["name"]) == (TARGET["phase"], TARGET["name"]):
        outcome, status = "reproduced", 1
        line = f"REPRODUCED in {failure['phase']}: {failure['name']}: {failure['message']}"
    else:
        outcome, status = "another", 2
        line = f"ANOTHER FAILURE in {failure['phase']}: {failure['name']}: {failure['message']}"
        line += f" (the matrix saw {TARGET['phase']}: {TARGET['name']})"
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {
                    "outcome": outcome,
                    "phase": failure and failure["phase"],
                    "failure": failure and {"name": failure["name"], "message": failure["message"]},
                    "target": TARGET,
                    "checks": result["checks"],
                    "environment": environment(),
                },
                handle,
                indent=1,
                default=str,
            )
    print(line)
    return status


# ---------------------------------------------------------------- what the precision adds

QUANTIZED_ROW = {'atol': 0.002, 'rtol': 0.002}

import bitsandbytes as bnb
from peft import PeftModel, prepare_model_for_kbit_training
from transformers import BitsAndBytesConfig


def bnb_config(quantization):
    """The BitsAndBytesConfig a user writes for the precision's quantization."""
    if quantization["bits"] == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quantization["scheme"],
        bnb_4bit_use_double_quant=quantization["double_quant"],
        bnb_4bit_compute_dtype=quantization["compute_dtype"],
    )


def quantized_base(directory, precision, quantize=True):
    """The base from `directory` as QLoRA scripts obtain it: from_pretrained with the quantization
    config (quantize=False: a checkpoint saved quantized, whose config carries it), in the
    precision's dtype, then peft's prepare_model_for_kbit_training (it casts every unquantized
    weight to fp32 and turns on gradient checkpointing)."""
    quantization = precision["quantization"]
    base = load_quantized(directory, precision["weights"], bnb_config(quantization) if quantize else None)
    if quantization["prepare_for_kbit_training"]:
        base = prepare_model_for_kbit_training(base)
    return base


def quantized_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}


def check_storage(model, quantization, when):
    """Every linear layer but the output projection is a bitsandbytes layer of the scheme: its
    weight in the storage dtype, its quant state as declared."""
    layers = quantized_layers(model)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inside = {id(sub) for layer in layers.values() for sub in layer.modules()}
    adapters = tuple(n for n, _ in model.named_modules() if "lora_" in n)
    plain = [
        n
        for n, m in model.named_modules()
        if type(m) is torch.nn.Linear
        and m is not output
        and id(m) not in inside
        and not (adapters and n.startswith(adapters))
    ]
    storage = torch.uint8 if quantization["bits"] == 4 else torch.int8
    wrong = []
    for name, layer in layers.items():
        found, want = {"dtype": layer.weight.dtype}, {"dtype": storage}
        if quantization["bits"] == 4:
            state = layer.weight.quant_state
            found.update(quant_type=state.quant_type, compute_dtype=layer.compute_dtype)
            want.update(quant_type=quantization["scheme"], compute_dtype=quantization["compute_dtype"])
            if not getattr(state, "packing_format_for_cpu", False):  # the CPU's inference packing drops the nesting
                found["double_quant"], want["double_quant"] = bool(state.nested), quantization["double_quant"]
        else:
            found["scales"], want["scales"] = getattr(layer.weight, "SCB", None) is not None, True
        if found != want:
            wrong.append((name, {k: (found[k], want[k]) for k in want if found[k] != want[k]}))
    held = bool(layers) and not plain and not wrong
    compared(
        "DtypeContractBroken",
        f"{when}: {quantization['scheme']} layers",
        f"{len(layers)} quantized, {len(plain)} plain nn.Linear, {len(wrong)} not as declared",
        "every linear layer but the output projection",
        "none left out",
        held,
    )
    if not layers or plain:
        raise CheckFailed(
            "DtypeContractBroken",
            f"{when}: linear layers left unquantized in a {quantization['scheme']} base",
            f"{len(plain)} plain nn.Linear, first {plain[0] if plain else None}; {len(layers)} quantized",
        )
    if wrong:
        name, differences = wrong[0]
        field, (value, wanted) = next(iter(differences.items()))
        raise CheckFailed(
            "DtypeContractBroken",
            f"{when}: a {quantization['scheme']} layer's {field} is {value}, not {wanted}",
            f"{len(wrong)} of {len(layers)} quantized layers, first {name}",
        )


@contextlib.contextmanager
def fp32_compute(model):
    """The same quantized weights multiplied in fp32: every 4-bit layer's compute dtype set to fp32
    for the duration (an int8 layer has none: LLM.int8 computes as it does)."""
    changed = [(m, m.compute_dtype) for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for module, _ in changed:
        module.compute_dtype = torch.float32
    try:
        yield
    finally:
        for module, dtype in changed:
            module.compute_dtype = dtype


def float_tensors(model):
    """Every floating-point parameter and buffer, not through state_dict(): a 4-bit layer's
    state_dict() undoes a CPU inference's packing, and a check must not change what it checks."""
    found = dict(model.named_parameters())
    found.update(model.named_buffers())
    return {name: tensor for name, tensor in found.items() if tensor.is_floating_point()}


def copy_float_weights(source, target, trainable_only=False):
    """`source`'s floating tensors (the adapters, norms, embeddings; or its trainable ones) into
    `target` where it has them under the same name and shape; the quantized weights stay as
    `target` has them. Returns the trainable names that found no place."""
    theirs = float_tensors(target)
    trainable = {n for n, p in source.named_parameters() if p.requires_grad}
    copied = []
    with torch.no_grad():
        for name, tensor in float_tensors(source).items():
            if name in theirs and tensor.shape == theirs[name].shape and (name in trainable or not trainable_only):
                theirs[name].copy_(tensor)
                copied.append(name)
    return sorted(trainable - set(copied))


def fp32_evaluation(model):
    """The fp32 reference of a quantized cell: a base quantized anew holding `model`'s floating
    weights, every 4-bit layer multiplied in fp32, no autocast (the precision's own error; the
    quantization's is check_quantization_error's)."""
    same_base = build(CELL)
    copy_float_weights(model, same_base)
    same_base.eval()
    with torch.no_grad(), fp32_compute(same_base):
        return outputs_of(evaluate_model(same_base, BATCH))


def check_quantization_error(label, value, model):
    """The evaluation against the unquantized fp32 model holding the same trained adapters (the
    rest as created), within the scheme's row (QUANTIZED_ROW: QUANTIZED_VS_UNQUANTIZED)."""
    twin = build(FP32)
    missing = copy_float_weights(model, twin, trainable_only=True)
    if missing:
        raise CheckFailed(
            "CheckFailure",
            "the unquantized model has no place for a trained tensor of the quantized one",
            f"{len(missing)} trainable tensors, first {missing[0]}",
        )
    twin.eval()
    with torch.no_grad():
        reference = finite_loss(outputs_of(evaluate_model(twin, BATCH))[0], "unquantized fp32 loss")
    within(
        "OutOfTolerance",
        f"{label} loss against the unquantized fp32 model with the same adapters",
        value,
        reference,
        QUANTIZED_ROW,
        f"{label} loss against the unquantized model is off the fp32 reference",
    )


check_against_fp32_unquantized = check_against_fp32


def check_against_fp32(label, loss, model):
    check_against_fp32_unquantized(label, loss, model)
    check_quantization_error(label, finite_loss(loss, f"{label} loss"), model)


def checkpoint_reload(cell):
    """The reload of a quantized cell: the kind's load of the export (a base quantized anew, the
    adapters on top) gives back the dtypes, the storage and the outputs bit for bit; the adapters
    it holds, saved before it is evaluated (a CPU inference repacks 4-bit weights), go through the
    two other saves users make; then the engine's own resume path."""
    reloaded = reload(cell.export, CELL)
    declared = declared_fp32(reloaded) if CELL["weights_from"] == "load" else ()
    same_dtypes(cell.exported_dtypes, reloaded, "after reload", declared)
    frozen_kept(reloaded, "after reload")
    check_storage(reloaded, CELL["quantization"], "after reload")
    adapters = os.path.join(WORKDIR, "quantized-saves", "adapters")
    writes = int(os.environ.get("RANK", "0")) == 0  # one rank saves, as transformers does in a group

    def reload_and_saves():
        if writes:
            os.makedirs(adapters, exist_ok=True)
            save(reloaded, adapters)
        outputs_equal("eval logits", cell.exported_logits, evaluate_as_run(reloaded)[1])
        if writes:
            check_quantized_saves(adapters)

    agreed(reload_and_saves)  # the ranks' models differ once one checked the saves: all learn the outcome
    cell.restored = ENGINE.restore(cell.checkpoint, TRAINING)
    outputs_equal("eval logits of the resumed run", cell.run_logits, ENGINE.evaluate(cell.restored)[1])


def check_quantized_saves(adapters):
    """Both saves run; a mismatch in the first is raised after the second was measured."""
    mismatches = []
    for check in (check_prequantized_save, check_merged_save):
        try:
            check(adapters)
        except CheckFailed as failed:
            if failed.name != "CheckpointMismatch":
                raise
            mismatches.append(failed)
    if mismatches:
        raise mismatches[0]


def check_prequantized_save(adapters):
    """The quantized base saved as pre-quantized checkpoints are shared (save_pretrained of the
    base without its adapters), read back, prepared, the adapters over it."""
    directory = os.path.join(os.path.dirname(adapters), "quantized-base")
    model = reload(adapters, CELL)
    before = evaluate_as_run(model)[1]
    model.unload().save_pretrained(directory)
    again = PeftModel.from_pretrained(quantized_base(directory, CELL, quantize=False), adapters, is_trainable=True)
    check_storage(again, CELL["quantization"], "after reading the saved quantized base")
    outputs_equal("eval logits over the saved quantized base", before, evaluate_as_run(again)[1])


def check_merged_save(adapters):
    """The adapters merged into the quantized base (peft's merge_and_unload), evaluated, saved,
    read back with the kind's quantized load (the checkpoint's own config), evaluated again."""
    directory = os.path.join(os.path.dirname(adapters), "merged")
    as_adapters = evaluate_as_run(reload(adapters, CELL))[1]
    merged = reload(adapters, CELL).merge_and_unload()
    merged_outputs = evaluate_as_run(merged)[1]
    deviation = (merged_outputs.float() - as_adapters.float()).abs().max().item()
    print(f"       merging moved the logits by {deviation:.3g} at most (recorded, not checked)")
    merged.save_pretrained(directory)
    reread = load_quantized(directory, CELL["weights"])
    before, after = float_tensors(merged), float_tensors(reread)
    changed = [
        f"{n} {t.dtype} -> {after[n].dtype}" for n, t in before.items() if n in after and after[n].dtype != t.dtype
    ]
    first = f", first {changed[0]}" if changed else ""
    print(f"       {len(changed)} unquantized tensors read back in another dtype{first} (not checked)")
    check_storage(reread, CELL["quantization"], "after reading the saved merged model")
    outputs_equal("eval logits of the saved merged model", merged_outputs, evaluate_as_run(reread)[1])


engine_start = ENGINE.start


def start_checked(model, training):
    """The storage of the model as built, checked before the engine starts it (as the matrix's build)."""
    check_storage(model, CELL["quantization"], "after build")
    return engine_start(model, training)


ENGINE.start = start_checked
# the phases run the quantized checkpoint_reload above in place of the plain one
PHASES = [checkpoint_reload if p.__name__ == "checkpoint_reload" else p for p in PHASES]


if __name__ == "__main__":
    sys.exit(main())
