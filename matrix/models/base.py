"""What every model kind provides (ModelKind), what no variant changes (the vocabulary, the
special tokens, the seeds; the sizes are the variant's, matrix/grid/variants.py), the traits catalogue
selectors match (TRAITS), and the model axis' registry (MODELS).

A model kind is a small factory in the spirit of transformers' model testers: it builds a
deterministic model (tiny, from a config in code; nothing is downloaded), makes a fixed batch,
computes the loss, evaluates, and saves/loads a checkpoint the way its library does.
"""

from __future__ import annotations

import abc
import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from matrix.grid.registry import Registry
from matrix.grid.variants import MAX_POSITIONS, InvalidVariant, Variant, check_common
from matrix.precisions.policies import Precision

# What no variant changes. The sizes the grid runs with are Variant's defaults
# (matrix/grid/variants.py); each kind's grid_variant says how its batch is padded.
VOCAB_SIZE = 99
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
INIT_SEED = 0
PRETRAINED_FP32 = "pretrained-fp32"  # under a cell's workdir: the kind's fp32 weights, saved for *-loaded-* builds
BATCH_SEED = 1234

# What a model kind is, as far as known failures care: catalogue entries can select cells by
# trait (matrix/catalogue/known_failures.toml, `trait = [...]`), so a failure class known for the
# built-in kinds is recognised in a user's kind that has the same trait. Each is observed on
# the built model (matrix/models/observation.py); a kind may declare its own set instead (`traits`).
TRAITS: dict[str, str] = {
    "full-weights": "trains its weights (at least half of its parameters), held in the precision's weights dtype",
    "adapters": "trains a minority of its parameters (adapters over a frozen base)",
    "frozen-parameters": (
        "trains its weights but creates some parameters frozen, requires_grad=False (an MoE router's "
        "e_score_correction_bias, which only routes), and its loader gives them back trainable"
    ),
    "layer-norm": "has torch nn.LayerNorm modules, whose weights take the precision's dtype",
    "no-float8-layers": (
        "has no nn.Linear layer float8 training converts (its projections are other modules, GPT-2's Conv1D; "
        "the first and last Linear layers are left out)"
    ),
    "frozen-linear-bias": (
        "has frozen nn.Linear layers with a bias (Qwen2's q/k/v projections under adapters): a quantized base "
        "replaces their weights and keeps the biases as float parameters"
    ),
    "from-pretrained": "create() returns the model in eval mode, as from_pretrained() does",
    "loaded-from-pretrained": (
        "in the *-loaded-* precisions the model read back from its checkpoint is in eval mode, as "
        "from_pretrained() returns it"
    ),
    "dropout": "two training forwards with different random numbers give different losses",
    "updates-below-bf16-resolution": (
        "at its learning rate an AdamW step is below half a bf16 ulp of its largest trainable weights "
        "(norm weights near 1.0 under a fine-tuning rate): in bf16 they cannot move"
    ),
    "unmapped-loss-type": (
        "a transformers model whose class name names no loss type (loss_type None: GPT2LMHeadModel) and whose "
        "loss predicts the next token (the labels shifted by one)"
    ),
    "unsaved-float-buffers": (
        "has floating-point buffers its checkpoint leaves out (RoPE's inv_freq) and reloads through the library's "
        "loader, which makes them in another dtype than the bf16 asked for (fp32): a cast to half does not "
        "survive a save and reload"
    ),
    "saved-in-another-layout": (
        "its save writes some state-dict entries under other names or shapes (transformers 5's MoE experts one "
        "per expert, renamed modules, as the Hub's checkpoints have them): only from_pretrained converts them back"
    ),
    "embeddings-in-no-split-module": (
        "its input embeddings sit inside a module its _no_split_modules lists (BERT: BertEmbeddings)"
    ),
    "fp32-parameters-in-bf16-loads": (
        "a bf16 from_pretrained leaves some of its trainable parameters in fp32 (fp32-parameters-in-half-loads, "
        "for that dtype: _keep_in_fp32_modules_strict, or created so by its __init__)"
    ),
    "fp32-parameters-in-fp16-loads": (
        "an fp16 from_pretrained leaves some of its trainable parameters in fp32 (fp32-parameters-in-half-loads, "
        "for that dtype: _keep_in_fp32_modules too, GPT-OSS's norms)"
    ),
    "fp32-parameters-in-half-loads": (
        "its class keeps some trainable parameters in fp32 when loaded in bf16 or fp16: declared "
        "(_keep_in_fp32_modules(_strict): DeepseekV2's router gate.weight) or created so by its __init__, "
        "whose created dtype the loader keeps (HunYuan MoE's router gate.wg.weight, OLMo hybrid's A_log)"
    ),
    "ignores-num-items-in-batch": (
        "its transformers forward takes **kwargs, so the Trainer passes num_items_in_batch and scales its "
        "loss by the process count, but its loss ignores it (MBartForCausalLM's own CrossEntropyLoss)"
    ),
    "next-token-loss-takes-num-items": (
        "its transformers forward takes **kwargs and its loss changes with the num_items_in_batch it is given "
        "(ForCausalLMLoss divides its sum by it), and given none averages over next-token labels: a Trainer "
        "that counts every label, the first of each row too, makes the loss smaller"
    ),
    "module-shared-across-instances": (
        "some of its submodules are the very objects every other instance of it in the process holds "
        "(XLM's feed-forward activation is transformers' module-level gelu): a library that registers a model's "
        "modules (DeepSpeed ZeRO-3) registers them again for a second model"
    ),
    "parameters-tied-across-layers": (
        "two entries of one of its ModuleLists (its layer stack) hold the same parameter (Zamba's shared "
        "transformer block, tied into every hybrid layer): a wrapper that shards each layer on its own "
        "meets one tensor in two groups"
    ),
    "module-calls-vary-across-ranks": (
        "its forward calls a module holding parameters a different number of times on each rank's share of a "
        "batch (DBRX's experts call their one mlp once per expert the tokens reach): DeepSpeed ZeRO-3 gathers "
        "a module's parameters at each call, so the ranks' gathers no longer pair up"
    ),
    "forward-recomputed-in-backward": (
        "a training step runs some of its modules without autograd in the forward and again in the backward "
        "(Reformer's reversible layers): their forward outputs carry no autograd node for a wrapper to hook"
    ),
    "tied-output-bias": (
        "its output embeddings' bias is the same parameter as another module's (BERT-style heads: "
        "cls.predictions.decoder.bias is cls.predictions.bias)"
    ),
    "unused-parameters": (
        "has trainable parameters its training forward never uses: no gradient in the fp32 backward "
        "(MBartForCausalLM's cross-attention, which a decoder without an encoder never calls)"
    ),
    "no-split-module-absent": (
        "its _no_split_modules names a class it holds no module of (MBartForCausalLM inherits "
        "MBartEncoderLayer from its family's list)"
    ),
}


def local_directory(directory: Path) -> Path:
    """A checkpoint directory a kind loads from, which must be there: a missing one is an error
    here, never a Hub repository id for transformers or peft to look up (local_files_only=True
    is not enough: huggingface_hub 2.x asks the Hub for its own request headers first)."""
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {directory} (the matrix loads local directories only)")
    return Path(directory)


@dataclass
class EvalOutput:
    loss: torch.Tensor
    logits: torch.Tensor
    generated: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)


def seeded_tokens(lengths: tuple[int, ...], pad_left: bool, seed: int = BATCH_SEED):
    """Token ids and attention mask (1 = real token) for sequences of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        tokens = torch.randint(EOS_TOKEN_ID + 1, VOCAB_SIZE, (length,), generator=generator)
        span = slice(width - length, width) if pad_left else slice(0, length)
        ids[row, span] = tokens
        mask[row, span] = 1
    return ids, mask


def variant_tokens(variant: Variant):
    """The variant's batch: token ids and attention mask (1 = real token)."""
    return seeded_tokens(variant.lengths, pad_left=variant.padding == "left")


class ModelKind(abc.ABC):
    """One value of the model axis, built with `variant`'s settings (the grid's by default)."""

    name: str
    description: str
    grid_variant: Variant = Variant()
    # the Variant fields this kind reads: what exploration varies and reports record
    variant_fields: tuple[str, ...] = ("seq_len", "padding", "pad_counts")
    # keys of TRAITS. None: observed on the built model (matrix/models/observation.py); a kind may
    # declare its set instead, which then replaces the observed one in catalogue selection
    traits: frozenset[str] | None = None
    explorable = True  # False: exploration (matrix/explore/exploration.py) has no variants of it to draw
    learning_rate: float | None = None  # AdamW's, in every engine; None: searched (matrix/harness/learning_rate.py)
    # trains adapters over a frozen base, which may be quantized (the quantized precisions)
    quantizable = False
    # the packages it needs beyond torch, as pip names them (matrix/grid/packages.py): without one its
    # cells skip and build() raises, naming it and how to install it
    requires: tuple[str, ...] = ()

    @property
    def variant(self) -> Variant:
        return self.__dict__.get("_variant", self.grid_variant)

    def standalone_code(self) -> str:
        """Code defining create(), save(), load_weights(), loss_of() and evaluate_model() for a
        standalone reproduction script (python -m matrix repro). A built-in kind writes itself
        out with the upstream libraries alone; by default a kind is built through its own
        module (a plugin's kind: the script imports that module)."""
        from matrix.models.standalone import plugin_code

        return plugin_code(self)

    def with_variant(self, variant: Variant) -> ModelKind:
        """This kind built and fed with another variant's settings (after check_variant)."""
        self.check_variant(variant)
        configured = copy.copy(self)
        configured._variant = variant
        return configured

    def skip_reason(self, device: str) -> str | None:
        """Why this kind cannot run on `device` here ("Requires: [...] (...)"), or None: by default
        a package it requires is not installed. A kind with reasons of its own asks super() first."""
        from matrix.grid import packages

        return packages.skip_reason(self.requires)

    def require(self, precision: Precision | None = None) -> None:
        """Raise MissingPackage where a package this kind (or the quantized base `precision`
        asks for) needs is absent: the line its cells skip with, before any library is asked."""
        from matrix.grid import packages

        needs = (*self.requires, *(precision.requires if precision is not None else ()))
        packages.require(needs, f"the {self.name} model kind")

    def precision_skip_reason(self, precision: Precision) -> str | None:
        """Why this kind cannot run `precision` here ("Requires: [...] (...)"), or None: a
        quantized base needs a kind that trains adapters over it, and bitsandbytes; float8, torchao."""
        if precision.float8 is not None:
            from matrix.grid import packages

            return packages.skip_reason(precision.float8.requires)
        if precision.quantization is None:
            return None
        if not self.quantizable:
            return (
                f"Requires: [adapters to train over a quantized base] ({self.name} trains its own weights; "
                f"{precision.quantization.scheme} weights take no gradient)"
            )
        from matrix.precisions.quantization import skip_reason

        return skip_reason()

    def check_variant(self, variant: Variant) -> None:
        """Raise InvalidVariant for settings this kind cannot be built with or fed."""
        check_common(variant)
        if variant.seq_len > MAX_POSITIONS:
            raise InvalidVariant(f"seq_len {variant.seq_len} exceeds max_position_embeddings {MAX_POSITIONS}")

    @abc.abstractmethod
    def create(self) -> nn.Module:
        """A freshly initialised fp32 model on the CPU (called under a fixed seed)."""

    def initialise(self) -> nn.Module:
        """The same fp32 weights every time."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)
            return self.create()

    def build(self, precision: Precision, device: torch.device, workdir: Path) -> nn.Module:
        """The model in the precision's weights dtype, obtained the way the precision says."""
        self.require(precision)
        if precision.weights_from == "load":
            directory = self.pretrained(workdir)
            if precision.quantization is not None:
                return self.load_quantized(directory, precision, device)
            return self.load_weights(directory, precision.weights_dtype, device)
        model = self.initialise().to(device=device)
        if any(p.dtype != precision.weights_dtype for p in model.parameters()):
            # a cast, as users cast; not where the weights already have the dtype: .to(float32)
            # would also cast a buffer the class creates in another dtype on purpose
            # (RecurrentGemma's bf16 normalizer), which from_pretrained then gives back as created
            model = model.to(dtype=precision.weights_dtype)
        return model

    def pretrained(self, workdir: Path) -> Path:
        """The kind's fp32 weights as a pretrained checkpoint under `workdir`, which a *-loaded-*
        build reads: written by save() where it is not there yet."""
        directory = workdir / PRETRAINED_FP32
        if not directory.exists():
            directory.mkdir(parents=True)
            self.save(self.initialise(), directory)
        return directory

    def load(self, directory: Path, precision: Precision, device: torch.device, workdir: Path) -> nn.Module:
        """A fresh model from a checkpoint written by save(), in the precision's dtype."""
        return self.load_weights(directory, precision.weights_dtype, device)

    @abc.abstractmethod
    def batch(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The fixed batch every step and every evaluation runs on."""

    def loss_items(self, batch: dict[str, torch.Tensor]) -> int:
        """How many items loss() averages over in `batch` (some rows of the fixed batch, when
        the distributed engines split it across ranks): by the rule observed on the kind's own
        loss (matrix/models/observation.py: next-token labels, labels, attention mask or rows)."""
        from matrix.models.observation import observe

        return observe(self).count(batch)

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward pass and scalar training loss."""

    @abc.abstractmethod
    def evaluate(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> EvalOutput:
        """What an evaluation loop computes (the caller sets eval mode, no_grad, autocast)."""

    @abc.abstractmethod
    def save(self, model: nn.Module, directory: Path) -> None:
        """Write a checkpoint with the library's own API, as safetensors."""

    @abc.abstractmethod
    def load_weights(self, directory: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """The library's own loading API (from_pretrained(dtype=...) and the like)."""

    # A quantizable kind (quantizable = True) builds its adapters over the base build() gets from
    # load_quantized(), and load() puts saved adapters over a base loaded so again. The saves a
    # quantized cell also checks (round_trips.check_quantized_saves) have peft's defaults below.

    def load_quantized(self, directory: Path, precision: Precision, device: torch.device) -> nn.Module:
        """The library's loading API with the precision's quantization (from_pretrained(...,
        quantization_config=...)); with precision.quantization None, a checkpoint saved
        quantized (its config carries the quantization)."""
        raise NotImplementedError(f"{self.name} has no quantized loading")

    def save_quantized_base(self, model: nn.Module, directory: Path) -> None:
        """The quantized base alone, as pre-quantized checkpoints are shared: save_pretrained of
        the model without its adapters (peft's unload() takes them out; `model` is spent)."""
        model.unload().save_pretrained(directory)

    def load_over_quantized_base(self, base: Path, adapters: Path, precision: Precision, device, workdir) -> nn.Module:
        """A base saved quantized, read back, prepared as build() prepares one, the adapters on top."""
        from dataclasses import replace

        from peft import PeftModel

        from matrix.precisions.quantization import prepare_for_training

        local_directory(adapters)
        model = self.load_quantized(base, replace(precision, quantization=None), device)
        model = prepare_for_training(model, precision.quantization)
        return PeftModel.from_pretrained(model, adapters, is_trainable=True, local_files_only=True)

    def merge_quantized(self, model: nn.Module) -> nn.Module:
        """The adapters merged into the quantized base (peft's merge_and_unload)."""
        return model.merge_and_unload()

    def save_merged(self, merged: nn.Module, directory: Path) -> None:
        merged.save_pretrained(directory)

    def load_merged(self, directory: Path, precision: Precision, device) -> nn.Module:
        from dataclasses import replace

        return self.load_quantized(directory, replace(precision, quantization=None), device)

    def loaded_in_dtype(self, precision: Precision, reloaded: bool) -> bool:
        """Whether the model build() gives (or, `reloaded`, the one load() gives) comes from the
        library's loading API asked for the precision's dtype (from_pretrained(dtype=...)),
        which keeps the modules an architecture declares fp32 in fp32, rather than from a cast,
        which does not (matrix/models/declared_dtypes.py). load() goes through load_weights()."""
        return reloaded or precision.weights_from == "load"

    def precision_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Parameters that must be in the precision's weights dtype (all of them, by default)."""
        return dict(model.named_parameters())


MODELS: Registry[ModelKind] = Registry("model kind", ModelKind)
register = MODELS.register
