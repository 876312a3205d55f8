"""A quantized base written out (bitsandbytes nf4, fp4 or int8 under LoRA), as the matrix builds and
checks it (matrix/precisions/quantization.py, against_references.check_quantization_error, check_reload's quantized
branch): the base loaded with the BitsAndBytesConfig users write and prepared for training as QLoRA
scripts prepare it; its storage checked after build and after every reload; the fp32 reference =
the same quantized weights multiplied in fp32; every evaluation also against the unquantized fp32
model holding the trained adapters; and the reload's two other saves (the quantized base shared
pre-quantized, the adapters merged into it), each read back bit for bit. Not imported: its text
follows the phases (it replaces check_against_fp32, fp32_evaluation and checkpoint_reload, and
checks the storage as the engine starts the model) and precedes main. build() and reload() call
quantized_base() for a precision with a quantization."""

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


def copy_float_weights(source, target, trainable_only=False, source_dtypes=False):
    """`source`'s floating tensors (the adapters, norms, embeddings; or its trainable ones) into
    `target` where it has them under the same name and shape; the quantized weights stay as
    `target` has them. In `target`'s dtypes, or with `source_dtypes` in `source`'s (what a library
    holds, which may have cast it). Returns the trainable names that found no place."""
    theirs = float_tensors(target)
    trainable = {n for n, p in source.named_parameters() if p.requires_grad}
    copied = []
    with torch.no_grad():
        for name, tensor in float_tensors(source).items():
            if name in theirs and tensor.shape == theirs[name].shape and (name in trainable or not trainable_only):
                if source_dtypes and tensor.dtype != theirs[name].dtype:
                    theirs[name].data = tensor.detach().to(theirs[name].device, copy=True)
                else:
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
    declared = declared_fp32(reloaded) if RELOAD_KEEPS_DECLARED_FP32 else ()
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
