"""What the harness observes on a model kind instead of asking it (matrix/models/observation.py), held
against the built-in kinds (the declarations they used to make) and against kinds written as a
user writes them: tests/plugins/user_gpt2.py (module dropout, right padding, -100 labels) and a
decoder whose only dropout is functional (attention_dropout)."""

import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from matrix.models import MODELS, observation
from matrix.models.observation import effective_traits, observe
from matrix.models.tiny_llama import TinyLlama
from matrix.selection.cells import model_traits

PLUGINS = Path(__file__).resolve().parent / "plugins"


@pytest.fixture(scope="module")
def user_gpt2():
    sys.path.insert(0, str(PLUGINS))
    try:
        module = importlib.import_module("user_gpt2")
    finally:
        sys.path.remove(str(PLUGINS))
    kind = module.UserGPT2()  # not registered: observation needs no registry
    return kind, module


# What the built-in kinds declared by hand before their traits were observed: observation must
# give the same answer, so no catalogue entry selects another cell than it did. unsaved-float-buffers
# replaced the rope entry's list of kinds (tiny-llama, gemma-cache, liger-llama): lora has the
# buffer too, but reloads its base the way it built it, so it must not have the trait.
# next-token-loss-takes-num-items replaced trainer-num-items-overcounts-causal-lm's list of kinds
# (tiny-llama, gemma-cache): every transformers causal LM the Trainer trains has it, lora's too.
NEXT_TOKEN = "next-token-loss-takes-num-items"
DECLARED_BEFORE = {
    "tiny-transformer": {"full-weights", "layer-norm"},
    "tiny-llama": {"full-weights", "loaded-from-pretrained", "unsaved-float-buffers", NEXT_TOKEN},
    "gemma-cache": {"full-weights", "loaded-from-pretrained", "unsaved-float-buffers", NEXT_TOKEN},
    "lora": {"adapters", NEXT_TOKEN},
}


@pytest.mark.parametrize("model", sorted(DECLARED_BEFORE))
def test_the_built_in_kinds_are_observed_as_they_used_to_declare(model):
    kind = MODELS[model]
    assert kind.traits is None  # nothing declared any more
    found = observe(kind)
    assert found.error is None
    assert found.traits == DECLARED_BEFORE[model]
    assert model_traits(model) == found.traits  # what catalogue selectors match


def test_the_causal_lms_loss_averages_over_next_token_labels():
    kind = MODELS["tiny-llama"]
    batch = kind.batch(torch.device("cpu"))
    assert observe(kind).loss_items == "next-token labels"
    assert kind.loss_items(batch) == int((batch["labels"][:, 1:] != -100).sum())
    assert kind.loss_items({k: v[:1] for k, v in batch.items()}) == int((batch["labels"][:1, 1:] != -100).sum())


def test_a_users_decoder_with_module_dropout_right_padding_and_ignored_labels(user_gpt2):
    kind, module = user_gpt2
    found = observe(kind)
    assert found.error is None
    # GPT-2's projections are Conv1D, its one Linear the lm_head float8 leaves out: no float8 layer
    assert found.traits == {
        *("full-weights", "layer-norm", "dropout", "loaded-from-pretrained", "unmapped-loss-type"),
        *("no-float8-layers", NEXT_TOKEN),
    }
    assert found.float8_layers == 0
    assert found.unmapped_loss_type == "GPT2LMHeadModel"
    assert found.stochastic_training_forward
    assert "transformer.drop (p=0.1)" in found.dropout_modules
    assert not found.created_in_eval_mode and found.loaded_in_eval_mode  # GPT2LMHeadModel(config) vs from_pretrained
    # GPT-2 shifts its labels: each row scores length - 1 tokens, not length and not the rows
    assert found.loss_items == "next-token labels"
    batch = kind.batch(torch.device("cpu"))
    assert kind.loss_items(batch) == sum(length - 1 for length in module.LENGTHS)
    assert found.loss_items_evidence["next-token labels"] <= observation.LOSS_ITEMS_RTOL


class FunctionalDropoutLlama(TinyLlama):
    """Llama's attention applies its dropout as a function of attention_dropout: no nn.Dropout."""

    name = "functional-dropout-llama"
    grid_variant = TinyLlama.grid_variant.replace(dropout=0.2)


def test_functional_dropout_is_seen_by_its_effect_not_by_its_modules():
    found = observe(FunctionalDropoutLlama())
    assert found.dropout_modules == ()
    assert found.stochastic_training_forward and "dropout" in found.traits
    assert not observe(MODELS["tiny-llama"]).stochastic_training_forward


class DeclaringLlama(TinyLlama):
    name = "declaring-llama"
    traits = frozenset({"full-weights"})


def test_a_kind_may_still_declare_its_traits_and_the_report_keeps_both():
    kind = DeclaringLlama()
    assert effective_traits(kind) == {"full-weights"}
    assert "loaded-from-pretrained" in observe(kind).traits  # observed all the same, and recorded


class UnsaveableLlama(TinyLlama):
    name = "unsaveable-llama"

    def save(self, model, directory):
        raise OSError("disk full")


def test_an_observation_that_fails_is_recorded_with_its_error_and_selects_nothing():
    found = observe(UnsaveableLlama())
    assert found.error == "OSError: disk full"
    assert found.traits == frozenset()
    assert found.as_dict()["error"] == "OSError: disk full"


def test_the_rule_that_fits_best_is_chosen_not_the_first_that_fits():
    """MBartForCausalLM averages its loss over its unshifted labels. On the batch, the next-token
    count (the first rule) comes within the allowance but not exactly, and two ranks weighting by
    it leave the fp32 row of the cross-engine check: the closest rule is the model's own."""
    found = observe(MODELS["hf:mbart"])
    evidence = found.loss_items_evidence
    assert evidence["next-token labels"] <= observation.LOSS_ITEMS_RTOL  # the first rule fits, loosely
    assert found.loss_items == "labels" and evidence["labels"] < evidence["next-token labels"] / 10


@pytest.mark.parametrize(
    ("model", "trait"),
    [
        ("hf:mbart", "unused-parameters"),  # the decoder layers' cross-attention, never called
        ("hf:mbart", "no-split-module-absent"),  # MBartEncoderLayer, named by its family's list
        ("hf:roc_bert", "tied-output-bias"),  # cls.predictions.decoder.bias is cls.predictions.bias
        ("hf:deepseek_v2", "fp32-parameters-in-half-loads"),  # the router's gate.weight, kept fp32
        # created in fp32 by the class's __init__, which from_pretrained keeps: no declaration names them
        ("hf:hunyuan_v1_moe", "fp32-parameters-in-half-loads"),  # the router's gate.wg.weight
        ("hf:olmo_hybrid", "fp32-parameters-in-half-loads"),  # the linear attention's A_log
        ("hf:zamba", "parameters-tied-across-layers"),  # every hybrid layer's shared_transf, tied to the first's
    ],
)
def test_the_mechanisms_the_sweep_found_are_observed_traits(model, trait):
    """What the catalogue's entries for the every-engine sweep's findings select by (issue 47): a
    fact of the model, observed, so that the next architecture with it is known, not new."""
    assert trait in observe(MODELS[model]).traits
    assert trait not in observe(MODELS["tiny-llama"]).traits


class _WeightSharingStack(nn.Module):
    """Weight sharing as a user writes it: one block placed twice in the layer stack (ALBERT-style),
    and the output layer tied to the embeddings."""

    def __init__(self, shared: bool = True):
        super().__init__()
        block = nn.Linear(4, 4)
        self.embed = nn.Embedding(8, 4)
        self.layers = nn.ModuleList([block, block if shared else nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


def test_one_block_in_two_places_of_a_users_layer_stack_is_tied_across_layers():
    """parameters-tied-across-layers on a model no transformers class wrote: the block held twice is
    found under its second place; the embeddings tied to the output layer are not a tie across layers."""
    assert observation._tied_across_layers(_WeightSharingStack()) == ("layers.1.weight", "layers.1.bias")
    assert observation._tied_across_layers(_WeightSharingStack(shared=False)) == ()


def test_fp32_kept_in_one_load_dtype_only_is_observed_for_that_dtype():
    """GPT-OSS keeps its norms fp32 in fp16 loads only (_keep_in_fp32_modules), DeepseekV2 its router
    in both (_keep_in_fp32_modules_strict): fsdp2-layer-needs-one-parameter-dtype claims GPT-OSS's
    fp16-loaded cells by the dtype's own trait, not its bf16-loaded ones, which pass."""
    from matrix.selection.cells import parse_selection

    parse_selection("model", "hf:gpt_oss")  # made on demand, as --model hf:gpt_oss makes it
    gpt_oss, deepseek = observe(MODELS["hf:gpt_oss"]).traits, observe(MODELS["hf:deepseek_v2"]).traits
    assert "fp32-parameters-in-fp16-loads" in gpt_oss and "fp32-parameters-in-bf16-loads" not in gpt_oss
    assert {"fp32-parameters-in-fp16-loads", "fp32-parameters-in-bf16-loads"} <= deepseek


@pytest.mark.parametrize(
    ("model", "has_it"),
    [
        ("hf:gpt_neox", True),  # entry-releases' "differs" row at transformers 5.0.0, by name until now
        ("hf:mbart", False),  # its loss ignores num_items_in_batch (ignores-num-items-in-batch instead)
        ("tiny-transformer", False),  # not a transformers model: the Trainer's count reaches no loss
    ],
)
def test_a_loss_that_divides_by_the_count_it_is_given_over_next_token_labels_is_observed(model, has_it):
    """trainer-num-items-overcounts-causal-lm selects by next-token-loss-takes-num-items: the model's
    loss changes with the num_items_in_batch it is given (ForCausalLMLoss divides by it) and, given
    none, averages over next-token labels, so a Trainer that counts every label makes it smaller."""
    found = observe(MODELS[model])
    assert ("next-token-loss-takes-num-items" in found.traits) is has_it, found.as_dict()
    assert (found.takes_num_items is not None) is has_it
    if model == "hf:mbart":
        assert found.ignores_num_items == "MBartForCausalLM" and found.takes_num_items is None


def test_a_first_observation_asked_for_inside_no_grad_still_observes():
    """A kind's first observation may be asked for from inside an evaluation (no_grad, or the
    variant's inference_mode): it measures gradients all the same, instead of failing into the
    declared traits and the rows weighting."""
    kind = TinyLlama()
    observation._OBSERVED.pop(observation._key(kind), None)  # this process's observation of it, forgotten
    with torch.no_grad():
        found = observe(kind)
    assert found.error is None and found.loss_items == "next-token labels", found.error


def test_a_submodule_every_instance_of_the_kind_shares_is_observed():
    """XLM's feed-forward layers hold transformers' module-level gelu: two builds of hf:xlm hold the
    same GELUActivation object (the trait xlm-shared-activation-module-zero3-trace selects by); the
    built-in kinds build their own modules each time."""
    from matrix.selection.cells import parse_selection

    parse_selection("model", "hf:xlm")  # made on demand, as --model hf:xlm makes it
    found = observe(MODELS["hf:xlm"])
    assert found.error is None, found.error
    assert found.shared_across_instances == ("transformer.ffns.0.act",)
    assert "module-shared-across-instances" in found.traits
    assert found.as_dict()["shared_across_instances"] == ["transformer.ffns.0.act"]
    for name in ("tiny-llama", "tiny-transformer", "lora"):
        assert observe(MODELS[name]).shared_across_instances == (), name


class _TokenRoutedExpert(nn.Module):
    """A mixture of experts as a user may write one: the expert runs once per distinct token the
    batch holds (`looped`), or once over every token (not looped)."""

    def __init__(self, looped: bool):
        super().__init__()
        self.looped = looped
        self.embed = nn.Embedding(8, 4)
        self.expert = nn.Linear(4, 4)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        if not self.looped:
            return self.expert(hidden).sum()
        return sum(self.expert(hidden[input_ids == token]).sum() for token in input_ids.unique())


class _LossOfForward:
    def loss(self, model, batch):
        return model(batch["input_ids"])


def test_a_module_called_once_per_routed_token_is_observed_to_vary_across_ranks():
    """module-calls-vary-across-ranks on a model no transformers class wrote: split as the distributed
    engines split the batch (rows 0-1 to rank 0, row 2 to rank 1), the looped expert runs 3 times on
    rank 0's share and 2 on rank 1's; run once over every token, it runs once on each."""
    batch = {"input_ids": torch.tensor([[1, 2, 1], [3, 1, 2], [4, 4, 5]])}
    kind = _LossOfForward()
    assert observation._calls_vary_across_shares(kind, _TokenRoutedExpert(looped=True), batch) == ("expert",)
    assert observation._calls_vary_across_shares(kind, _TokenRoutedExpert(looped=False), batch) == ()


def test_dbrx_experts_calls_vary_across_ranks_and_fused_experts_do_not():
    """DbrxExperts calls its one mlp once per expert the tokens reach (the trait
    zero3-gathers-desync-where-module-calls-vary-across-ranks selects by); Mixtral's experts are one
    fused module, called once per layer on every rank."""
    from matrix.selection.cells import parse_selection

    for name in ("hf:dbrx", "hf:mixtral"):
        parse_selection("model", name)  # made on demand, as --model makes them
    dbrx = observe(MODELS["hf:dbrx"])
    assert dbrx.error is None, dbrx.error
    assert dbrx.calls_vary_across_shares == (
        "transformer.blocks.0.ffn.experts.mlp",
        "transformer.blocks.1.ffn.experts.mlp",
    )
    assert "module-calls-vary-across-ranks" in dbrx.traits
    for name in ("hf:mixtral", "tiny-llama", "lora"):
        assert "module-calls-vary-across-ranks" not in observe(MODELS[name]).traits, name


class _RecomputeInBackward(torch.autograd.Function):
    """A reversible block as a user writes one: the forward keeps no activations (no_grad), the
    backward runs the block again with autograd to get its gradients."""

    @staticmethod
    def forward(ctx, hidden, block):
        ctx.block = block
        ctx.save_for_backward(hidden)
        with torch.no_grad():
            return block(hidden)

    @staticmethod
    def backward(ctx, grad):
        (hidden,) = ctx.saved_tensors
        with torch.enable_grad():
            again = hidden.detach().requires_grad_()
            output = ctx.block(again)
        torch.autograd.backward(output, grad)
        return again.grad, None


class _ReversibleOrCheckpointed(nn.Module):
    def __init__(self, reversible: bool):
        super().__init__()
        self.reversible = reversible
        self.embed = nn.Embedding(8, 4)
        self.block = nn.Linear(4, 4)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        if self.reversible:
            return _RecomputeInBackward.apply(hidden, self.block).sum()
        return torch.utils.checkpoint.checkpoint(self.block, hidden, use_reentrant=False).sum()


def test_a_block_rerun_in_backward_after_a_forward_without_autograd_is_observed():
    """forward-recomputed-in-backward on a model no transformers class wrote: a block the forward runs
    under no_grad and the backward runs again is named; torch's non-reentrant checkpoint also reruns it
    in the backward, but its forward ran with autograd (FSDP2 composes with it), so it is not."""
    batch = {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]])}
    kind = _LossOfForward()
    assert observation._recomputed_in_backward(kind, _ReversibleOrCheckpointed(reversible=True), batch) == ("block",)
    assert observation._recomputed_in_backward(kind, _ReversibleOrCheckpointed(reversible=False), batch) == ()


def test_reformers_reversible_layers_are_recomputed_in_backward():
    """fsdp2-layer-recomputed-in-backward-outside-its-hooks selects by the trait: hf:reformer's layers,
    run by _ReversibleFunction; not the default kinds'."""
    from matrix.selection.cells import parse_selection

    parse_selection("model", "hf:reformer")  # made on demand, as --model hf:reformer makes it
    found = observe(MODELS["hf:reformer"])
    assert found.error is None, found.error
    assert "forward-recomputed-in-backward" in found.traits
    assert "reformer.encoder.layers.0.feed_forward.dense.dense" in found.recomputed_in_backward
    for name in ("tiny-llama", "lora", "tiny-transformer"):
        assert "forward-recomputed-in-backward" not in observe(MODELS[name]).traits, name
