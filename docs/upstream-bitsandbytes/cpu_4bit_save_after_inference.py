"""bitsandbytes: saving a 4-bit model after a CPU inference changes the model.

Standalone reproduction (torch, transformers, bitsandbytes only; nothing is downloaded: the
model is built from a tiny config in code and saved to temporary directories).

On a CPU with AVX512-BF16, the first eval-mode no-grad forward of a `Linear4bit` repacks its
weight for the CPU kernel (`bitsandbytes.functional._convert_weight_packed_for_cpu`): the
double-quantized absmax is dequantized, reordered to (in_features // blocksize, out_features)
and cast to bfloat16, and `quant_state.packing_format_for_cpu` is set. `Linear4bit._save_to_state_dict`
(reached by `save_pretrained`, by `model.state_dict()`, and so by peft's adapter saving) undoes
the packing with `_convert_weight_packed_for_cpu_inverse` before writing. The inverse restores
the 4-bit codes, but not the absmax:

  * double quant on: it re-quantizes the bf16-rounded absmax (new offset = mean, new
    state2); the absmax the layer dequantizes with is no longer the one it had;
  * double quant off: it leaves absmax as the bf16 (in_features // 64, out_features) tensor
    of the packed layout.

That state is both what is written to the file and what stays in memory, so the model answers
differently after the save than before it, and a model re-read from the saved directory
answers like the changed one. A model saved without an inference before reproduces exactly.

For each of double quant on / off: first a bare bnb.nn.Linear4bit(128, 64) (dequantized weight
and eval output before an eval forward, then after state_dict()); then, with a tiny LlamaForCausalLM (hidden_size=64,
intermediate_size=128) loaded with BitsAndBytesConfig(load_in_4bit=True, nf4, bf16 compute):
  control: load, save_pretrained (no inference before), evaluate, re-read, evaluate;
  bug:     load, evaluate twice, save_pretrained, evaluate, re-read the saved dir, evaluate;
  state_dict only: load, evaluate, call model.state_dict() (nothing written), evaluate.
It prints the quant_state of two layers (q_proj with in_features 64, down_proj with in_features
128) before the inference, after it, and after the save, and the max abs logit differences.

Prints REPRODUCED and exits 1 when the Llama logits after the save differ from those before it
(while the control reproduces exactly and two forwards before the save agree), or when the bare
layer's dequantized weight or eval output changes across state_dict(); prints NOT REPRODUCED and exits 0 otherwise.

Run: python cpu_4bit_save_after_inference.py
"""

import platform
import sys
import tempfile

import bitsandbytes as bnb
import bitsandbytes.functional as F
import torch
import transformers
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM


def cpu_flag(flag):
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return flag in line.split()
    except OSError:
        pass
    return None


def print_versions():
    print(f"python        {platform.python_version()} ({platform.machine()})")
    print(f"torch         {torch.__version__}")
    print(f"transformers  {transformers.__version__}")
    print(f"bitsandbytes  {bnb.__version__}")
    print(f"torch.backends.cpu.get_cpu_capability(): {torch.backends.cpu.get_cpu_capability()}")
    has = getattr(F, "has_avx512bf16", None)
    if has is None:
        print("bitsandbytes.functional.has_avx512bf16(): absent in this release (no CPU weight packing)")
    else:
        print(
            f"bitsandbytes.functional.has_avx512bf16(): {has()}  "
            "(what Linear4bit.support_avx512bf16_for_cpu is set from)"
        )
    print(f"/proc/cpuinfo avx512_bf16 flag: {cpu_flag('avx512_bf16')}")
    print()


CFG = dict(
    vocab_size=99,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def qconfig(double_quant):
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def load(path, double_quant):
    m = LlamaForCausalLM.from_pretrained(path, quantization_config=qconfig(double_quant), dtype=torch.bfloat16)
    m.eval()
    return m


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def layers(model):
    blk = model.model.layers[0]
    return {"q_proj": blk.self_attn.q_proj, "down_proj": blk.mlp.down_proj}


def effective_absmax(qs):
    """The float32 per-block absmax the (unpacked) layer dequantizes with, flat, in storage order."""
    if qs.nested:
        a = F.dequantize_blockwise(qs.absmax, qs.state2)
        a = a + qs.offset
        return a.float().reshape(-1)
    return qs.absmax.float().reshape(-1)


def describe(qs):
    s = (
        f"absmax {qs.absmax.dtype!s:14s} {tuple(qs.absmax.shape)!s:9s} nested={qs.nested!s:5s} "
        f"dtype={qs.dtype} packing_format_for_cpu={getattr(qs, 'packing_format_for_cpu', 'n/a')}"
    )
    if qs.nested:
        s += f" offset={float(qs.offset):.9g} state2.absmax[:2]={qs.state2.absmax.flatten()[:2].tolist()}"
    return s


def snapshot(model):
    out = {}
    for name, lin in layers(model).items():
        qs = lin.weight.quant_state
        snap = {"desc": describe(qs), "packed": bool(getattr(qs, "packing_format_for_cpu", False))}
        if not snap["packed"]:
            snap["absmax"] = effective_absmax(qs).clone()
            snap["qabsmax"] = qs.absmax.clone()
            snap["w"] = F.dequantize_4bit(lin.weight.data, qs).float().clone()
            snap["N"], snap["K"], snap["bs"] = qs.shape[0], qs.shape[1], qs.blocksize
        out[name] = snap
    return out


def compare_state(before, after):
    for name in before:
        b, a = before[name], after[name]
        if "absmax" not in b or "absmax" not in a:
            print(f"    {name}: (packed, not compared)")
            continue
        ab, aa = b["absmax"], a["absmax"]
        line = f"    {name}: effective absmax "
        if ab.shape != aa.shape:
            line += f"shape {tuple(ab.shape)} -> {tuple(aa.shape)}"
        else:
            ndiff = int((ab != aa).sum())
            line += f"{ndiff}/{ab.numel()} blocks differ, max |diff| {float((ab - aa).abs().max()):.3g}"
            # is it exactly the bf16-rounded original (same order)? or its (K/bs, N) transpose?
            bf = ab.to(torch.bfloat16).float()
            line += f"; == bf16(original): {bool(torch.equal(aa, bf))}"
            N, K, bs = b["N"], b["K"], b["bs"]
            if N * (K // bs) == ab.numel():
                bft = bf.reshape(N, K // bs).T.reshape(-1)
                line += f"; == bf16(original) in packed (K/64, N) order: {bool(torch.equal(aa, bft))}"
        if b["qabsmax"].dtype == a["qabsmax"].dtype and b["qabsmax"].shape == a["qabsmax"].shape:
            changed = int((b["qabsmax"] != a["qabsmax"]).sum())
            line += f"; stored absmax ({a['qabsmax'].dtype}) entries changed: {changed}/{b['qabsmax'].numel()}"
        line += f"; dequantized weight max |diff| {float((b['w'] - a['w']).abs().max()):.3g}"
        print(line)


def file_state(path, prefix="model.layers.0.mlp.down_proj.weight."):
    """The down_proj quant-state tensors as written in <path>/model.safetensors."""
    import json

    from safetensors.torch import load_file

    sd = load_file(f"{path}/model.safetensors")
    parts = []
    for k in sorted(sd):
        if k.startswith(prefix) and k != prefix.rstrip("."):
            v = sd[k]
            short = k[len(prefix) :]
            if short.startswith("quant_state.bitsandbytes__"):
                meta = json.loads(bytes(v.tolist()).decode("utf-8"))
                parts.append(f"{short}: nested_offset={meta.get('nested_offset')}")
            else:
                parts.append(f"{short} {str(v.dtype).replace('torch.', '')}{tuple(v.shape)}")
    return parts, sd


def print_snap(title, snap):
    print(f"  {title}")
    for name, s in snap.items():
        print(f"    {name:9s} {s['desc']}")


def bare_layer(double_quant):
    """A bare bnb.nn.Linear4bit(128, 64): eval forward, state_dict(), eval forward."""
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(
        128, 64, bias=False, compute_dtype=torch.bfloat16, compress_statistics=double_quant, quant_type="nf4"
    )
    lin = torch.nn.Linear(128, 64, bias=False)
    torch.nn.init.normal_(lin.weight, std=0.02)  # like LlamaConfig's initializer_range
    layer.load_state_dict(lin.to(torch.bfloat16).state_dict())
    layer = layer.to("cpu")
    if not getattr(layer.weight, "bnb_quantized", True):
        layer.weight = layer.weight._quantize("cpu")
    layer.eval()
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    print(f"  bare Linear4bit(128, 64): after quantizing: {describe(layer.weight.quant_state)}")
    w0 = F.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float().clone()
    with torch.no_grad():
        y1 = layer(x).float()
        y1b = layer(x).float()
    print(f"  bare Linear4bit(128, 64): after eval forward: {describe(layer.weight.quant_state)}")
    sd = layer.state_dict()
    absmax_key = [k for k in sd if k.endswith("absmax") and "nested" not in k]
    if absmax_key:
        a = sd[absmax_key[0]]
        print(f"  bare Linear4bit(128, 64): state_dict()['{absmax_key[0]}']: {a.dtype} {tuple(a.shape)}")
    print(f"  bare Linear4bit(128, 64): after state_dict(): {describe(layer.weight.quant_state)}")
    w1 = F.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    dw = float((w0 - w1).abs().max())
    print(f"  bare Linear4bit(128, 64): dequantize_4bit(weight) max |before inference - after state_dict()| = {dw:.6g}")
    with torch.no_grad():
        y2 = layer(x).float()
    d_rep = float((y1 - y1b).abs().max())
    d = float((y1 - y2).abs().max())
    print(
        f"  bare Linear4bit(128, 64): eval output max |before - after state_dict()| = {d:.6g} "
        f"(two forwards before: {d_rep:.6g})"
    )
    return max(d, dw), d_rep


def variant(double_quant):
    print(f"=== double quant {'on' if double_quant else 'off'} (bnb_4bit_use_double_quant={double_quant}) ===")
    d_bare, d_bare_rep = bare_layer(double_quant)
    try:
        return llama(double_quant, d_bare, d_bare_rep)
    except ImportError as exc:  # transformers >= 5 refuses bitsandbytes < 0.46.1
        print(f"  Llama case NOT RUN: {type(exc).__name__}: {exc}")
        print()
        return dict(
            bare=d_bare, bare_repeat=d_bare_rep, ctrl=None, repeat=None, save=None, reread=None, state_dict=None
        )


def llama(double_quant, d_bare, d_bare_rep):
    cfg = LlamaConfig(**CFG)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    with tempfile.TemporaryDirectory() as root:
        src = f"{root}/fp32"
        LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(src)

        # control: save before any inference
        ctrl = load(src, double_quant)
        ctrl.save_pretrained(f"{root}/ctrl")
        l_ctrl = logits(ctrl, ids)
        l_ctrl_reread = logits(load(f"{root}/ctrl", double_quant), ids)
        d_ctrl = float((l_ctrl - l_ctrl_reread).abs().max())
        print(f"  control (saved before any inference): max |logits(model) - logits(re-read)| = {d_ctrl:.6g}")

        # the bug: inference, then save
        m = load(src, double_quant)
        s0 = snapshot(m)
        print_snap("quant_state after loading:", s0)
        l_before = logits(m, ids)
        l_before2 = logits(m, ids)
        print_snap("quant_state after the eval-mode no-grad forward:", snapshot(m))
        m.save_pretrained(f"{root}/after")
        s2 = snapshot(m)
        print_snap("quant_state after save_pretrained:", s2)
        print("  change of the in-memory state, loading -> after save_pretrained:")
        compare_state(s0, s2)
        l_after = logits(m, ids)
        reread = load(f"{root}/after", double_quant)
        s3 = snapshot(reread)
        print("  change, loading -> model re-read from the directory saved after the inference:")
        compare_state(s0, s3)
        l_reread = logits(reread, ids)
        f_ctrl, sd_ctrl = file_state(f"{root}/ctrl")
        f_after, sd_after = file_state(f"{root}/after")
        print("  down_proj quant state in model.safetensors, saved before any inference (control):")
        for p in f_ctrl:
            print(f"    {p}")
        print("  down_proj quant state in model.safetensors, saved after an inference:")
        for p in f_after:
            print(f"    {p}")
        changed = [
            k
            for k in sd_ctrl
            if k in sd_after
            and (
                sd_ctrl[k].shape != sd_after[k].shape
                or sd_ctrl[k].dtype != sd_after[k].dtype
                or not torch.equal(sd_ctrl[k], sd_after[k])
            )
        ]
        print(
            f"  tensors that differ between the two files ({len(changed)}/{len(sd_ctrl)}; "
            "same weights, same 4-bit codes expected):"
        )
        kinds = sorted({k.split(".weight.")[-1] if ".weight." in k else k.rsplit(".", 1)[-1] for k in changed})
        print(f"    kinds: {kinds}")

        d_repeat = float((l_before - l_before2).abs().max())
        d_save = float((l_before - l_after).abs().max())
        d_reread = float((l_after - l_reread).abs().max())
        d_before_ctrl = float((l_before - l_ctrl).abs().max())
        print(f"  max |logits before save (1st) - (2nd forward)|          = {d_repeat:.6g}")
        print(f"  max |logits before save - control model's logits|       = {d_before_ctrl:.6g}")
        print(f"  max |logits before save - logits after save (same obj)| = {d_save:.6g}")
        print(f"  max |logits after save - logits of re-read saved dir|   = {d_reread:.6g}")

        # state_dict() alone (what peft's get_peft_model_state_dict / save_pretrained call)
        m3 = load(src, double_quant)
        l3a = logits(m3, ids)
        _ = m3.state_dict()
        l3b = logits(m3, ids)
        d_sd = float((l3a - l3b).abs().max())
        print(f"  state_dict() only: max |logits before - after model.state_dict()| = {d_sd:.6g}")
    print()
    return dict(
        bare=d_bare, bare_repeat=d_bare_rep, ctrl=d_ctrl, repeat=d_repeat, save=d_save, reread=d_reread, state_dict=d_sd
    )


def main():
    print_versions()
    res = {dq: variant(dq) for dq in (True, False)}

    def fmt(v):
        return "not run" if v is None else f"{v:.3g}"

    repro_llama = [
        dq for dq, r in res.items() if r["save"] is not None and r["save"] > 0 and r["ctrl"] == 0 and r["repeat"] == 0
    ]
    repro_bare = [dq for dq, r in res.items() if r["bare"] > 0 and r["bare_repeat"] == 0]
    for dq, r in res.items():
        print(
            f"double quant {'on ' if dq else 'off'}: bare layer max change (weight or output) "
            f"across state_dict {fmt(r['bare'])}; Llama: "
            f"control {fmt(r['ctrl'])}, repeat {fmt(r['repeat'])}, before-vs-after-save {fmt(r['save'])}, "
            f"after-save-vs-reread {fmt(r['reread'])}, state_dict-only {fmt(r['state_dict'])}"
        )
    onoff = lambda dqs: ", ".join("on" if dq else "off" for dq in dqs)  # noqa: E731
    if repro_llama or repro_bare:
        print(
            "REPRODUCED: saving (state_dict) after a CPU inference changes the 4-bit model"
            + (f"; Llama logits before save != after save (double quant {onoff(repro_llama)})" if repro_llama else "")
            + (
                "; bare Linear4bit dequantized weight and/or output changed by state_dict() "
                f"(double quant {onoff(repro_bare)})"
                if repro_bare
                else ""
            )
        )
        return 1
    not_run = any(r["save"] is None for r in res.values())
    print(
        "NOT REPRODUCED: outputs before and after saving agree"
        + (" (the Llama case did not run: see above)" if not_run else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
