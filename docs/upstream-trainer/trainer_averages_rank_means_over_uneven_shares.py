#!/usr/bin/env python3
"""On several processes the Trainer trains a model that takes no num_items_in_batch on the mean of
each process's mean loss: where the batch's rows do not divide over the processes, the rows of the
smaller share weigh more than in the whole batch's mean.

A model whose forward takes `labels` and returns its own mean loss (no **kwargs, so the Trainer's
average_tokens_across_devices does not apply): each process's loss is the mean over its own rows,
and the gradients are averaged over the processes with equal weights. With 3 rows on 2 processes
(2 and 1, accelerate's even_batches=False; the default would repeat a row instead), the lone row
counts twice as much as each of the other two. Two gloo processes on a CPU, started by this script
(DDP, as the Trainer runs on several processes); one AdamW step, compared with the same step taken
in one process on (a) the whole batch's mean loss and (b) the mean of the two shares' mean losses.

    pip install torch==2.13.0 transformers==5.24.0 accelerate==1.15.0
    python trainer_averages_rank_means_over_uneven_shares.py

Exit 1 when the Trainer's step is (b) and not (a), 0 when it is (a), 2 otherwise.
"""

import os
import socket
import sys
import tempfile

import torch
from torch import nn
from torch.nn import functional as F
from transformers import Trainer, TrainingArguments

ROWS, PROCESSES, LR = 3, 2, 1e-2


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, input_ids, labels=None):
        logits = self.head(torch.tanh(self.embed(input_ids)).mean(dim=1))
        return logits if labels is None else {"loss": F.cross_entropy(logits, labels), "logits": logits}


def model_and_rows():
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (ROWS, 6), generator=torch.Generator().manual_seed(1))
    return Classifier(), [{"input_ids": row, "labels": torch.tensor(i % 4)} for i, row in enumerate(ids)]


def stacked(rows):
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


class InOrder(Trainer):  # the batch's rows in their order: 2 to the first process, 1 to the second
    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def one_step(weighting):
    """One AdamW step in one process, the Trainer's defaults (no weight decay, gradients clipped to 1)."""
    model, rows = model_and_rows()
    shares = [rows[:2], rows[2:]]
    if weighting == "whole batch":
        loss = model(**stacked(rows))["loss"]
    else:
        loss = sum(model(**stacked(share))["loss"] for share in shares) / len(shares)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return model


def loss_on_batch(model):
    _, rows = model_and_rows()
    with torch.no_grad():
        return model(**stacked(rows))["loss"].item()


def rank_main(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    model, rows = model_and_rows()
    arguments = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, ddp_backend="gloo", max_steps=1,
                                  per_device_train_batch_size=2, learning_rate=LR, lr_scheduler_type="constant",
                                  report_to=[], save_strategy="no", accelerator_config={"even_batches": False},
                                  remove_unused_columns=False)  # fmt: skip
    trainer = InOrder(model=model, args=arguments, train_dataset=rows)
    trainer.train()
    if rank == 0:
        trained = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
        torch.save({"state": trained.state_dict(), "accepts": trainer.model_accepts_loss_kwargs}, out)


def main() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "rank0.pt")
    torch.multiprocessing.spawn(rank_main, args=(PROCESSES, port, out), nprocs=PROCESSES)
    saved = torch.load(out)
    trainer_model, _ = model_and_rows()
    trainer_model.load_state_dict(saved["state"])
    trainer_loss = loss_on_batch(trainer_model)
    whole, means = loss_on_batch(one_step("whole batch")), loss_on_batch(one_step("mean of the shares' means"))
    print(f"the whole batch's loss after one step: the Trainer on {PROCESSES} processes {trainer_loss:.6f}; "
          f"one process on (a) the whole batch's mean {whole:.6f}, (b) the mean of the shares' means {means:.6f} "
          f"(shares of 2 and 1 rows; Trainer.model_accepts_loss_kwargs {saved['accepts']})")  # fmt: skip
    close = lambda x, y: abs(x - y) <= 1e-5 * max(1.0, abs(y))  # noqa: E731
    if close(trainer_loss, means) and not close(trainer_loss, whole):
        return 1
    return 0 if close(trainer_loss, whole) else 2


if __name__ == "__main__":
    sys.exit(main())
