"""How the cell's model is obtained, written out: build(precision) as the precision says (created
from the seed and cast, or saved in fp32 and loaded in its dtype; a quantized base loaded with its
BitsAndBytesConfig and prepared for training, by parts/quantized.py's quantized_base),
reload(directory, precision) with the kind's own load. A kind's code that builds on these (LoRA's
adapters) follows them; a float8 precision converts what they give (parts/float8.py)."""


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
