"""hf:<model_type> and hf:<path>: any transformers architecture as a model kind, with no code.

`--model hf:qwen2` builds Qwen2ForCausalLM from a tiny config made out of Qwen2Config's own
defaults by the shrinking rules (matrix/models/hf_shrink.py, its rules in hf_shrink_rules.toml).
`--model hf:path/to/config.json` (or a folder holding one) builds the user's own config as it
is; a folder that also holds weights is loaded with from_pretrained, as users load it. The class
is the one the config's `architectures` names when that is a causal LM or a sequence
classifier, else transformers' causal-LM class for its model type.

The kinds are made on demand (matrix/grid/registry.py provide): the first lookup of such a name
builds the kind, in the process that asked (the runner, pytest, a rank, a repro command).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch

from matrix.grid import packages
from matrix.grid.variants import InvalidVariant, Variant
from matrix.models import base
from matrix.models.causal_lm import CausalLMKind
from matrix.models.hf import dtype_argument, transformers

PREFIX = "hf:"
GENERATE_TOKENS = 4  # generate() in evaluation adds this many, where the architecture has a cache
# what an hf: kind varies in exploration: the batch and the loop. Its sizes are the shrinking
# rules' (a model type) or the user's own (a path).
HF_FIELDS = (*base.ModelKind.variant_fields, "dropout", "use_cache_in_eval", "grad_accumulation", "eval_grad_mode")
PATH_FIELDS = (*base.ModelKind.variant_fields, "use_cache_in_eval", "grad_accumulation", "eval_grad_mode")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
NUM_LABELS = 3  # a sequence classifier's head, when the user's config does not say


def auto_mapping(name: str) -> dict:
    """transformers' model_type -> class-name mapping `name` (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)."""
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, name)


def causal_lm_class_name(model_type: str) -> str | None:
    return auto_mapping("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES").get(model_type)


def task_of(class_name: str) -> str | None:
    """The task ("causal-lm", "sequence-classification") transformers maps a class name to."""
    for task, mapping in (
        ("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
        ("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    ):
        names = auto_mapping(mapping).values()
        if any(class_name == n or (isinstance(n, tuple) and class_name in n) for n in names):
            return task
    return None


class HfArchitecture(CausalLMKind):
    """One transformers architecture: its class, its config (tiny from a model type, or the
    user's), the fixed batch of the causal-LM kinds (or per-row labels for a classifier)."""

    axis_position = 50  # after the built-in kinds, before a plugin's
    model_class_name = config_class_name = ""  # set per instance

    def __init__(self, name: str, model_type: str | None = None, path: Path | None = None) -> None:
        from matrix.models.hf_shrink import Unsupported

        self.name, self.model_type, self.path = name, model_type, path
        self.unsupported: str | None = None  # why the shrinking rules cannot build it (a skip)
        try:
            config = self.config()
        except Unsupported as why:
            self.unsupported = str(why)
            config = None
        if config is not None:
            self.model_type = config.model_type
        architectures = [a for a in (getattr(config, "architectures", None) or []) if task_of(a)]
        class_name = architectures[0] if architectures else causal_lm_class_name(self.model_type)
        if class_name is None or not hasattr(transformers(), class_name):
            raise KeyError(
                f"transformers {transformers().__version__} has no causal-LM or sequence-classification class for "
                f"model type {self.model_type!r}"
            )
        self.model_class_name = class_name
        self.config_class_name = type(self.config()).__name__ if config is not None else ""
        self.task = task_of(class_name)
        self.has_weights = path is not None and any((path / f).is_file() for f in WEIGHT_FILES)
        self.description = f"transformers {class_name}, " + (
            f"the config (and weights) in {path}" if path else "tiny config shrunk from its defaults"
        )
        self.variant_fields = PATH_FIELDS if path else HF_FIELDS
        self.explorable = self.task == "causal-lm"
        has_cache = getattr(config, "use_cache", False)
        self.generate_tokens = GENERATE_TOKENS if self.task == "causal-lm" and has_cache else 0
        self.grid_variant = Variant(padding="left", use_cache_in_eval=bool(self.generate_tokens))

    @property
    def model_class(self) -> type:
        return getattr(transformers(), self.model_class_name)

    @property
    def config_class(self) -> type:
        return getattr(transformers(), self.config_class_name)

    # ---------------------------------------------------------------- the config

    def config(self):
        """The config the model class takes, a fresh copy each time (a model's constructor may
        write to its config). A composite config (llama4, mllama, qwen3_5, ...) whose causal-LM
        class takes its text sub-config gives that, as AutoModelForCausalLM.from_config does."""
        config = copy.deepcopy(self._config(self.variant))
        if self.model_class_name and not isinstance(config, self.model_class.config_class):
            text = config.get_text_config()
            if isinstance(text, self.model_class.config_class):
                return text
        return config

    def _config(self, variant: Variant):
        made = self.__dict__.setdefault("_configs", {})
        if variant not in made:
            if self.path is not None:
                made[variant] = user_config(self.path)
            else:
                from matrix.models.hf_shrink import tiny_config

                made[variant] = tiny_config(self.model_type, variant)  # Unsupported: why it cannot be
        return made[variant]

    def config_kwargs(self) -> dict:
        """The config as keyword arguments of its class (what a repro script writes out): what differs
        from the class's defaults, a sub-config (DBRX's attn_config) likewise. Its to_dict() would carry
        every attribute a config has, which an older release's sub-config class refuses
        (transformers 5.0.0's DbrxAttentionConfig: "Found unknown kwargs")."""
        config = self.config()
        kwargs = config.to_diff_dict()
        for name, value in vars(config).items():
            if name in kwargs and hasattr(value, "to_diff_dict"):
                kwargs[name] = {k: v for k, v in value.to_diff_dict().items() if k != "transformers_version"}
        return kwargs

    def check_variant(self, variant: Variant) -> None:
        base.ModelKind.check_variant(self, variant)
        if variant.seq_len + self.generate_tokens > self.positions():
            raise InvalidVariant(f"seq_len {variant.seq_len} + generated tokens exceed {self.positions()} positions")
        if self.task == "causal-lm" and variant.seq_len < 2:
            raise InvalidVariant("a causal LM loss needs a row of at least two tokens")

    def positions(self) -> int:
        if self.unsupported:
            return base.MAX_POSITIONS
        config = self.config()
        found = getattr(config.get_text_config(), "max_position_embeddings", None)
        return min(found, base.MAX_POSITIONS) if isinstance(found, int) else base.MAX_POSITIONS

    def skip_reason(self, device: str) -> str | None:
        if self.unsupported:
            rules = "matrix/models/hf_shrink_rules.toml"
            return f"Requires: [a tiny {self.model_type} config] ({rules}: {self.unsupported})"
        vocab = getattr(self.config().get_text_config(), "vocab_size", None)
        if isinstance(vocab, int) and vocab < base.VOCAB_SIZE:
            return f"Requires: [a vocabulary of at least {base.VOCAB_SIZE} tokens] ({self.name} has {vocab})"
        return None

    # ---------------------------------------------------------------- building

    @property
    def auto_class(self) -> type:
        """What users load a checkpoint with: AutoModelForCausalLM (AutoModelForSequenceClassification).
        It reads the architecture's own config class; a concrete class that several model types
        share (exaone, sarvam_moe -> LlamaForCausalLM, Glm4MoeForCausalLM) reads its own instead,
        and such a model, saved again, names its weights for one type and its config for the other
        (transformers 5.24.0): the next load initialises every weight anew."""
        name = "AutoModelForCausalLM" if self.task == "causal-lm" else "AutoModelForSequenceClassification"
        return getattr(transformers(), name)

    def create(self):
        if self.has_weights:
            return self.loader.from_pretrained(self.path, local_files_only=True, **{dtype_argument(): torch.float32})
        return self.model_class(self.config())

    @property
    def loader(self) -> type:
        """The auto class where it maps the model's config class (a composite's text sub-config,
        Emu3TextConfig, MllamaTextConfig, is not mapped: its class itself then)."""
        auto = self.auto_class
        return auto if self.config_class in auto._model_mapping else self.model_class

    def load_weights(self, directory: Path, dtype: torch.dtype, device: torch.device):
        directory = base.local_directory(directory)  # never a Hub repository id
        return self.loader.from_pretrained(directory, local_files_only=True, **{dtype_argument(): dtype}).to(device)

    def batch(self, device):
        found = super().batch(device)
        if self.task == "sequence-classification":
            rows = found["input_ids"].shape[0]
            found["labels"] = (torch.arange(rows) % self.num_labels()).to(device)
        return found

    def num_labels(self) -> int:
        return self.config().num_labels

    def loss(self, model, batch):
        if self.task == "sequence-classification":
            return model(**batch).loss
        return super().loss(model, batch)

    def evaluate(self, model, batch):
        if self.task == "sequence-classification":
            out = model(**batch)
            return base.EvalOutput(loss=out.loss, logits=out.logits)
        return super().evaluate(model, batch)

    def standalone_code(self) -> str:
        if self.task != "causal-lm":
            return base.ModelKind.standalone_code(self)
        return super().standalone_code()


@functools.cache
def user_config(path: Path):
    """The config a user's config.json (or model folder) holds, read as from_pretrained reads it,
    offline; a classifier with no pad token gets the batch's (0), as a user's tokenizer gives it."""
    config = transformers().AutoConfig.from_pretrained(path, local_files_only=True)
    architectures = [a for a in (getattr(config, "architectures", None) or []) if task_of(a)]
    if architectures and task_of(architectures[0]) == "sequence-classification":
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = base.PAD_TOKEN_ID
        if "num_labels" not in config.to_diff_dict() and "id2label" not in config.to_diff_dict():
            config.num_labels = NUM_LABELS
    return config


def make(name: str) -> HfArchitecture:
    """The registry's factory for hf:<model_type> and hf:<path> (KeyError: why it cannot be)."""
    spec = name[len(PREFIX) :]
    if not spec:
        raise KeyError("hf: names a model type (hf:qwen2) or a config.json / model folder (hf:path/to/model)")
    absent = packages.skip_reason(HfArchitecture.requires)
    if absent:
        raise KeyError(f"{absent}: the hf: kinds are transformers' own classes")
    looks_like_path = "/" in spec or spec.endswith(".json") or spec.startswith(".")
    if looks_like_path:
        path = Path(spec).expanduser()
        folder = path.parent if path.is_file() else path
        if not (folder / "config.json").is_file():
            raise KeyError(f"{spec}: no config.json there")
        if path.is_file() and path.name != "config.json":
            raise KeyError(f"{spec}: a path names a config.json or the folder that holds one")
        return HfArchitecture(name, path=folder.resolve())
    if causal_lm_class_name(spec) is None:
        raise KeyError(
            f"transformers {transformers().__version__} has no causal-LM model type {spec!r} "
            f"(its model types: transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)"
        )
    return HfArchitecture(name, model_type=spec)


def every_causal_lm() -> tuple[str, ...]:
    """hf:<model_type> for every causal-LM model type of the installed transformers (a pattern such
    as hf:* without transformers: a usage error naming it)."""
    absent = packages.skip_reason(HfArchitecture.requires)
    if absent:
        from matrix.grid.cell import SelectionError

        raise SelectionError(f"--model: {absent}: the hf: kinds are transformers' own classes")
    from matrix.models.hf_shrink import causal_lm_types

    return tuple(PREFIX + model_type for model_type in causal_lm_types())


base.MODELS.provide(PREFIX, make, every=every_causal_lm)
