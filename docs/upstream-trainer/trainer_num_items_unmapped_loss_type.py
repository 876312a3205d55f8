"""Trainer under-scales the causal-LM loss of models whose ``loss_type`` is None (e.g. GPT2LMHeadModel).

Signature
---------
One right-padded batch of 4 rows with 12, 9, 12 and 5 real tokens, ``labels = input_ids`` with -100 at
the pad positions. The model's own ``model(**batch).loss`` (ForCausalLMLoss: mean over the *shifted*
labels, 11 + 8 + 11 + 4 = 34 targets) is compared with the loss the ``transformers.Trainer`` computes
for that same batch in its first training step (``compute_loss``, and the logged ``loss``).

On transformers 5.23.0 (torch 2.13.0+cpu, this script's tiny models, seed 0 / generator 1234):

    GPT2LMHeadModel   model loss 4.854465  vs  Trainer loss 4.343469 (logged 4.3435); ratio 0.894737 = 34/38;
                      Trainer num_items_in_batch = 38
    LlamaForCausalLM  model loss 4.883333  == Trainer loss 4.883333;  Trainer num_items_in_batch = 34

So the Trainer trains GPT-2 on ``sum(token losses) / 38`` instead of ``/ 34``: the loss (and every
gradient) is scaled down by (shifted label count) / (unshifted label count), a factor that depends on
the number of rows and on the padding, i.e. differs from batch to batch.

Mechanism (paths relative to site-packages/transformers, line numbers of 5.23.0)
------------------------------------------------------------------------------
* ``trainer.py`` ~535-545: since PR huggingface/transformers#46204 (first released in 5.10.1) the
  Trainer counts ``labels[..., 1:]`` for ``num_items_in_batch`` only if ``self._loss_shifts_labels``,
  which is ``LOSS_MAPPING.get(model.loss_type) is ForCausalLMLoss`` (and not encoder-decoder).
* ``trainer.py`` ~2298-2336 (``_get_num_items_in_batch``): otherwise it counts the unshifted
  ``labels`` (38 here); ``compute_loss`` passes that count to the model (GPT-2's forward takes
  ``**kwargs``, so ``model_accepts_loss_kwargs`` is True).
* ``modeling_utils.py`` ~1276-1285 (``PreTrainedModel.__init__``): ``loss_type`` is the class name if
  it is a LOSS_MAPPING key, else the first LOSS_MAPPING key found in the class name by regex, else
  None. "GPT2LMHeadModel" contains no key ("ForCausalLM", "ForConditionalGeneration", ...), so
  ``loss_type`` is None.
* ``modeling_utils.py`` ~4762-4774 (``loss_function`` property): a None ``loss_type`` falls back to
  ``LOSS_MAPPING["ForCausalLM"]`` = ``ForCausalLMLoss`` (``loss/loss_utils.py`` ~51-72), which shifts
  the labels and divides the summed token losses by ``num_items_in_batch``.
  -> the model's loss shifts, the Trainer's count does not.
* In 5.23.0, tiny instances of GPT2LMHeadModel, OpenAIGPTLMHeadModel, CTRLLMHeadModel, BertLMHeadModel
  (is_decoder), BertGenerationDecoder and ReformerModelWithLMHead all have ``loss_type`` None, use
  ForCausalLMLoss, and show the same 34/38 Trainer loss; GPTBigCodeForCausalLM, CodeGenForCausalLM,
  XGLMForCausalLM and LlamaForCausalLM get ``loss_type="ForCausalLM"`` and agree. (XLMWithLMHeadModel
  and XLNetLMHeadModel also have ``loss_type`` None by name but compute their own loss without
  ``self.loss_function``; not checked here.)

Control: LlamaForCausalLM (``loss_type == "ForCausalLM"``) must agree on >= 5.10.1; before 5.10.1
(e.g. 5.9.0) both models show the same 34/38 over-count (the bug #46204 fixed).

Exit status
-----------
0  GPT-2's Trainer loss agrees with its own loss (rel. diff <= 1e-5) and so does the Llama control.
1  GPT-2's Trainer loss differs (the bug is present); the message says whether the control agrees
   (only the loss_type=None gap) or not (the older, general over-count from before #46204).
2  GPT-2 agrees but the Llama control differs (unexpected).

Pins / releases run (torch 2.13.0+cpu, accelerate 1.15.0, Python 3.11.7, CPU):
    transformers 5.9.0   exit 1  GPT-2 4.848128 vs 4.337799 (n=38); Llama 4.883333 vs 4.369298 (n=38)
    transformers 5.10.1  exit 1  GPT-2 4.848128 vs 4.337799 (n=38); Llama agrees 4.883333 (n=34)
    transformers 5.16.0  exit 1  GPT-2 4.854465 vs 4.343469 (n=38); Llama agrees 4.883333 (n=34)
    transformers 5.23.0  exit 1  GPT-2 4.854465 vs 4.343469 (n=38); Llama agrees 4.883333 (n=34)
    (5.23.0 was the newest release on PyPI when run. With the same seed, GPT-2's own loss differs
    between 5.10.1 and 5.16.0 -- presumably changed weight initialisation, not investigated; the
    34/38 ratio is the same in every release.)

Upstream: PR huggingface/transformers#46204 ("Fix `num_items_in_batch` over-counting for causal LM
losses", merged; its description says "`loss_type` is set on every `PreTrainedModel`") and docs PR
#46335. A search of GitHub issues/PRs found no report of the loss_type=None gap itself.

Usage: python trainer_num_items_unmapped_loss_type.py
Imports only torch and transformers (plus the standard library). No downloads, no files kept.
"""

import sys
import tempfile

import torch
import transformers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

VOCAB = 128
SEQ = 12
LENGTHS = (12, 9, 12, 5)  # real tokens per row; right padding after them
PAD_ID = 0
REL_TOL = 1e-5


def make_batch():
    g = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(1, VOCAB, (len(LENGTHS), SEQ), generator=g)
    attention_mask = torch.zeros_like(input_ids)
    for i, n in enumerate(LENGTHS):
        attention_mask[i, :n] = 1
    input_ids = input_ids.masked_fill(attention_mask == 0, PAD_ID)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def make_gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=PAD_ID,
        bos_token_id=1,
        eos_token_id=2,
    )
    return GPT2LMHeadModel(cfg)


def make_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        attention_dropout=0.0,
        pad_token_id=PAD_ID,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(cfg)


class RowDataset(torch.utils.data.Dataset):
    """The fixed batch, one row per item; collated back in order by `collate`."""

    def __init__(self, batch):
        self.batch = batch

    def __len__(self):
        return self.batch["input_ids"].shape[0]

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.batch.items()}


def collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


class RecordingTrainer(Trainer):
    seen = None

    def _get_train_sampler(self, *args, **kwargs):  # signature varies across releases
        return torch.utils.data.SequentialSampler(self.train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
        out = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch, **kwargs
        )
        loss = out[0] if return_outputs else out
        if self.seen is None:  # first call = first training step
            self.seen = {
                "loss": loss.detach().float().item(),
                "num_items_in_batch": None if num_items_in_batch is None else int(num_items_in_batch),
                "inputs": {k: v.detach().cpu().clone() for k, v in inputs.items() if torch.is_tensor(v)},
            }
        return out


def run_case(name, model, batch):
    model.train()  # all dropout probabilities are 0, so train mode is deterministic
    with torch.no_grad():
        ref = model(**batch).loss.float().item()
    n_unshifted = int(batch["labels"].ne(-100).sum())
    n_shifted = int(batch["labels"][..., 1:].ne(-100).sum())

    with tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(
            output_dir=out_dir,
            max_steps=1,
            per_device_train_batch_size=len(LENGTHS),
            gradient_accumulation_steps=1,
            learning_rate=0.0,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = RecordingTrainer(model=model, args=args, train_dataset=RowDataset(batch), data_collator=collate)
        trainer.train()

    seen = trainer.seen
    same_batch = all(torch.equal(seen["inputs"][k], batch[k]) for k in batch)
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    rel = abs(seen["loss"] - ref) / abs(ref)
    ok = rel <= REL_TOL
    print(
        f"[{name}] class={type(model).__name__} loss_type={getattr(model, 'loss_type', '<none>')!r} "
        f"trainer._loss_shifts_labels={getattr(trainer, '_loss_shifts_labels', '<absent>')!r} "
        f"model_accepts_loss_kwargs={getattr(trainer, 'model_accepts_loss_kwargs', '<absent>')!r}"
    )
    print(
        f"[{name}] labels != -100: unshifted={n_unshifted} shifted={n_shifted}; "
        f"Trainer num_items_in_batch={seen['num_items_in_batch']}; Trainer saw the fixed batch in order: {same_batch}"
    )
    print(
        f"[{name}] model(**batch).loss = {ref:.6f}   Trainer compute_loss = {seen['loss']:.6f}   "
        f"Trainer logged loss = {logged[0] if logged else None}   "
        f"ratio = {seen['loss'] / ref:.6f} ({n_shifted}/{n_unshifted} = {n_shifted / n_unshifted:.6f})   "
        f"rel diff = {rel:.2e} -> {'AGREE' if ok else 'DIFFER'}"
    )
    if not same_batch:
        print(f"[{name}] WARNING: the Trainer did not see the fixed batch in order; comparison is void")
        ok = False
    return ok


def main():
    print(f"torch {torch.__version__}  transformers {transformers.__version__}")
    batch = make_batch()
    gpt2_ok = run_case("gpt2", make_gpt2(), batch)
    llama_ok = run_case("llama-control", make_llama(), batch)

    if not gpt2_ok:
        if llama_ok:
            print(
                "BUG PRESENT: the Trainer's loss for GPT2LMHeadModel (loss_type None) differs from the model's own "
                "loss: num_items_in_batch counts the unshifted labels while ForCausalLMLoss averages over the "
                "shifted ones. The Llama control (loss_type 'ForCausalLM') agrees, so only the loss_type=None "
                "gap of the #46204 fix is hit."
            )
        else:
            print(
                "BUG PRESENT: the Trainer's loss differs from the model's own loss for GPT-2 AND for the Llama "
                "control: this release counts unshifted labels for every causal LM (before the #46204 fix)."
            )
        return 1
    if not llama_ok:
        print("UNEXPECTED: GPT-2 agrees but the Llama control differs.")
        return 2
    print("OK: the Trainer's loss equals the model's own loss for GPT-2 and for the Llama control.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
