"""What the harness sees on a model kind's own model, instead of asking the kind to declare it.

A user writes a kind with six methods (create, batch, loss, evaluate, save, load_weights) and
nothing else. What the catalogue's trait selectors, the distributed engines and the reports
need to know about it is observed on the built model, once per kind (and variant) and process,
on the CPU in fp32:

- which parameters train: all of them (trait `full-weights`) or a strict subset (`adapters`);
- nn.LayerNorm modules (`layer-norm`);
- the Linear layers float8's conversion would swap (matrix/precisions/float8.py's filter): none at all
  (`no-float8-layers`: GPT-2's projections are Conv1D);
- the mode the model is built in: eval mode, as from_pretrained() returns a model, from
  create() (`from-pretrained`) or, for the *-loaded-* precisions, from the kind's checkpoint
  read back with load_weights() (`loaded-from-pretrained`); and where the model came from;
- dropout: whether two training forwards with different random numbers give different losses
  (`dropout`; module dropout and functional dropout alike), and the dropout modules with p > 0;
- whether its input embeddings sit inside a module the model lists in `_no_split_modules`
  (BERT's BertEmbeddings), which a wrapper that shards those modules shards with them
  (`embeddings-in-no-split-module`); and the classes `_no_split_modules` names of which the model
  holds none (`no-split-module-absent`), which an auto-wrap policy built from the list looks for;
- whether the output embeddings' bias is the same parameter as another module's (`tied-output-bias`:
  BERT-style heads, cls.predictions.decoder.bias is cls.predictions.bias), and whether two layers of
  its layer stack hold one parameter (`parameters-tied-across-layers`: Zamba's shared transformer block);
- the modules holding parameters that a forward calls a different number of times on each rank's
  share of the batch (`module-calls-vary-across-ranks`: DBRX's experts, one call per expert reached),
  and those a training step runs without autograd in its forward and again in its backward
  (`forward-recomputed-in-backward`: Reformer's reversible layers);
- the trainable parameters its class keeps in fp32 when loaded in bf16 or fp16 (`fp32-parameters-in-bf16-loads`,
  `fp32-parameters-in-fp16-loads`, either: `fp32-parameters-in-half-loads`; DeepseekV2's router gate.weight,
  declared; HunYuan MoE's router, created in fp32 by its __init__), which leave a layer holding two dtypes;
- a transformers class whose forward takes **kwargs but whose loss ignores num_items_in_batch
  (`ignores-num-items-in-batch`: MBartForCausalLM), which the Trainer scales for all the same;
  and one whose loss divides by the num_items_in_batch it is given while it averages over
  next-token labels when given none (`next-token-loss-takes-num-items`: LlamaForCausalLM), which
  a Trainer counting every label, the shifted-off first ones too, makes smaller;
- trainable parameters the training forward never uses, left without a gradient by the fp32
  backward (`unused-parameters`: MBartForCausalLM's cross-attention), which DDP's reducer waits for;
- whether it is a transformers model whose class name names no loss type (`loss_type` None:
  GPT2LMHeadModel), so transformers falls back to its default causal LM loss
  (`unmapped-loss-type`);
- which items loss() averages over: the rule whose per-row counts, weighting the losses of the
  batch's rows one at a time, give back the whole batch's loss (ModelKind.loss_items).

A kind may still declare its traits (ModelKind.traits, not None): then they replace the
observed ones in catalogue selection, and the report records both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from matrix.precisions import float8

IGNORE_INDEX = -100  # the label torch's cross entropy (and so transformers' losses) skips

# How a loss may average over a batch: rule name -> items per row. Tried in this order; the
# first whose weighting reproduces the batch's loss is the kind's. Where several do, their
# counts are proportional on this batch and any of them weighs every subset of rows alike.
LOSS_ITEM_RULES = {
    "next-token labels": lambda batch: (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1),
    "labels": lambda batch: (batch["labels"] != IGNORE_INDEX).reshape(len(batch["labels"]), -1).sum(dim=1),
    "attention mask": lambda batch: batch["attention_mask"].reshape(len(batch["attention_mask"]), -1).sum(dim=1),
    "rows": lambda batch: torch.ones(len(next(iter(batch.values()))), dtype=torch.long),
}
# |weighted mean of the row losses - batch loss| <= this * |batch loss|: fp32 rounding of a
# per-row against a batched forward, far below what another weighting changes
LOSS_ITEMS_RTOL = 1e-4
DROPOUT_PROBE_SEEDS = (1, 2)


@dataclass(frozen=True)
class Observation:
    kind: str
    parameters: int = 0
    trainable_parameters: int = 0
    layer_norm_modules: int = 0
    float8_layers: int | None = None  # Linear layers float8's filter converts (matrix/precisions/float8.py)
    # frozen nn.Linear layers with a bias (Qwen2's q/k/v projections in a peft base): a quantized
    # base replaces their weight and keeps the bias a plain float parameter
    frozen_linear_biases: int = 0
    dropout_modules: tuple[str, ...] = ()  # "name (p=0.1)", modules with p > 0
    stochastic_training_forward: bool = False
    created_in_eval_mode: bool = False
    loaded_in_eval_mode: bool | None = None
    origin: str | None = None  # "from_pretrained(<name or path>)" where transformers says so
    embeddings_in_no_split_module: str | None = None  # the enclosing module's class, if any
    # classes `_no_split_modules` names that the model holds no module of (a decoder-only class that
    # inherits an encoder-decoder family's list: MBartForCausalLM's MBartEncoderLayer)
    no_split_modules_absent: tuple[str, ...] = ()
    # the names the output embeddings' bias is registered under besides its own (BERT-style heads:
    # cls.predictions.decoder.bias is cls.predictions.bias), empty where it is not tied
    tied_output_bias: tuple[str, ...] = ()
    # trainable parameters the class keeps in fp32 when from_pretrained loads it in bf16 or fp16
    # (_keep_in_fp32_modules(_strict): DeepseekV2's router gate.weight), next to half ones
    fp32_in_bf16_loads: tuple[str, ...] = ()
    fp32_in_fp16_loads: tuple[str, ...] = ()  # _keep_in_fp32_modules holds for fp16 loads only
    # the transformers class whose forward takes **kwargs, so the Trainer hands it num_items_in_batch
    # and scales its loss for it, but whose loss does not change with it (MBartForCausalLM's own
    # CrossEntropyLoss): under data parallelism the Trainer multiplies a mean by the world size
    ignores_num_items: str | None = None
    # the transformers class whose forward takes **kwargs and whose loss changes with the
    # num_items_in_batch it is given (ForCausalLMLoss divides its sum by it): the Trainer's count
    # becomes the loss's denominator
    takes_num_items: str | None = None
    unmapped_loss_type: str | None = None  # the transformers class whose loss_type is None
    # submodules that are the very object another instance of the kind holds (XLM's feed-forward
    # activation: transformers' module-level `gelu`): a library that registers a model's modules
    # (DeepSpeed ZeRO-3's ds_id and hooks) registers them again for a second model in the process
    shared_across_instances: tuple[str, ...] = ()
    # parameters that different entries of one ModuleList (the layer stack) hold as the same tensor
    # (Zamba's shared transformer block, tied into every hybrid layer): a wrapper that shards each
    # layer on its own finds one tensor in two of its groups
    tied_across_layers: tuple[str, ...] = ()
    # modules holding parameters that the forward calls a different number of times on the ranks'
    # shares of the batch (DBRX's experts call their one `mlp` once per expert the share's tokens
    # reach): DeepSpeed ZeRO-3 gathers a module's parameters at each call, so the ranks' gathers
    # no longer pair up
    calls_vary_across_shares: tuple[str, ...] = ()
    # modules holding parameters that a training step runs without autograd in its forward and again
    # in its backward (Reformer's reversible layers): FSDP2 gathers a layer's parameters for the
    # backward from a hook on its forward outputs, which these outputs do not carry
    recomputed_in_backward: tuple[str, ...] = ()
    # floating-point buffers left out of the state dict (RoPE's inv_freq) that the kind's loader,
    # asked for bf16, makes in another dtype: a cast rounds them, a reload does not
    unsaved_float_buffers: tuple[str, ...] = ()
    # state-dict entries the kind's save writes under no name of their own (transformers 5 writes
    # MoE experts per expert and renames modules, as the Hub checkpoint has them; tied weights
    # count as written): what a loader other than from_pretrained (the Trainer's resume, a plain
    # load_state_dict) does not find
    saved_in_another_layout: tuple[str, ...] = ()
    # a model cast to half and saved comes back through the library's loader (from_pretrained),
    # not the way it was obtained (ModelKind.loaded_in_dtype): what recomputes those buffers
    reloaded_by_library: bool = False
    # trainable parameters that an fp32 training backward leaves without a gradient or with an
    # all-zero one: no precision can make them learn
    gradless_parameters: tuple[str, ...] = ()
    # those of them the training forward never reaches (no gradient at all, not a zero one):
    # MBartForCausalLM's cross-attention, which a decoder without an encoder never calls
    unused_parameters: tuple[str, ...] = ()
    # parameters the model is created with requires_grad=False (a peft base: all of it), and
    # those of them the kind's loader gives back trainable
    frozen_parameters: tuple[str, ...] = ()
    thawed_by_loading: tuple[str, ...] = ()
    # the largest median |weight| of a trainable tensor (norm weights near 1.0): where an update of
    # about the learning rate is below half a bf16 ulp of it (kind_traits.bf16_stalled_tensors)
    largest_trainable_magnitude: float = 0.0
    loss_items: str = "rows"
    loss_items_evidence: dict = field(default_factory=dict)  # rule -> relative error, or why not
    error: str | None = None  # observation itself failed: the message, and traits are declared only

    @property
    def fp32_in_half_loads(self) -> tuple[str, ...]:
        """The trainable parameters a bf16 or an fp16 load leaves in fp32."""
        return tuple(dict.fromkeys(self.fp32_in_bf16_loads + self.fp32_in_fp16_loads))

    @property
    def traits(self) -> frozenset[str]:
        found = set()
        if self.trainable_parameters and 2 * self.trainable_parameters >= self.parameters:
            found.add("full-weights")
            if self.thawed_by_loading:
                found.add("frozen-parameters")
        elif self.trainable_parameters:
            found.add("adapters")
        if self.layer_norm_modules:
            found.add("layer-norm")
        if self.float8_layers == 0:
            found.add("no-float8-layers")
        if self.frozen_linear_biases:
            found.add("frozen-linear-bias")
        if self.created_in_eval_mode:
            found.add("from-pretrained")
        if self.loaded_in_eval_mode:
            found.add("loaded-from-pretrained")
        if self.stochastic_training_forward:
            found.add("dropout")
        if self.embeddings_in_no_split_module:
            found.add("embeddings-in-no-split-module")
        if self.unused_parameters:
            found.add("unused-parameters")
        if self.no_split_modules_absent:
            found.add("no-split-module-absent")
        if self.tied_output_bias:
            found.add("tied-output-bias")
        if self.fp32_in_bf16_loads:
            found.add("fp32-parameters-in-bf16-loads")
        if self.fp32_in_fp16_loads:
            found.add("fp32-parameters-in-fp16-loads")
        if self.fp32_in_half_loads:
            found.add("fp32-parameters-in-half-loads")
        if self.ignores_num_items:
            found.add("ignores-num-items-in-batch")
        if self.takes_num_items and self.loss_items == "next-token labels":
            found.add("next-token-loss-takes-num-items")
        if self.unmapped_loss_type and self.loss_items == "next-token labels":
            found.add("unmapped-loss-type")
        if self.unsaved_float_buffers and self.reloaded_by_library:
            found.add("unsaved-float-buffers")
        if self.saved_in_another_layout:
            found.add("saved-in-another-layout")
        if self.shared_across_instances:
            found.add("module-shared-across-instances")
        if self.tied_across_layers:
            found.add("parameters-tied-across-layers")
        if self.calls_vary_across_shares:
            found.add("module-calls-vary-across-ranks")
        if self.recomputed_in_backward:
            found.add("forward-recomputed-in-backward")
        return frozenset(found)

    def count(self, batch: dict) -> int:
        """How many items the kind's loss averages over in `batch` (the whole batch or a shard)."""
        return int(LOSS_ITEM_RULES[self.loss_items](batch).sum())

    def as_dict(self) -> dict:
        return {
            "traits": sorted(self.traits),
            "parameters": self.parameters,
            "trainable_parameters": self.trainable_parameters,
            "layer_norm_modules": self.layer_norm_modules,
            "float8_layers": self.float8_layers,
            "frozen_linear_biases": self.frozen_linear_biases,
            "dropout_modules": list(self.dropout_modules),
            "stochastic_training_forward": self.stochastic_training_forward,
            "created_in_eval_mode": self.created_in_eval_mode,
            "loaded_in_eval_mode": self.loaded_in_eval_mode,
            "origin": self.origin,
            "embeddings_in_no_split_module": self.embeddings_in_no_split_module,
            "no_split_modules_absent": list(self.no_split_modules_absent),
            "tied_output_bias": list(self.tied_output_bias),
            "fp32_in_half_loads": len(self.fp32_in_half_loads),
            "fp32_in_bf16_loads": len(self.fp32_in_bf16_loads),
            "fp32_in_fp16_loads": len(self.fp32_in_fp16_loads),
            "ignores_num_items": self.ignores_num_items,
            "takes_num_items": self.takes_num_items,
            "fp32_in_half_loads_first": list(self.fp32_in_half_loads[:5]),
            "unmapped_loss_type": self.unmapped_loss_type,
            "unsaved_float_buffers": list(self.unsaved_float_buffers),
            "saved_in_another_layout": list(self.saved_in_another_layout),
            "shared_across_instances": list(self.shared_across_instances),
            "tied_across_layers": list(self.tied_across_layers[:5]),
            "calls_vary_across_shares": list(self.calls_vary_across_shares[:5]),
            "recomputed_in_backward": list(self.recomputed_in_backward[:5]),
            "reloaded_by_library": self.reloaded_by_library,
            "gradless_parameters": list(self.gradless_parameters),
            "unused_parameters": len(self.unused_parameters),
            "unused_parameters_first": list(self.unused_parameters[:5]),
            "frozen_parameters": len(self.frozen_parameters),
            "frozen_parameters_first": list(self.frozen_parameters[:5]),
            "thawed_by_loading": list(self.thawed_by_loading),
            "largest_trainable_magnitude": self.largest_trainable_magnitude,
            "loss_items": self.loss_items,
            "loss_items_evidence": self.loss_items_evidence,
            "error": self.error,
        }


_OBSERVED: dict[tuple, Observation] = {}


def _key(kind) -> tuple:
    return (kind.name, type(kind), kind.variant)


def observe(kind) -> Observation:
    """The kind's observation, made once per kind, variant and process."""
    if _key(kind) not in _OBSERVED:
        # whatever the caller's grad mode (a first ask may come from inside an evaluation's
        # no_grad): the observation's backward needs gradients, and without them it would fail
        # and leave the kind with its declared traits and the "rows" weighting only
        with torch.enable_grad(), torch.inference_mode(False):
            _OBSERVED[_key(kind)] = _observe(kind)
    return _OBSERVED[_key(kind)]


def remember(kind, observation: Observation) -> None:
    """Take another process's observation of the kind as this one's (a rank's, from its driver)."""
    _OBSERVED[_key(kind)] = observation


def effective_traits(kind) -> frozenset[str]:
    """What catalogue selectors match: the kind's declared traits where it declares them, else
    the observed ones."""
    declared = getattr(kind, "traits", None)
    return frozenset(declared) if declared is not None else observe(kind).traits


def _origin(model: nn.Module) -> str | None:
    for module in model.modules():
        name = getattr(getattr(module, "config", None), "_name_or_path", None)
        if name:
            return f"from_pretrained({name})"
    return None


def _no_split_module_around_embeddings(model: nn.Module) -> str | None:
    """The class of a module listed in the model's `_no_split_modules` that holds its input
    embeddings (transformers' get_input_embeddings()), or None."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if no_split and callable(get_embeddings) else None
    if embeddings is None:
        return None
    for module in model.modules():
        if type(module).__name__ in no_split and module is not embeddings:
            if any(inner is embeddings for inner in module.modules()):
                return type(module).__name__
    return None


def _no_split_modules_absent(model: nn.Module) -> tuple[str, ...]:
    """The classes the model's `_no_split_modules` names of which it holds no module."""
    held = {type(module).__name__ for module in model.modules()}
    return tuple(sorted(set(getattr(model, "_no_split_modules", None) or ()) - held))


def _tied_output_bias(model: nn.Module) -> tuple[str, ...]:
    """Every name the output embeddings' bias is registered under, where there are two or more."""
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    bias = getattr(output, "bias", None)
    if not isinstance(bias, nn.Parameter):
        return ()
    names = tuple(n for n, p in model.named_parameters(remove_duplicate=False) if p is bias)
    return names if len(names) > 1 else ()


def _fp32_in_half_loads(model: nn.Module, dtype: torch.dtype) -> tuple[str, ...]:
    """The trainable parameters a from_pretrained in `dtype` (bf16 or fp16) leaves in fp32: those the
    class declares (_keep_in_fp32_modules_strict for both, _keep_in_fp32_modules for fp16 only:
    DeepseekV2's router gate.weight, GPT-OSS's norms in fp16) and those its __init__ creates in fp32
    whatever the dtype, whose created dtype the loader keeps (HunYuan MoE's router gate.wg.weight,
    OLMo hybrid's A_log, XLNet's attention weights)."""
    from matrix.models.declared_dtypes import created_fp32, fp32_patterns, fp32_reason

    patterns, created = fp32_patterns(model, dtype), created_fp32(model, dtype)
    if not (patterns or created):
        return ()
    return tuple(n for n, p in model.named_parameters() if p.requires_grad and fp32_reason(n, patterns, created))


def _unmapped_loss_type(model: nn.Module) -> str | None:
    """The class of the transformers model inside `model` (a peft wrapper's base too) whose
    `loss_type` is None: PreTrainedModel sets it from its class name, and GPT2LMHeadModel's names
    none of transformers' losses."""
    for module in model.modules():
        if hasattr(module, "loss_type") and hasattr(module, "config"):
            return type(module).__name__ if module.loss_type is None else None
    return None


def _num_items_effect(model: nn.Module, batch: dict) -> tuple[str, bool] | None:
    """The transformers class inside `model` whose forward takes **kwargs (the Trainer then passes
    it num_items_in_batch, and multiplies its loss by the number of processes), and whether its
    loss with num_items_in_batch=1 is the same as without (it averages by itself: True) or not (it
    divides by the count it is given: False). None where the forward takes no **kwargs, the class
    says it accepts no loss kwargs, or the model is no such class."""
    import inspect

    target = next((m for m in model.modules() if hasattr(m, "loss_type") and hasattr(m, "config")), None)
    if target is None or "labels" not in batch or getattr(target, "accepts_loss_kwargs", True) is False:
        return None
    parameters = inspect.signature(target.forward).parameters.values()
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            plain = model(**batch).loss
            given = model(**batch, num_items_in_batch=torch.tensor(1)).loss
    except (TypeError, ValueError, AttributeError):  # a forward that takes no such call: not this trait
        return None
    finally:
        model.train(was_training)
    return None if plain is None else (type(target).__name__, torch.equal(plain, given))


@contextlib.contextmanager
def _module_calls(model: nn.Module, seen):
    """While inside: seen(name) at each call of a module that holds parameters of its own (the
    modules whose parameters a sharding library gathers on a call); yields their names in order."""
    owners = {
        name: module
        for name, module in model.named_modules()
        if next(module.parameters(recurse=False), None) is not None
    }
    hooks = [module.register_forward_pre_hook(lambda _m, _a, name=name: seen(name)) for name, module in owners.items()]
    try:
        yield list(owners)
    finally:
        for hook in hooks:
            hook.remove()


def _calls_vary_across_shares(kind, model: nn.Module, batch: dict) -> tuple[str, ...]:
    """The modules owning parameters that an eval forward calls a different number of times on
    two ranks' shares of the batch, split as the distributed engines split it (matrix/harness/group.py):
    two shares whose counts differ show a count that follows the rows, whatever the world size."""
    from collections import Counter

    shares = [{key: torch.tensor_split(value, 2)[rank] for key, value in batch.items()} for rank in range(2)]
    if any(len(next(iter(share.values()))) == 0 for share in shares):
        return ()  # a rank without rows: the engines' own concern, not a module's
    calls = []
    for share in shares:
        counted = Counter()
        with _module_calls(model, lambda name, counted=counted: counted.update([name])) as owners, torch.no_grad():
            kind.loss(model, share)
        calls.append(counted)
    return tuple(name for name in owners if len({counted[name] for counted in calls}) > 1)


def _tied_across_layers(model: nn.Module) -> tuple[str, ...]:
    """The second name of each parameter that two different entries of one ModuleList hold as the
    same tensor (Zamba's shared_transf, in every hybrid layer). A tie within one entry, or between
    the embeddings and the output layer, is not one."""
    stacks = [name for name, module in model.named_modules() if isinstance(module, nn.ModuleList)]
    names_of: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(parameter), []).append(name)
    found = []
    for names in names_of.values():
        for stack in stacks if len(names) > 1 else ():
            entries = {n[len(stack) + 1 :].split(".", 1)[0] for n in names if n.startswith(stack + ".")}
            if len(entries) > 1:
                found.append(names[1])
                break
    return tuple(found)


def _shared_across_instances(model: nn.Module, other: nn.Module) -> tuple[str, ...]:
    """The submodules of `model` that are the very objects `other` (another instance of the kind,
    built in the same process) holds: a module made once at import and assigned to every model."""
    others = {id(module) for module in other.modules()}
    return tuple(name for name, module in model.named_modules() if name and id(module) in others)


def _unsaved_float_buffers(model: nn.Module) -> tuple[str, ...]:
    """Floating-point buffers registered with persistent=False (left out of the state dict)."""
    found = []
    for prefix, module in model.named_modules():
        for name in sorted(getattr(module, "_non_persistent_buffers_set", ())):
            buffer = module._buffers.get(name)
            if buffer is not None and buffer.is_floating_point():
                found.append(f"{prefix}.{name}" if prefix else name)
    return tuple(found)


def _gradless_parameters(kind, model: nn.Module, batch: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Trainable parameters with no gradient, or an all-zero one, after one fp32 training backward
    (RoCBert's shape and pronunciation embeddings, looked up at their padding index 0 when the
    batch gives no ids for them): only weight decay moves them, in no precision by learning. And
    those with no gradient at all: the forward never used them (DDP's reducer waits for them)."""
    model.zero_grad(set_to_none=True)
    kind.loss(model, batch).backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    found = tuple(n for n, p in trainable if p.grad is None or not p.grad.any())
    unused = tuple(n for n, p in trainable if p.grad is None)
    model.zero_grad(set_to_none=True)
    return found, unused


def _recomputed_in_backward(kind, model: nn.Module, batch: dict) -> tuple[str, ...]:
    """The modules holding parameters that one fp32 training step runs with autograd off in its
    forward and again in its backward (Reformer's reversible layers: _ReversibleFunction runs them
    under no_grad, and its backward recomputes each from its outputs). Their forward outputs carry
    no autograd node, so a wrapper that hooks a layer's outputs to gather its parameters for the
    backward (FSDP2) is not called before they run again."""
    without_autograd: set[str] = set()
    in_backward: set[str] = set()
    stage = {"now": "forward"}

    def seen(name: str) -> None:
        if stage["now"] == "backward":
            in_backward.add(name)
        elif not torch.is_grad_enabled():
            without_autograd.add(name)

    try:
        with _module_calls(model, seen) as owners:
            model.zero_grad(set_to_none=True)
            loss = kind.loss(model, batch)
            stage["now"] = "backward"
            loss.backward()
    finally:
        model.zero_grad(set_to_none=True)
    return tuple(name for name in owners if name in without_autograd and name in in_backward)


def _loaded_otherwise(kind, workdir: Path, buffers: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `buffers` that the kind's load_weights(), asked for bf16, gives in another dtype
    (RoPE's inv_freq: fp32), from the fp32 checkpoint build() wrote under `workdir`: a model cast
    to bf16 does not get them back."""
    directory = workdir / "pretrained-fp32"
    if not buffers or not directory.exists():
        return ()
    try:
        loaded = kind.load_weights(directory, torch.bfloat16, measurement_device(kind))
    except NotImplementedError:  # a kind that reloads otherwise (peft: adapters over its base)
        return ()
    dtypes = {name: b.dtype for name, b in loaded.named_buffers()}
    return tuple(name for name in buffers if dtypes.get(name, torch.bfloat16) != torch.bfloat16)


def _saved_in_another_layout(kind, model: nn.Module, workdir: Path) -> tuple[str, ...]:
    """The state-dict entries of `model` that the kind's save() writes to no safetensors key of the
    same name (a tied weight counts as written when its twin is). Only a whole model's files
    (model*.safetensors) are read: an adapter save (peft) writes its own names on purpose."""
    from safetensors import safe_open

    directory = workdir / "layout-probe"
    directory.mkdir()  # a kind's save may expect its directory to exist, as build() gives it one
    kind.save(model, directory)
    saved: set[str] = set()
    for path in directory.glob("model*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            saved |= set(handle.keys())
    if not saved:
        return ()
    state = model.state_dict()
    storage: dict[int, set[str]] = {}
    for name, tensor in state.items():
        storage.setdefault(tensor.untyped_storage().data_ptr(), set()).add(name)
    return tuple(
        sorted(n for n, t in state.items() if n not in saved and not storage[t.untyped_storage().data_ptr()] & saved)
    )


def _reloaded_by_library(kind) -> bool:
    """Whether a half model obtained by a cast comes back from its checkpoint through the
    library's loader rather than the way it was obtained."""
    from matrix.precisions.policies import PRECISIONS

    cast = next(p for p in PRECISIONS.values() if p.weights_from == "cast" and p.weights_dtype != torch.float32)
    return kind.loaded_in_dtype(cast, reloaded=True) and not kind.loaded_in_dtype(cast, reloaded=False)


def _probe_losses(kind, model, batch) -> tuple[float, float]:
    losses = []
    with torch.no_grad():
        for seed in DROPOUT_PROBE_SEEDS:
            torch.manual_seed(seed)
            losses.append(kind.loss(model, batch).float().item())
    return losses[0], losses[1]


def rows_of(batch: dict, rows: slice) -> dict:
    return {key: value[rows] for key, value in batch.items()}


def _loss_item_rule(kind, model, batch) -> tuple[str, dict]:
    """The rule of LOSS_ITEM_RULES under which the rows' losses, weighted by their item counts,
    average closest to the batch's loss (eval mode: no dropout), among those within
    LOSS_ITEMS_RTOL; the earlier rule where two fit alike. Every rule is tried: one that fits
    within the allowance can still be the wrong one (MBartForCausalLM averages over its unshifted
    labels, and the next-token count comes within 1.7e-5 of it on the batch, enough for two ranks'
    weighted losses to leave the fp32 row of the cross-engine check)."""
    with torch.no_grad():
        whole = kind.loss(model, batch).float().item()
        size = len(next(iter(batch.values())))
        per_row = [kind.loss(model, rows_of(batch, slice(i, i + 1))).float().item() for i in range(size)]
    evidence: dict = {}
    for rule, counts_of in LOSS_ITEM_RULES.items():
        try:
            counts = counts_of(batch).tolist()
        except (KeyError, TypeError, AttributeError, IndexError) as exc:
            evidence[rule] = f"not applicable: {type(exc).__name__}: {exc}"
            continue
        if sum(counts) == 0:
            evidence[rule] = "no items in the batch"
            continue
        weighted = [(c, loss) for c, loss in zip(counts, per_row, strict=True) if c]
        if not all(math.isfinite(loss) for _, loss in weighted):
            evidence[rule] = "a row with items has a non-finite loss"
            continue
        mean = sum(c * loss for c, loss in weighted) / sum(c for c, _ in weighted)
        evidence[rule] = abs(mean - whole) / max(abs(whole), 1e-12)
    fitting = [
        (error, rule) for rule, error in evidence.items() if isinstance(error, float) and error <= LOSS_ITEMS_RTOL
    ]
    if fitting:
        best = min(fitting, key=lambda pair: pair[0])[1]  # min keeps the first of equal errors
        return best, evidence
    return "rows", {**evidence, "chosen": "rows: no rule reproduced the batch's loss"}


def measurement_device(kind) -> torch.device:
    """Where the harness observes and calibrates a kind, once per process: the CPU, unless the kind
    cannot run there here (Liger's Triton kernels, where a GPU is visible and Triton's interpreter
    is therefore off), then the first GPU. A kind that runs nowhere here is measured on the CPU:
    its cells skip anyway."""
    cpu = torch.device("cpu")
    if kind.skip_reason("cpu") is None or not torch.cuda.is_available() or kind.skip_reason("cuda") is not None:
        return cpu
    return torch.device("cuda", 0)


def generators_of(device: torch.device) -> list:
    """The generators torch.random.fork_rng keeps for `device`, besides the CPU's."""
    return [device] if device.type == "cuda" else []


def _observe(kind) -> Observation:
    from matrix.precisions.policies import PRECISIONS

    cpu, fp32 = measurement_device(kind), PRECISIONS["fp32"]
    try:
        with (
            torch.random.fork_rng(devices=generators_of(cpu)),
            tempfile.TemporaryDirectory(prefix="matrix-observe-") as scratch,
        ):
            workdir = Path(scratch)
            model = kind.build(fp32, cpu, workdir)
            created_in_eval_mode = not model.training
            batch = kind.batch(cpu)
            parameters = list(model.parameters())
            dropout = tuple(
                f"{name} (p={module.p:g})"
                for name, module in model.named_modules()
                if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0
            )
            model.train()
            first, second = _probe_losses(kind, model, batch)
            gradless, unused = _gradless_parameters(kind, model, batch)
            recomputed = _recomputed_in_backward(kind, model, batch)
            frozen = tuple(n for n, p in model.named_parameters() if not p.requires_grad)
            model.eval()
            rule, evidence = _loss_item_rule(kind, model, batch)
            num_items = _num_items_effect(model, batch)
            # what a *-loaded-* precision trains: the kind's checkpoint of its fp32 weights, read
            # back with its load_weights() (from_pretrained() returns eval mode), as build() does
            loaded = kind.build(dataclasses.replace(fp32, name="fp32-loaded", weights_from="load"), cpu, workdir)
            return Observation(
                kind=kind.name,
                parameters=sum(p.numel() for p in parameters),
                trainable_parameters=sum(p.numel() for p in parameters if p.requires_grad),
                layer_norm_modules=sum(isinstance(m, nn.LayerNorm) for m in model.modules()),
                float8_layers=len(float8.linear_names(model)) - len(float8.left_out(model)),
                frozen_linear_biases=sum(
                    isinstance(m, nn.Linear) and m.bias is not None and not m.bias.requires_grad
                    for m in model.modules()
                ),
                dropout_modules=dropout,
                stochastic_training_forward=first != second,
                created_in_eval_mode=created_in_eval_mode,
                loaded_in_eval_mode=not loaded.training,
                origin=_origin(model),
                embeddings_in_no_split_module=_no_split_module_around_embeddings(model),
                no_split_modules_absent=_no_split_modules_absent(model),
                tied_output_bias=_tied_output_bias(model),
                fp32_in_bf16_loads=_fp32_in_half_loads(model, torch.bfloat16),
                fp32_in_fp16_loads=_fp32_in_half_loads(model, torch.float16),
                unmapped_loss_type=_unmapped_loss_type(model),
                ignores_num_items=num_items[0] if num_items and num_items[1] else None,
                takes_num_items=num_items[0] if num_items and not num_items[1] else None,
                unsaved_float_buffers=_loaded_otherwise(kind, workdir, _unsaved_float_buffers(model)),
                saved_in_another_layout=_saved_in_another_layout(kind, model, workdir),
                shared_across_instances=_shared_across_instances(model, loaded),
                tied_across_layers=_tied_across_layers(model),
                calls_vary_across_shares=_calls_vary_across_shares(kind, model, batch),
                recomputed_in_backward=recomputed,
                reloaded_by_library=_reloaded_by_library(kind),
                gradless_parameters=gradless,
                unused_parameters=unused,
                frozen_parameters=frozen,
                thawed_by_loading=tuple(n for n, p in loaded.named_parameters() if n in frozen and p.requires_grad),
                largest_trainable_magnitude=max(
                    (p.detach().abs().median().item() for p in parameters if p.requires_grad), default=0.0
                ),
                loss_items=rule,
                loss_items_evidence=evidence,
            )
    except Exception as exc:  # recorded in every cell's report; the cell itself then fails on its own
        return Observation(kind=kind.name, error=f"{type(exc).__name__}: {exc}")
