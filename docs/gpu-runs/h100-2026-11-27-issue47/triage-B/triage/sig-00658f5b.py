#!/usr/bin/env python3
"""Standalone reproduction of precision-matrix cell lora-fp16-mixed-train-cuda-accelerate-fsdp2.
The matrix saw: resumed_step: matrix.checks.CheckpointMismatch: grad scaler state differs after reload @ matrix.resume:check_restored

    pip install torch==2.11.0 transformers==5.17.0 peft==0.21.0 accelerate==1.15.0 safetensors==0.8.0 triton==3.6.0 liger-kernel==0.8.5 bitsandbytes==0.50.2 deepspeed==0.19.8 torchao==0.17.0
    python lora-fp16-mixed-train-cuda-accelerate-fsdp2.py [--json out.json]

Model lora, precision fp16-mixed (fp32 master weights, fp16 autocast, GradScaler), mode train, engine
accelerate-fsdp2, device cuda. Every comparison prints its numbers and allowance (lines
CHECK ...). Exit 1: the matrix's failure shows (the same check or exception, same phase);
0: every check held; 2: another failure. Imports nothing but the upstream libraries.

NEEDS A GPU (cuda): the cell ran there; the script runs on cuda only.

Made on (the run this cell is from):
  accelerate 1.15.0, bitsandbytes 0.50.2, deepspeed 0.19.8, hypothesis 6.168.3, liger-kernel 0.8.5, lightning 2.6.6, numpy 2.5.2, peft 0.21.0, pytest 9.1.1, pytest-xdist 3.8.0, safetensors 0.8.0, torch 2.11.0, torchao 0.17.0, transformers 5.17.0, triton 3.6.0
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

CELL_ID = 'lora-fp16-mixed-train-cuda-accelerate-fsdp2'
ENGINE_NAME = 'accelerate-fsdp2'
MODE = 'train'
TRAINING = True
DEVICE = 'cuda:0'
DEVICE_TYPE = 'cuda'
CELL = {'name': 'fp16-mixed', 'weights': torch.float32, 'autocast': torch.float16, 'grad_scaler': True, 'weights_from': 'cast', 'grad_accumulation': 1, 'grad_dtype': None, 'quantization': None, 'float8': None}
FP32 = {'name': 'fp32', 'weights': torch.float32, 'autocast': None, 'grad_scaler': False, 'weights_from': 'cast', 'grad_accumulation': 1, 'grad_dtype': None, 'quantization': None, 'float8': None}
FP32_TWIN = {'name': 'fp32', 'weights': torch.float32, 'autocast': None, 'grad_scaler': False, 'weights_from': 'cast', 'grad_accumulation': 1, 'grad_dtype': None, 'quantization': None, 'float8': None}
RUN_AUTOCAST = None
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
CURVE_VS_FP32_TWIN = {'atol': 0.003, 'rtol': 0.0, 'per_step': 0.003, 'row': 'casts-parameters float16'}
LOSS_FALL = 0.00506709032009675
RESUME_ROW = {'loss': {'atol': 0.001, 'rtol': 0.001}, 'tensors': {'atol': 0.0001, 'rtol': 0.002}}
ENGINE_SETTINGS = {'mixed_precision': 'fp16', 'mixed_precision_policy': {'param_dtype': 'float16', 'reduce_dtype': 'float32', 'output_dtype': 'float16'}}
DISTRIBUTED = True
WORLD_SIZE = 1
SPLIT_DRAWS = False
COMPILED = False
COMPILE_BACKEND = 'inductor'
INIT_SEED = 0
FIRST_FORWARD_SEED = 20261123
RESUME_SEED = 20261125
MAX_STEP_ATTEMPTS = 16
TARGET = {'phase': 'resumed_step', 'name': 'CheckpointMismatch', 'text': 'resumed_step: matrix.checks.CheckpointMismatch: grad scaler state differs after reload @ matrix.resume:check_restored'}
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


def curve_within(name, losses, reference, row, what):
    """Step s (1-based) may differ by atol + rtol * |reference| + per_step * (s - 1)."""
    first_outside, worst_share = None, 0.0
    for step, (loss, ref) in enumerate(zip(losses, reference, strict=False), start=1):
        allowed = row["atol"] + row["rtol"] * abs(ref) + row["per_step"] * (step - 1)
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


def gathered_weights(run, sharded):
    """A sharded run's weights whole, in a plain model, gathered (on every rank) once per step."""
    if run.get("gathered") is None or run["gathered_at"] != run["steps"]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
        run["gathered"] = model_holding({k: v.detach().clone() for k, v in full.items()}, run.get("gathered"))
        run["gathered_at"] = run["steps"]
    return run["gathered"]


def reset_accelerate():
    """The Accelerator's state is a process-wide singleton: forgotten, as a new process would."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class AccelerateFSDP2Loop(RankEngine):
    def plugin(self, model):
        from accelerate.utils import FullyShardedDataParallelPlugin

        options = {"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"}
        policy = ENGINE_SETTINGS.get("mixed_precision_policy")
        if policy is not None:
            options["mixed_precision_policy"] = {k: getattr(torch, v) for k, v in policy.items()}
        layers = getattr(model, "_no_split_modules", None)
        if layers:  # a transformers model names its layers: one FSDP unit each
            options["auto_wrap_policy"] = "transformer_based_wrap"
            options["transformer_cls_names_to_wrap"] = list(layers)
        return FullyShardedDataParallelPlugin(**options)

    def accelerator(self, model):
        from accelerate import Accelerator
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType

        mixed = ENGINE_SETTINGS["mixed_precision"]
        plugin = self.plugin(model)
        options = {"dynamo_backend": "inductor"} if COMPILED else {}
        accelerator = Accelerator(mixed_precision=mixed, cpu=DEVICE_TYPE == "cpu", fsdp_plugin=plugin, **options)
        if accelerator.distributed_type != DistributedType.FSDP:
            # accelerate selects FSDP on accelerator devices only: the selection it makes there
            print(f"accelerate left a {accelerator.device.type} group {accelerator.distributed_type}: FSDP selected")
            accelerator.state.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            if mixed != "no":
                plugin.set_mixed_precision(mixed)
            accelerator.state.fsdp_plugin = plugin
        if not accelerator.is_fsdp2:
            raise RuntimeError(
                f"accelerate did not take the FSDP2 path (distributed_type {accelerator.distributed_type})"
            )
        return accelerator

    def prepared(self, model, training):
        """prepare(model, optimizer): accelerate's FSDP2 path takes both together, in eval too."""
        accelerator = self.accelerator(model)
        model.train(training)
        prepared, optimizer = accelerator.prepare(model, new_optimizer(model, DECAYED(model)))
        return {"accelerator": accelerator, "model": prepared, "optimizer": optimizer, "steps": 0}

    def start(self, model, training):
        run = self.prepared(model, training)
        self.check_declared(run, "after prepare")
        return run

    def check_declared(self, run, when):
        """What accelerate declares under mixed precision: the trained parameters are fp32 master
        weights (the matrix's check_fp32_master_weights); without it the precision's dtypes stay."""
        if ENGINE_SETTINGS["mixed_precision"] == "no":
            return
        trained = {n: p for n, p in self.weights(run).named_parameters() if p.requires_grad}
        wrong = {n: p.dtype for n, p in trained.items() if p.dtype != torch.float32}
        what = f"{when}, the trained parameters (fp32 master weights under FSDP2)"
        dtype = next(iter(wrong.values()), torch.float32)
        compared("DtypeContractBroken", what, f"{len(wrong)} not fp32", "0", "none", not wrong)
        if wrong:
            raise CheckFailed(
                "DtypeContractBroken",
                f"{what}: weights are {dtype}, not torch.float32",
                f"{len(wrong)} of {len(trained)}, first {next(iter(wrong))}",
            )

    def train(self, run, steps, seeds=None):
        run["model"].train()
        return rank_steps(lambda: self.step(run), steps, seeds)

    def step(self, run):
        run["steps"] += 1
        rows = rank_rows(BATCH)
        run["optimizer"].zero_grad(set_to_none=True)
        loss = loss_of(run["model"], rows)  # autocast comes from the prepared forward
        value = finite_loss(loss, "training loss")
        run["accelerator"].backward(loss * loss_weight(rows))
        run["optimizer"].step()
        applied = not run["accelerator"].optimizer_step_was_skipped
        finite_parameters(run["model"], "after the optimizer step")
        return group_mean(value, loss_items(rows)), applied

    def evaluate(self, run):
        return evaluate_rows(run["model"], with_autocast=False)  # the prepared forward autocasts

    def dropout_off_loss(self, run):
        return dropout_off_rows_loss(run["model"], with_autocast=False)

    def weights(self, run):
        return gathered_weights(run, plain_of(run["model"]))

    def exported(self, run):
        """The trained weights read in the cell's precision: copied into a model in its dtypes."""
        in_precision = build(CELL)
        in_precision.load_state_dict(self.weights(run).state_dict())
        return in_precision

    def optimizer_state(self, run):
        return optimizer_tensors(run["optimizer"])

    def scaler_state(self, run):
        scaler = run["accelerator"].scaler
        return None if scaler is None else scaler.state_dict()

    def save(self, run, directory):
        run["accelerator"].save_state(str(directory))

    def export(self, run, directory, checkpoint):
        full = run["accelerator"].get_state_dict(run["model"])  # every rank gathers
        if writes():
            saved = build(CELL)
            saved.load_state_dict({k: v.to(DEVICE) for k, v in full.items()}, assign=True)
            os.makedirs(directory, exist_ok=True)
            save(saved, directory)
        return directory

    def restore(self, directory, training):
        reset_accelerate()
        run = self.prepared(build(CELL), training)
        run["accelerator"].load_state(str(directory))
        return run


ENGINE = AccelerateFSDP2Loop()


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


def mid_training_eval(cell):
    cell.evaluation = ENGINE.evaluate(cell.run)
    check_against_fp32("mid-training eval", cell.evaluation[0], ENGINE.weights(cell.run))


def evaluate(cell):
    model = build(CELL)
    frozen_kept(model, "after build")
    cell.run = ENGINE.start(model, False)
    cell.evaluation = ENGINE.evaluate(cell.run)
    check_against_fp32("eval", cell.evaluation[0], ENGINE.weights(cell.run))
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
        cell.point = (ENGINE.optimizer_state(run), ENGINE.scaler_state(run))
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


def resumed_step(cell):
    saved, _ = cell.point
    restored_state = ENGINE.optimizer_state(cell.restored)
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


PHASES = {
    "train": [train_steps, mid_training_eval, checkpoint_save, checkpoint_reload, resumed_step],
    "eval": [evaluate, checkpoint_save, checkpoint_reload],
}


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
    for phase in PHASES[MODE]:
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


if __name__ == "__main__":
    sys.exit(main())
