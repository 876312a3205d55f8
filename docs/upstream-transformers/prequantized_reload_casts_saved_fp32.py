"""Reloading a merged bitsandbytes checkpoint: are its fp32 tensors kept or cast?

What this shows
---------------
A k-bit LoRA workflow leaves a model whose non-quantized tensors are float32:
``peft.prepare_model_for_kbit_training`` upcasts every floating parameter that is
not quantized (embeddings, RMSNorm weights, lm_head) to fp32. After
``merge_and_unload()`` + ``save_pretrained()`` the checkpoint therefore holds
int8 / packed-4bit weights *and* fp32 embeddings/norms/lm_head, plus a
``quantization_config``. The script reloads that directory with the same
``dtype=`` the model was first loaded with and compares, per tensor, the dtype
on disk with the dtype after reload, and the logits of the merged model with
the logits of the reloaded one on a fixed batch (eval mode, no_grad).

If transformers casts the saved fp32 tensors to ``dtype`` on reload, the
reloaded model is not the model that was saved and the logits differ.

Two cases, built from a tiny random Llama (hidden 64, 2 layers, 4 heads,
vocab 128, seed 0; nothing is downloaded):
  int8 : BitsAndBytesConfig(load_in_8bit=True), dtype=torch.float16
  nf4  : BitsAndBytesConfig(load_in_4bit=True, nf4, compute bf16), dtype=torch.bfloat16
LoRA on q_proj/v_proj with ``init_lora_weights=False`` (B is non-zero, so the
merge really changes the quantized weights).

Usage:  python prequantized_reload_casts_saved_fp32.py [device]   (default cpu)
Exit:   1 if any case shows a dtype change or a logit difference,
        2 if no difference was seen but a case failed to run,
        0 if every case reloads bit-identically.

The rule (read from the wheels, transformers 5.20.2 vs 5.21.0; upstream PR not identified)
------------------------------------------------------------------------------------------
On a pre-quantized bnb load, every checkpoint key ending in ``weight`` is matched by
the quantizer's deserialize converter (``Bnb8bitDeserialize`` / ``Bnb4bitDeserialize``),
including the keys of modules that are not quantized (embeddings, norms, lm_head).
What changed is how ``core_model_loading.convert_and_load_state_dict_in_model``
picks the dtype a floating checkpoint tensor is materialized in:
  * 5.17 .. 5.20: it keeps the checkpoint dtype only when the converter renamed the
    key (``SCB``, ``weight.absmax`` ... -> ``weight``) or the tensor is not floating
    point. Any other float tensor goes to the requested ``dtype`` (or the dtype of
    the freshly built parameter), so saved fp32 embeddings/norms/lm_head come back
    fp16 / bf16.
  * 5.21: after that usual choice, a pre-quantized load calls the new
    ``HfQuantizer.get_new_dtype`` (quantizers/base.py), which returns ``None``
    (= keep the checkpoint dtype) for a float tensor whose converter holds an op
    bound to the quantizer. For bnb that is every ``*.weight`` key, so those keep
    their saved dtype. Float tensors that no quantizer converter matches are still
    cast: an fp32 ``q_proj.bias`` comes back fp16 on 5.21 as well.
Checkpoints without a ``quantization_config`` have no quantizer, so on every
version listed here a mixed fp32/fp16 checkpoint loaded with ``dtype=float16``
comes back all fp16.

Seen (CPU, torch 2.13.0+cpu, peft 0.21.2, accelerate 1.15.0, bitsandbytes 0.50.2)
  transformers 5.17.0, 5.20.2 -> exit 1: in both cases the 7 fp32 tensors
      (embed_tokens, 4 layer norms, final norm, lm_head) are reloaded as
      fp16/bf16; max |logit diff| is int8 0.00354 and nf4 0.00319.
  transformers 5.21.0 -> exit 0: no dtype changes, and the logit difference is
      0.0 for both cases.
  On CPU only: the nf4 merged model's own logits move by 0.0101 across
  save_pretrained. On the first eval forward, bitsandbytes' Linear4bit repacks
  its weight for the CPU kernel. Taking the state dict undoes that repack, and
  the undo is lossy, so the script uses the model's logits *after* saving as
  the reference. That shift is printed but does not count toward the exit code.
"""

import importlib.metadata
import json
import struct
import sys
import tempfile
from pathlib import Path

import bitsandbytes
import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(torch.float32)


def dtypes_on_disk(directory: Path) -> dict[str, torch.dtype]:
    """Tensor name -> dtype, read from the safetensors headers (no tensor data loaded)."""
    found = {}
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
        for name, meta in header.items():
            if name != "__metadata__":
                found[name] = SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"])
    return found


def run_case(name, quant_config, dtype, base_dir: Path, work: Path, device: str, batch) -> bool:
    """Returns True when the reloaded model differs from the saved one."""
    print(f"\n== {name}: bitsandbytes pre-quantized reload, dtype={dtype}")
    device_map = {"": device}
    model = LlamaForCausalLM.from_pretrained(
        base_dir, quantization_config=quant_config, dtype=dtype, device_map=device_map
    )
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    lora = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM"
    )
    merged = get_peft_model(model, lora).merge_and_unload()
    merged.eval()
    with torch.no_grad():
        logits_before_save = merged(input_ids=batch).logits.float()

    out_dir = work / name
    merged.save_pretrained(out_dir)
    on_disk = dtypes_on_disk(out_dir)
    # The reference is the merged model as it is *after* saving: on CPU, bitsandbytes'
    # Linear4bit repacks its weight for the CPU kernel on the first eval forward and undoes
    # that (lossily) when its state dict is taken, so saving can itself move the nf4 logits.
    with torch.no_grad():
        logits_saved = merged(input_ids=batch).logits.float()
    drift = (logits_before_save - logits_saved).abs().max().item()
    print(f"merged model's own logits, before vs after save_pretrained (info only): {drift!r}")

    reloaded = LlamaForCausalLM.from_pretrained(out_dir, dtype=dtype, device_map=device_map)
    reloaded.eval()
    with torch.no_grad():
        logits_reloaded = reloaded(input_ids=batch).logits.float()

    counts: dict[str, int] = {}
    for tensor in on_disk.values():
        counts[str(tensor)] = counts.get(str(tensor), 0) + 1
    print(f"saved tensor dtypes: {counts}")

    changed = []
    for key, tensor in reloaded.state_dict().items():
        if key in on_disk and tensor.dtype != on_disk[key]:
            changed.append((key, on_disk[key], tensor.dtype))
    if changed:
        print(f"tensors whose dtype changed on reload ({len(changed)}):")
        for key, saved, now in changed:
            print(f"  {key}: saved {saved} -> reloaded {now}")
    else:
        print("tensors whose dtype changed on reload: none")

    max_diff = (logits_saved - logits_reloaded).abs().max().item()
    print(f"max |logits(merged) - logits(reloaded)| = {max_diff!r}")
    return bool(changed) or max_diff != 0.0


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    print(
        "versions: "
        f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
        f"bitsandbytes {bitsandbytes.__version__}, accelerate {importlib.metadata.version('accelerate')}; "
        f"device {device}"
    )
    cases = [
        ("int8", BitsAndBytesConfig(load_in_8bit=True), torch.float16),
        (
            "nf4",
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16),
            torch.bfloat16,
        ),
    ]
    batch = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)

    differs, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base_dir = work / "base_fp32"
        tiny_llama().save_pretrained(base_dir)
        for name, quant_config, dtype in cases:
            try:
                if run_case(name, quant_config, dtype, base_dir, work, device, batch):
                    differs.append(name)
            except Exception as exc:  # report and keep going with the other case
                print(f"{name}: FAILED to run: {type(exc).__name__}: {exc}")
                failed.append(name)

    print(f"\nresult: differs={differs} failed={failed}")
    if differs:
        return 1
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
