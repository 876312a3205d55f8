#!/usr/bin/env python3
"""Training on half-precision weights with fp32 master weights parts from fp32 further on OLMo2 (fp16)
and Gemma 4 (bf16) than the rows written for architectures nobody measured allow: no engine is
needed to show it.

The every-engine sweep's curve cells that remain new (docs/triage-every-engine/README.md) are
engines whose libraries run the forward and backward on a half copy of the weights and step fp32
masters: accelerate's and torch's FSDP2 (MixedPrecisionPolicy param_dtype) and DeepSpeed's bf16/fp16
optimizers and ZeRO. The torch loop the matrix compares them with keeps fp32 weights under autocast.
This script trains the same tiny models (the matrix's configs, seed 0, its three-row batch, AdamW lr
1e-2 and weight decay 0.01 as every engine trains) three ways in one process, with nothing but torch
and transformers:

  fp32          the fp32 twin
  autocast      fp32 weights, the half dtype's autocast (and a GradScaler for fp16): the torch engine
  half weights  the forward and backward on the parameters cast to the half dtype (buffers left as
                they are, as FSDP2 casts parameters only), gradients handed to fp32 masters, AdamW on
                those, clipped as the engine clips, with no GradScaler (neither engine below ran one
                on a CPU): the arithmetic of the engines whose cells are new, in one process where
                they ran two

and prints each curve's distance from fp32 and from autocast at every step, beside what the rows for
an unmeasured kind allow there (matrix/checks/tolerances.py UNMEASURED_KIND_ROWS, copied below: the
fp32 twin's row and the torch engine's row of the dtype).

    pip install torch==2.13.0 transformers==5.24.0
    python half_weights_vs_autocast.py

Exit 1 when the half-weights loop leaves a row (the curves' finding shows without any engine), 0
when it stays within every row, 2 on an error.
"""

import copy
import sys

import torch
import transformers

STEPS, LR, WEIGHT_DECAY = 3, 1e-2, 0.01
BATCH = {
    "input_ids": torch.tensor(
        [[18, 54, 9, 56, 47, 55, 27, 60], [0, 0, 0, 82, 84, 90, 76, 61], [0, 0, 0, 0, 0, 0, 97, 78]]
    ),
    "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]]),
    "labels": torch.tensor(
        [[18, 54, 9, 56, 47, 55, 27, 60], [-100, -100, -100, -100, 84, 90, 76, 61], [-100] * 7 + [78]]
    ),
}
TINY = {
    "vocab_size": 99, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64, "initializer_range": 0.02, "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2, "attention_dropout": 0.0, "attention_bias": False,
}  # fmt: skip
MODELS = {
    # (config class, model class, the config beyond TINY, the half dtype its new cells trained in, and
    # the arithmetic of an engine whose cells are new. OLMo2: accelerate's FSDP2 on a CPU, which casts
    # the parameters to fp16 (MixedPrecisionPolicy) with no autocast and no GradScaler (the cells record
    # native_amp False, grad_scaler False) and clips nothing. Gemma 4: DeepSpeed's bf16 ZeRO, whose
    # module runs in bf16 without autocast, stepping fp32 masters, gradients clipped to 1.0.)
    "olmo2": (
        "Olmo2Config", "Olmo2ForCausalLM",
        {"hidden_act": "silu", "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
         "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
        torch.float16, {"clip": None, "scaler": False},
    ),
    "gemma4_unified_text": (
        "Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM",
        {"head_dim": 8, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
         "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                "rope_theta": 1000000.0}},
         "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": None,
         "use_bidirectional_attention": "vision", "attention_k_eq_v": False, "num_kv_shared_layers": 0,
         "use_double_wide_mlp": False, "hidden_size_per_layer_input": 8, "per_layer_config": {"1": {"head_dim": 16}}},
        torch.bfloat16, {"clip": 1.0, "scaler": False},
    ),
}  # fmt: skip
# an unmeasured kind's rows (atol, rtol, per step): step s may differ by atol + rtol * |reference| + per_step * (s - 1)
ROWS = {
    ("fp32 twin", torch.float16): (2e-3, 1e-3, 1e-3),
    ("fp32 twin", torch.bfloat16): (1e-2, 5e-3, 3e-3),
    ("torch engine", torch.float16): (1e-3, 1e-3, 1e-3),
    ("torch engine", torch.bfloat16): (5e-3, 5e-3, 2e-3),
}


def create(name):
    config_class, model_class, extra, _, _ = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**TINY, **extra)
    return getattr(transformers, model_class)(config)


def curve(name, autocast=None, half=None, clip=None, scaler=True):
    """The losses of the first STEPS applied steps: fp32 masters stepped by AdamW; the forward under
    `autocast`, or on a copy of the parameters in `half`; a GradScaler where either is float16 and
    `scaler` is true (the torch loop's fp16 autocast has one)."""
    master = create(name)
    master.train()
    optimizer = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scaler = torch.amp.GradScaler("cpu") if scaler and torch.float16 in (autocast, half) else None
    losses = []
    while len(losses) < STEPS:
        optimizer.zero_grad(set_to_none=True)
        model = master
        if half is not None:
            model = copy.deepcopy(master)
            for parameter in model.parameters():
                parameter.data = parameter.data.to(half)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(**BATCH, use_cache=False).loss
        (loss if scaler is None else scaler.scale(loss)).backward()
        if model is not master:
            for kept, used in zip(master.parameters(), model.parameters(), strict=True):
                kept.grad = None if used.grad is None else used.grad.float()
        if scaler is not None:
            scaler.unscale_(optimizer)
        if clip:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        finite = all(torch.isfinite(p.grad).all() for p in master.parameters() if p.grad is not None)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        if finite:
            losses.append(float(loss.detach().float()))
    return losses


def allowed(reference_name, dtype, step, reference):
    atol, rtol, per_step = ROWS[reference_name, dtype]
    return atol + rtol * abs(reference) + per_step * (step - 1)


def compare(what, losses, reference, reference_name, dtype):
    """Prints each step against the reference's row; True where every step is within it."""
    held = True
    for step, (loss, ref) in enumerate(zip(losses, reference, strict=True), start=1):
        limit = allowed(reference_name, dtype, step, ref)
        share = abs(loss - ref) / limit
        held &= share <= 1
        print(
            f"  {what} against the {reference_name}, step {step}: {loss:.5f} vs {ref:.5f}, |difference| "
            f"{abs(loss - ref):.4f}, allowed {limit:.4f} ({share:.2f}x the unmeasured-kind {str(dtype)[6:]} row)"
        )
    return held


def main():
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    shown = []
    for name, (_, _, _, dtype, engine) in MODELS.items():
        clip = engine["clip"]
        scaler = "a GradScaler" if engine["scaler"] else "no GradScaler"
        print(f"\n{name}: {str(dtype)[6:]}, gradients clipped to {clip}, the half-weights loop with {scaler}")
        fp32 = curve(name, clip=clip)
        autocast = curve(name, autocast=dtype, clip=clip)
        half = curve(name, half=dtype, **engine)
        for label, losses in (("fp32", fp32), ("autocast", autocast), ("half weights", half)):
            print(f"  {label:13s} {[round(x, 5) for x in losses]}")
        compare("autocast", autocast, fp32, "fp32 twin", dtype)
        twin = compare("half weights", half, fp32, "fp32 twin", dtype)
        engine = compare("half weights", half, autocast, "torch engine", dtype)
        if not (twin and engine):
            shown.append(name)
    print(f"\nthe half-weights loop leaves a row on: {', '.join(shown)}" if shown else "\nevery curve within every row")
    return 1 if shown else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as error:  # exit 2 names any other failure
        print(f"another failure: {type(error).__name__}: {error}")
        sys.exit(2)
