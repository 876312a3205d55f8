#!/usr/bin/env python3
"""The Trainer multiplies by the number of processes the loss of a model that takes **kwargs but
ignores num_items_in_batch (MBartForCausalLM): on two processes it trains on, and logs, twice the loss.

With average_tokens_across_devices (True by default), the Trainer passes num_items_in_batch (the
items of every process) to a model whose forward takes **kwargs, expecting a sum divided by that
count on each process, and multiplies each process's loss by the process count to undo the
gradients' averaging. MBartForCausalLM's forward takes **kwargs but computes its own mean
(CrossEntropyLoss), so its loss comes out multiplied by the process count. Two gloo processes on a
CPU, started by this script (DDP, as the Trainer runs on several processes); one step.

    pip install torch==2.13.0 transformers==5.24.0 accelerate==1.15.0
    python trainer_scales_a_loss_that_ignores_num_items.py

Exit 1 when the Trainer's first logged loss is off the model's own loss by more than 1%, 0 when not.
"""

import os
import socket
import sys
import tempfile

import torch
from transformers import MBartConfig, MBartForCausalLM, Trainer, TrainerCallback, TrainingArguments

TINY = {"vocab_size": 99, "d_model": 16, "decoder_layers": 1, "encoder_layers": 1, "decoder_attention_heads": 2,
        "encoder_attention_heads": 2, "decoder_ffn_dim": 32, "encoder_ffn_dim": 32, "max_position_embeddings": 32,
        "dropout": 0.0}  # fmt: skip
ROWS = 4


def model_and_rows():
    torch.manual_seed(0)
    model = MBartForCausalLM(MBartConfig(**TINY))
    ids = torch.randint(3, 99, (ROWS, 8), generator=torch.Generator().manual_seed(1))
    return model, [{"input_ids": row, "labels": row} for row in ids]


class FirstLoss(TrainerCallback):
    def __init__(self):
        self.loss = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.loss is None and logs and "loss" in logs:
            self.loss = logs["loss"]


def rank_main(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    model, rows = model_and_rows()
    with torch.no_grad():
        own = model(
            input_ids=torch.stack([r["input_ids"] for r in rows]), labels=torch.stack([r["labels"] for r in rows])
        ).loss.item()
    first = FirstLoss()
    arguments = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, ddp_backend="gloo", max_steps=1,
                                  per_device_train_batch_size=ROWS // world, logging_steps=1, report_to=[],
                                  learning_rate=1e-3, save_strategy="no")  # fmt: skip
    trainer = Trainer(model=model, args=arguments, train_dataset=rows, callbacks=[first])
    trainer.train()
    if rank == 0:
        with open(out, "w") as handle:
            handle.write(f"{own} {first.loss} {trainer.accelerator.num_processes} {trainer.model_accepts_loss_kwargs}")


def main() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "rank0.txt")
    torch.multiprocessing.spawn(rank_main, args=(2, port, out), nprocs=2)
    with open(out) as handle:
        own, logged, processes, accepts = handle.read().split()
    own, logged = float(own), float(logged)
    print(f"model's own loss on the batch {own:.4f}; the Trainer's first logged loss {logged:.4f} "
          f"({logged / own:.2f}x) on {processes} processes; Trainer.model_accepts_loss_kwargs {accepts}")  # fmt: skip
    return 1 if abs(logged - own) > 0.01 * own else 0


if __name__ == "__main__":
    sys.exit(main())
