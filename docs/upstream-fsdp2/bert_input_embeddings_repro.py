"""Repro: accelerate's FSDP2 prepare shards a BERT's input embeddings twice and fails.

Signature (accelerate 1.15.0, torch 2.13.0, transformers 5.23.0, 2 CPU ranks, gloo):
    prepare: TypeError: Invariant encountered: value was None when it should not be
    Accelerator.prepare -> fsdp2_prepare_model -> fully_shard(input_embed)
    -> FSDPParam._init_sharding_spec_tp -> DeviceMesh._concatenate

Pins:
    pip install torch==2.13.0 transformers==5.23.0 accelerate==1.15.0   # fails (exit 1)
    pip install --no-deps accelerate==1.13.0                            # passes (exit 0)

Mechanism (accelerate 1.15.0, src/accelerate/utils/fsdp_utils.py, fsdp2_prepare_model):
with auto_wrap_policy="transformer_based_wrap" the classes to wrap default to the model's
`_no_split_modules`, which for BERT are BertEmbeddings and BertLayer. The auto-wrap loop
(lines 850-855) calls fully_shard(bert.embeddings), so word_embeddings.weight becomes a DTensor
of that FSDP group. Then (lines 859-866, added in 1.14.0 by PR #4015 "Fsdp2 fully_shard
embedding and norm") it carves `model.get_input_embeddings()` into a unit of its own: the
guard `not isinstance(input_embed, FSDPModule)` only looks at the nn.Embedding itself, not at
an ancestor that already owns its parameters, so fully_shard runs a second time on a parameter
that is already a DTensor. FSDP2 takes such a parameter for a tensor-parallel one
(FSDPParam._init_sharding_spec_tp) and fails merging the meshes. For Llama the classes to wrap
are ["LlamaDecoderLayer"], so embed_tokens belongs to no group before the carve: it passes.

Nothing here depends on the CPU. accelerate selects FSDP only for accelerator device groups
(state.py, AcceleratorState.__init__: MULTI_GPU, MULTI_XPU, ... -> DistributedType.FSDP); on a
CPU group it stays MULTI_CPU. `--selection accelerate` (default) lets accelerate's own code make
the selection: the one fact changed is the kind of group PartialState reports (MULTI_GPU, what
a CUDA box reports), then Accelerator(fsdp_plugin=...) runs its GPU branch (distributed type,
plugin mixed precision, plugin attached, PartialState updated). `--selection forced` makes the
same selection after the fact, as precision-matrix's accelerate-fsdp2 engine does. Both give
the same result. The model is built from a config (all-MiniLM-L6-v2's shape, shrunk), nothing
is downloaded.

    python bert_input_embeddings_repro.py                       # BERT: exit 1 on 1.14.0+
    python bert_input_embeddings_repro.py --model llama         # Llama: exit 0
    python bert_input_embeddings_repro.py --selection forced    # the matrix engine's selection
    python bert_input_embeddings_repro.py --wrap no_wrap        # accelerate's default policy

Releases run (torch 2.13.0+cpu, transformers 5.23.0, defaults: BERT, --selection accelerate, bf16):
    accelerate 1.6.0, 1.7.0, 1.10.1, 1.12.0, 1.13.0: exit 0;  1.14.0, 1.15.0: exit 1.
    --model llama: exit 0 on all seven. On 1.15.0 --selection forced and --mixed-precision no/fp16
    also exit 1; --wrap no_wrap exits 0.
Workaround: wrap only the layers (transformer_cls_names_to_wrap=["BertLayer"]: the embedding is
then carved into a unit of its own and training runs), or accelerate<=1.13.0.

Exit: 1 = REPRODUCED (prepare raised inside fsdp2_prepare_model while the input embedding's
weight was already a DTensor), 0 = NOT REPRODUCED (prepare and one training step ran), 2 = ERROR.
"""

import argparse
import os
import socket
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(kind):
    import transformers

    torch.manual_seed(0)
    if kind == "bert":
        # all-MiniLM-L6-v2's config (BertModel, tie_word_embeddings left at its default True),
        # shrunk; a 3-label head as BertForSequenceClassification.from_pretrained(num_labels=3)
        config = transformers.BertConfig(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            type_vocab_size=2,
            pad_token_id=0,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=3,
        )
        model = transformers.BertForSequenceClassification(config)
        batch = {"input_ids": torch.randint(1, 128, (4, 8)), "labels": torch.tensor([0, 1, 2, 0])}
    else:
        config = transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
        model = transformers.LlamaForCausalLM(config)
        ids = torch.randint(1, 128, (4, 8))
        batch = {"input_ids": ids, "labels": ids}
    return model, batch


def make_accelerator(selection, mixed_precision, wrap):
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy=wrap)
    if selection == "accelerate":
        PartialState(cpu=True)  # the gloo group; accelerate calls it MULTI_CPU
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
        accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision, fsdp_plugin=plugin)
    else:
        accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision, fsdp_plugin=plugin)
        assert accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.distributed_type
        accelerator.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        if mixed_precision != "no":
            plugin.set_mixed_precision(mixed_precision)
        accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2, f"not on FSDP2: {accelerator.distributed_type}"
    return accelerator


def worker(rank, world, port, result_dir, args):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    verdict, model = "ERROR", None
    try:
        import accelerate
        import transformers
        from torch.distributed.tensor import DTensor

        accelerator = make_accelerator(args.selection, args.mixed_precision, args.wrap)
        model, batch = build_model(args.model)
        if rank == 0:
            print(
                f"accelerate={accelerate.__version__} torch={torch.__version__} "
                f"transformers={transformers.__version__} model={type(model).__name__} "
                f"selection={args.selection} distributed_type={accelerator.distributed_type} "
                f"mixed_precision={accelerator.mixed_precision} wrap={args.wrap} "
                f"_no_split_modules={model._no_split_modules}",
                flush=True,
            )
        embed = model.get_input_embeddings()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        try:
            model, optimizer = accelerator.prepare(model, optimizer)
        except Exception as e:
            frames = [f.name for f in traceback.extract_tb(e.__traceback__)]
            presharded = isinstance(embed.weight, DTensor)
            if rank == 0:
                traceback.print_exc()
                print(
                    f"prepare raised {type(e).__name__}: {e}; input embedding weight already a "
                    f"DTensor when it failed: {presharded}",
                    flush=True,
                )
            verdict = "REPRODUCED" if "fsdp2_prepare_model" in frames and presharded else "ERROR"
            return
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        if rank == 0:
            print(f"prepare and one step ran: loss {loss.item():.4f}", flush=True)
        verdict = "NOT REPRODUCED"
    except Exception as e:  # report, do not hide
        print(f"[rank{rank}] {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
    finally:
        with open(os.path.join(result_dir, f"r{rank}"), "w") as f:
            f.write(verdict)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["bert", "llama"], default="bert")
    parser.add_argument("--selection", choices=["accelerate", "forced"], default="accelerate")
    parser.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="bf16")
    parser.add_argument("--wrap", choices=["transformer_based_wrap", "no_wrap"], default="transformer_based_wrap")
    args = parser.parse_args()
    d = tempfile.mkdtemp()
    mp.spawn(worker, args=(2, _free_port(), d, args), nprocs=2, join=True)
    verdicts = {open(os.path.join(d, f"r{r}")).read() for r in range(2)}
    v = verdicts.pop() if len(verdicts) == 1 else "ERROR"
    print(v)
    sys.exit({"REPRODUCED": 1, "NOT REPRODUCED": 0}.get(v, 2))
