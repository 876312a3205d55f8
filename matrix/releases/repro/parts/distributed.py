"""A distributed engine's ranks, written out (the matrix's rank_worker.py, group.py and the rank
side of measurements.py): each rank joins a real process group (gloo on a CPU, nccl on CUDA),
takes its rows of the batch (torch.tensor_split), weights its loss by its share of the items the
loss averages over (LOSS_ITEMS: the rule the matrix observed on the kind's loss), and evaluates
its rows, gathered into the whole batch's loss and logits. Goes into a distributed engine's
script before its engine part, which builds its ENGINE on RankEngine."""

import datetime

import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 600  # a collective that waits longer raises in the rank (the matrix's own limit)
IGNORE_INDEX = -100  # the label torch's cross entropy (and so transformers' losses) skips
LOSS_ITEM_RULES = {
    "next-token labels": lambda batch: (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1),
    "labels": lambda batch: (batch["labels"] != IGNORE_INDEX).reshape(len(batch["labels"]), -1).sum(dim=1),
    "attention mask": lambda batch: batch["attention_mask"].reshape(len(batch["attention_mask"]), -1).sum(dim=1),
    "rows": lambda batch: torch.ones(len(next(iter(batch.values()))), dtype=torch.long),
}
RANK = {"rank": 0}  # this process's rank, set by setup_rank


class RankEngine:
    """What every distributed engine's part shares: joining the group in each rank."""

    owns_loop = False

    def setup_rank(self, rank):
        """Join the process group as the matrix's ranks do: one intra-op thread per rank (the ranks
        share the machine's cores), the rank's own GPU on CUDA, a timeout on every collective."""
        global DEVICE, BATCH, RNG_DEVICES
        RANK["rank"] = rank
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # as torchrun sets it, for accelerate
        backend = "gloo"
        if DEVICE_TYPE == "cuda":  # nccl: one GPU per rank (written for CUDA, not run on a CPU-only machine)
            backend = "nccl"
            DEVICE = f"cuda:{rank}"
            torch.cuda.set_device(DEVICE)
            BATCH = {key: value.to(DEVICE) for key, value in BATCH.items()}
            RNG_DEVICES = [rank]
        dist.init_process_group(
            backend, rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        )
        if CELL["weights_from"] == "load":  # one pretrained checkpoint, written by rank 0, that every rank loads
            if rank == 0:
                build(CELL)
            dist.barrier()


def rank_rows(batch):
    """This rank's rows: contiguous, the first ranks taking one more where they do not divide evenly."""
    return {key: torch.tensor_split(value, WORLD_SIZE)[RANK["rank"]] for key, value in batch.items()}


def loss_items(batch):
    return int(LOSS_ITEM_RULES[LOSS_ITEMS](batch).sum())


def loss_weight(rows):
    """A rank's loss is multiplied by this before backward: the ranks' averaged gradients are then
    the gradient of the whole batch's mean loss."""
    return loss_items(rows) * WORLD_SIZE / loss_items(BATCH)


def collective_device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def group_mean(value, items):
    """The whole batch's mean from each rank's mean over its `items` items."""
    pair = torch.tensor([value * items, float(items)], dtype=torch.float64, device=collective_device())
    dist.all_reduce(pair)
    return (pair[0] / pair[1]).item()


def group_any(flag):
    value = torch.tensor([1.0 if flag else 0.0], device=collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def gathered_objects(value):
    every = [None] * WORLD_SIZE
    dist.all_gather_object(every, value)
    return every


def writes():
    """Whether this rank writes what is written once for the group."""
    return RANK["rank"] == 0


def evaluate_rows(model, with_autocast=True):
    """Each rank evaluates its rows (eval mode, the eval grad mode, the precision's autocast unless
    the model's forward brings its own); the whole batch's mean loss and every row's logits, gathered."""
    rows = rank_rows(BATCH)
    model.eval()
    with eval_grad_mode(), autocast(CELL) if with_autocast else contextlib.nullcontext():
        loss, logits = outputs_of(evaluate_model(model, rows))
    every = gathered_objects({"loss": loss.detach().float().item(), "items": loss_items(rows), "logits": logits.cpu()})
    total = sum(part["items"] for part in every)
    mean = sum(part["loss"] * part["items"] for part in every) / total
    return torch.tensor(mean), torch.cat([part["logits"] for part in every]).to(DEVICE)


def rank_step(model, optimizer, scaler, with_autocast=True):
    """One optimizer step on this rank's rows, as the matrix's train_step takes it in a group: the
    loss weighted by the rank's share, the grad scaler's skip decided alike on every rank.
    (the whole batch's mean loss, applied)."""
    rows = rank_rows(BATCH)
    optimizer.zero_grad(set_to_none=True)
    with autocast(CELL) if with_autocast else contextlib.nullcontext():
        loss = loss_of(model, rows)
    value = finite_loss(loss, "training loss")
    loss = loss * loss_weight(rows)
    (loss if scaler is None else scaler.scale(loss)).backward()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # after backward (FSDP2 swaps them)
    bad = [n for n, p in named if p.grad is not None and not torch.isfinite(p.grad).all()]
    if scaler is None:
        if bad:
            raise CheckFailed("NonFiniteValue", "gradients are not finite", f"{len(bad)} tensors, first {bad[0]}")
        optimizer.step()
        applied = True
    else:
        scaler.unscale_(optimizer)
        overflow = group_any(bool(bad))  # such a step is skipped by design, on every rank
        scaler.step(optimizer)
        scaler.update()
        applied = not overflow
    finite_parameters(model, "after the optimizer step")
    return group_mean(value, loss_items(rows)), applied


def rank_steps(step, steps, seeds):
    """step() until `steps` were applied, each attempt's end told to the seeded forwards."""

    def one():
        taken = step()
        if seeds is not None:
            seeds.step_ended(taken[1])
        return taken

    return take_steps(one, steps)


def dropout_off_rows_loss(model, with_autocast=True):
    """The whole batch's training loss with dropout off (eval mode), each rank on its rows: what
    the first step is compared by where the kind draws dropout masks (each rank draws its rows')."""
    rows = rank_rows(BATCH)
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(CELL) if with_autocast else contextlib.nullcontext():
            value = float(loss_of(model, rows).float().item())
    finally:
        model.train(was)
    return group_mean(value, loss_items(rows))


def gathered_weights(run, sharded):
    """A sharded run's weights whole, in a plain model, gathered (on every rank) once per step."""
    if run.get("gathered") is None or run["gathered_at"] != run["steps"]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
        run["gathered"] = model_holding({k: v.detach().clone() for k, v in full.items()}, run.get("gathered"))
        run["gathered_at"] = run["steps"]
    return run["gathered"]
