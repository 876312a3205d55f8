"""The cell's phases written out, run in the matrix's order (PHASE_ORDER, which the script's
settings take from matrix/harness/pipeline.py PHASES), each with the checks the matrix makes
there, and main(): exit 1 when the cell's failure shows (the same check or exception in the same
phase), 0 when every check holds, 2 on another failure. Not imported: its text ends the script."""


class Cell:
    """What the phases hand on: the run, the saved outputs, the restored run."""

    run = restored = evaluation = exported = exported_logits = None
    point = checkpoint = export = None


def plain_of(module):
    return getattr(module, "_orig_mod", module)


def compiled_if_asked(model):
    return torch.compile(model, backend=COMPILE_BACKEND) if COMPILED else model


def optimizer_tensors(optimizer):
    if optimizer is None:
        return {}
    inner = getattr(optimizer, "optimizer", optimizer)
    found = {}
    for g, group in enumerate(inner.param_groups):
        for i, parameter in enumerate(group["params"]):
            for key, value in inner.state.get(parameter, {}).items():
                if isinstance(value, torch.Tensor):
                    local = value.to_local() if hasattr(value, "to_local") else value
                    found[f"group {g}, parameter {i}: {key}"] = local.detach().clone()
    return found


def trainable_snapshot(model):
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad and not any(n == g or n.endswith("." + g) for g in GRADLESS)
    }


def evaluate_as_run(model):
    """A plain model evaluated under the autocast the engine's run had in its forward."""
    return evaluate_in({"autocast": RUN_AUTOCAST}, model)


def check_against_fp32(label, loss, model):
    value = finite_loss(loss, f"{label} loss")
    reference, _ = fp32_evaluation(model)
    reference = finite_loss(reference, f"fp32 reference {label} loss")
    within(
        "OutOfTolerance",
        f"{label} loss against an fp32 copy of the same weights",
        value,
        reference,
        EVAL_ROW,
        f"{label} loss is off the fp32 reference",
    )


def check_against_torch_engine(what, value, reference):
    if ENGINE_NAME == "torch":
        return
    within(
        "EngineDisagreement",
        f"{what} against the torch engine's",
        value,
        reference,
        EVAL_ROW,
        f"{what} disagrees with the torch engine's beyond tolerance",
    )


def torch_engine_dropout_off_loss(model):
    """The whole batch's training loss with dropout off (eval mode), under the precision's
    autocast, no gradients: the torch engine's side where a distributed engine's is taken so."""
    model.eval()
    with torch.no_grad(), autocast(CELL):
        return float(loss_of(model, BATCH).float().item())


def agreed(work):
    """work() in every rank of a distributed cell, then every rank learns whether it worked
    everywhere and waits for the others (what one rank wrote is there to read): a rank that failed
    raises its own error, the others PeerFailed, and none is left waiting in a collective."""
    if WORLD_SIZE == 1:
        return work()
    import torch.distributed as dist

    result = error = None
    try:
        result = work()
    except BaseException as exc:  # raised below, once every rank knows
        if not is_failure(exc):
            raise
        error = exc
    failed = [None] * WORLD_SIZE
    dist.all_gather_object(failed, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    elsewhere = [(rank, what) for rank, what in enumerate(failed) if what is not None]
    if elsewhere:
        rank, what = elsewhere[0]
        raise CheckFailed("PeerFailed", f"rank {rank} failed where every rank works together", what)
    dist.barrier()
    return result


def frozen_kept(model, when):
    """The parameters the model is created frozen with (requires_grad=False) are still frozen."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    thawed = [name for name in FROZEN if name in trainable]
    compared(
        "FrozenParameterThawed", f"{when}: created-frozen parameters now trainable", len(thawed), 0, "0", not thawed
    )
    if thawed:
        raise CheckFailed(
            "FrozenParameterThawed",
            f"{when}: a parameter the model is created with requires_grad=False is trainable",
            f"{len(thawed)} of {len(FROZEN)}, first {thawed[0]}",
        )


def named_master_weights(run):
    """The master weights the engine's optimizer steps, by parameter name, where it keeps a copy the
    parameters are cast from (DeepSpeed's); none where it steps the parameters themselves."""
    return getattr(ENGINE, "named_master_weights", lambda run: {})(run)


def train_steps(cell):
    model = build(CELL)
    frozen_kept(model, "after build")
    cell.run = run = ENGINE.start(model, True)
    weights = ENGINE.weights(run)
    before, dtypes = trainable_snapshot(weights), tensor_dtypes(weights)
    masters_before = named_master_weights(run)
    dtypes.update(getattr(ENGINE, "dtype_changes", lambda run: {})(run))  # casts a library declares it makes later
    # a distributed engine whose kind draws dropout: each rank draws its rows' masks, so its first
    # step is compared with dropout off (eval mode), through the run's model before any step
    dropout_off = ENGINE.dropout_off_loss(run) if SPLIT_DRAWS else None
    seeds = SeededForwards(model)
    try:
        attempts = ENGINE.train(run, STEPS, seeds)
    finally:
        seeds.stop()
    losses = [loss for loss, _ in attempts]
    for loss in losses:
        finite_loss(loss, "training loss")
    applied = [loss for loss, taken in attempts if taken]
    diverged = None
    references = ((CELL, CURVE_VS_TORCH_ENGINE, "torch engine"), (FP32_TWIN, CURVE_VS_FP32_TWIN, "fp32 twin"))
    for precision, row, name in references:
        if row is None:
            continue
        try:
            reference = torch_loop_curve(precision)
        except Exception as exc:  # the yardstick fails: the torch engine cell's finding, as the matrix records it
            print(f"       the {name}'s curve could not be taken ({type(exc).__name__}: {exc}): not compared")
            continue
        found = curve_within("CurveDiverged", applied, reference, row, name)
        diverged = diverged or found
    weights = ENGINE.weights(run)
    first = seeds.training_in_first_forward
    mode = {True: "train", False: "eval", None: "not observed"}[first]
    held = first is not False
    compared("TrainedInEvalMode", "the model's mode in its first training forward", mode, "train", "train", held)
    if first is False:
        raise CheckFailed("TrainedInEvalMode", "the model was in eval mode in its first training forward (dropout off)")
    finite_parameters(weights, "after training")
    masters_before = masters_before or getattr(ENGINE, "named_master_weights_at_start", lambda run: {})(run)
    parameters_changed(before, weights, masters_before, named_master_weights(run))
    same_dtypes(dtypes, weights, "after training")
    fresh = seeded_training_loss(CELL, build(CELL))
    if LOSS_FALL is not None:
        after = seeded_training_loss(CELL, weights)
        fall = (fresh - after) / fresh if fresh else 0.0
        held = fresh > 0 and fall >= LOSS_FALL
        compared(
            "LossNotDecreasing",
            "relative fall of the training loss",
            f"{fall:.2%}",
            f"{fresh:.6g} -> {after:.6g}",
            f"at least {LOSS_FALL:.2%}",
            held,
        )
        if not held:
            raise CheckFailed(
                "LossNotDecreasing",
                "the training loss fell less than its bound over training",
                f"{fresh:.6g} -> {after:.6g}: {fall:.2%}, bound {LOSS_FALL:.2%}",
            )
    if dropout_off is None:
        check_against_torch_engine("first step loss", losses[0], fresh)
    else:
        reference = torch_engine_dropout_off_loss(build(CELL))
        check_against_torch_engine("first step loss dropout off", dropout_off, reference)
    if diverged is not None:
        raise diverged


def check_against_eager(cell, evaluation):
    """A compiled twin's evaluation against its eager twin: the same weights evaluated with every
    compiled module running eagerly, as the run evaluates. The logits' dtype is the same; the loss
    is within the compiled-vs-eager row of the compute dtype (EAGER_ROW)."""
    if not COMPILED:
        return
    owns_loop = getattr(ENGINE, "owns_loop", False)
    with torch.compiler.set_stance("force_eager"):
        if owns_loop:  # the library's evaluation was taken after step k: the weights held there
            eager = evaluate_as_run(getattr(ENGINE, "exported", ENGINE.weights)(cell.run))
        else:
            eager = ENGINE.evaluate(cell.run)
    value = finite_loss(evaluation[0], "compiled eval loss")
    reference = finite_loss(eager[0], "eager twin's eval loss")
    if not owns_loop:  # a library's loop evaluates through wrappers the plain model lacks
        same = evaluation[1].dtype == eager[1].dtype
        compared("DtypeContractBroken", "compiled eval logits dtype", str(evaluation[1].dtype), str(eager[1].dtype),
                 "the eager twin's", same)  # fmt: skip
        if not same:
            raise CheckFailed(
                "DtypeContractBroken",
                "compiled eval logits have another dtype than the eager twin's",
                f"compiled {evaluation[1].dtype}, eager {eager[1].dtype}",
            )
    within(
        "OutOfTolerance",
        "compiled eval loss against the eager twin",
        value,
        reference,
        EAGER_ROW,
        f"compiled eval loss against the eager twin {value:.6g} is off {reference:.6g}",
    )


def mid_training_eval(cell):
    cell.evaluation = ENGINE.evaluate(cell.run)
    check_against_fp32("mid-training eval", cell.evaluation[0], ENGINE.weights(cell.run))
    check_against_eager(cell, cell.evaluation)


def evaluate(cell):
    model = build(CELL)
    frozen_kept(model, "after build")
    cell.run = ENGINE.start(model, False)
    cell.evaluation = ENGINE.evaluate(cell.run)
    check_against_fp32("eval", cell.evaluation[0], ENGINE.weights(cell.run))
    check_against_eager(cell, cell.evaluation)
    if ENGINE_NAME == "torch":
        return
    try:
        torch_engine = evaluate_in(CELL, build(CELL))[0]
    except Exception as exc:  # the yardstick itself fails: the torch engine cell's finding, not this cell's
        print(f"the torch engine's evaluation fails ({type(exc).__name__}: {exc}): not compared, as the matrix records")
        return
    torch_engine = finite_loss(torch_engine, "torch engine eval loss")
    check_against_torch_engine("eval loss", finite_loss(cell.evaluation[0], "eval loss"), torch_engine)


def checkpoint_save(cell):
    run = cell.run
    cell.run_logits = (cell.evaluation or ENGINE.evaluate(run))[1]
    if TRAINING:
        cell.point = (ENGINE.optimizer_state(run), plain_scaler_state(ENGINE.scaler_state(run)))
    # what export() must read back as (an engine whose export is not its weights view says so)
    cell.exported = getattr(ENGINE, "exported", ENGINE.weights)(run)
    cell.exported_dtypes = tensor_dtypes(cell.exported)
    cell.exported_logits = evaluate_as_run(cell.exported)[1]
    cell.checkpoint = os.path.join(WORKDIR, "checkpoint")
    os.makedirs(cell.checkpoint, exist_ok=True)
    agreed(lambda: ENGINE.save(run, cell.checkpoint))  # every rank's part written before anyone reads
    cell.export = agreed(lambda: ENGINE.export(run, os.path.join(WORKDIR, "export"), cell.checkpoint))


def checkpoint_reload(cell):
    reloaded = reload(cell.export, CELL)
    declared = declared_fp32(reloaded) if RELOAD_KEEPS_DECLARED_FP32 else ()
    same_dtypes(cell.exported_dtypes, reloaded, "after reload", declared)
    frozen_kept(reloaded, "after reload")
    outputs_equal("eval logits", cell.exported_logits, evaluate_as_run(reloaded)[1])
    cell.restored = ENGINE.restore(cell.checkpoint, TRAINING)
    outputs_equal("eval logits of the resumed run", cell.run_logits, ENGINE.evaluate(cell.restored)[1])


def step_tensors(run):
    found = {f"parameter {n}": p.detach().clone() for n, p in ENGINE.weights(run).named_parameters() if p.requires_grad}
    found.update({f"optimizer {k}": v for k, v in ENGINE.optimizer_state(run).items()})
    return found


def step_on(run):
    with torch.random.fork_rng(devices=RNG_DEVICES):
        torch.manual_seed(RESUME_SEED)
        attempts = ENGINE.train(run, 1)
    return [loss for loss, _ in attempts], step_tensors(run)


def plain_scaler_state(state):
    """A loss scaler's state with its one-element tensors as numbers, comparable with ==."""
    if state is None:
        return None
    return {k: v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for k, v in state.items()}


def resumed_step(cell):
    saved, saved_scaler = cell.point
    restored_state = ENGINE.optimizer_state(cell.restored)
    restored_scaler = plain_scaler_state(ENGINE.scaler_state(cell.restored))  # right after the restore
    missing = [name for name in saved if name not in restored_state]
    different = [
        n for n, v in saved.items() if n in restored_state and not torch.equal(v, restored_state[n].to(v.device))
    ]
    mismatch = None
    if missing or different:
        what = "missing" if missing else "differs"
        mismatch = CheckFailed(
            "CheckpointMismatch",
            f"optimizer state {what} after reload",
            f"{len(missing or different)} of {len(saved)} tensors, first {(missing or different)[0]}",
        )
    elif saved_scaler is not None:
        same = restored_scaler == saved_scaler
        compared("CheckpointMismatch", "grad scaler state after reload", restored_scaler, saved_scaler, "equal", same)
        if not same:
            mismatch = CheckFailed(
                "CheckpointMismatch",
                "grad scaler state differs after reload",
                f"{saved_scaler} before, {restored_scaler} after",
            )
    before = trainable_snapshot(ENGINE.weights(cell.restored))
    masters_before = named_master_weights(cell.restored)
    uninterrupted, after_uninterrupted = step_on(cell.run)
    resumed, after_resume = step_on(cell.restored)
    if mismatch is not None:
        raise mismatch
    held = (
        resumed == uninterrupted
        if RESUME_ROW is None
        else all(
            abs(a - b) <= allowance_of(RESUME_ROW["loss"], b) for a, b in zip(resumed, uninterrupted, strict=False)
        )
    )
    compared(
        "ResumeDiverged",
        "step k+1 loss, resumed against uninterrupted",
        resumed,
        uninterrupted,
        "bit for bit" if RESUME_ROW is None else RESUME_ROW["loss"],
        held and len(resumed) == len(uninterrupted),
    )
    if not held or len(resumed) != len(uninterrupted):
        raise CheckFailed(
            "ResumeDiverged",
            "the resumed step's loss differs from the uninterrupted run's",
            f"{resumed} vs {uninterrupted}",
        )
    differing, worst = [], 0.0
    for name, expected in after_uninterrupted.items():
        got = after_resume.get(name)
        if got is None or got.shape != expected.shape or got.dtype != expected.dtype:
            differing.append(name)
            continue
        difference = (got.double() - expected.double()).abs()
        worst = max(worst, difference.max().item() if difference.numel() else 0.0)
        if RESUME_ROW is None:
            same = torch.equal(got, expected)
        else:
            row = RESUME_ROW["tensors"]
            same = bool((difference <= row["atol"] + row["rtol"] * expected.double().abs()).all())
        if not same:
            differing.append(name)
    compared("ResumeDiverged", "tensors after step k+1 differing", len(differing), 0, "none", not differing)
    if differing:
        raise CheckFailed(
            "ResumeDiverged",
            "parameters or optimizer state after the resumed step differ from the uninterrupted run's",
            f"{len(differing)} of {len(after_uninterrupted)} tensors, first {differing[0]}, "
            f"max abs difference {worst:.3g}",
        )
    parameters_changed(before, ENGINE.weights(cell.restored), masters_before, named_master_weights(cell.restored))


PHASES = [globals()[name] for name in PHASE_ORDER]  # the cell's phases, in the matrix's order


def environment():
    found = {"python": platform.python_version(), "torch": torch.__version__, "device": DEVICE}
    for name in ("transformers", "peft", "accelerate", "lightning", "deepspeed", "bitsandbytes", "torchao"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            pass
    found["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name()
    return found


def run_phases():
    """Every phase of the mode in order, up to the first failure: {"failure": ..., "checks": ...}."""
    cell, failure = Cell(), None
    for phase in PHASES:
        NOW["phase"] = phase.__name__
        print("phase", phase.__name__, flush=True)
        if NOW.get("phase_file"):  # a rank's: where launch() reads the phase a rank died in
            with open(NOW["phase_file"], "w") as handle:
                handle.write(phase.__name__)
        try:
            phase(cell)
        except BaseException as exc:  # the cell's failure, or another: named below with its traceback
            if not is_failure(exc):
                raise
            name = exc.name if isinstance(exc, CheckFailed) else type(exc).__name__
            failure = {"phase": phase.__name__, "name": name, "message": message_of(exc)}
            if getattr(exc, "details", ""):
                print(f"       {exc.details}")
                failure["details"] = exc.details
            if not isinstance(exc, CheckFailed):
                traceback.print_exc()
            break
    return {"failure": failure, "checks": CHECKS}


def rank_main(rank, port, out):
    """One rank of a distributed engine's cell: the process group's environment, the engine's
    own setup (ENGINE.setup_rank), the phases; rank 0 writes what happened to `out`."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        LOCAL_WORLD_SIZE=str(WORLD_SIZE),
    )
    if rank != 0:  # rank 0's checks are the script's output; the other ranks' errors still go to stderr
        sys.stdout = open(os.devnull, "w")  # for the rank's whole life
    NOW["phase_file"] = phase_file(rank)
    ENGINE.setup_rank(rank)
    result = run_phases()
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(result, handle, default=str)


def phase_file(rank):
    """Where rank `rank` writes the phase it is in."""
    return os.path.join(WORKDIR, f"rank{rank}.phase")


def launch():
    """WORLD_SIZE ranks of this script, started by it (torch.multiprocessing; the engine's backend:
    gloo on a CPU): rank 0's outcome is the script's."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    out = os.path.join(WORKDIR, "rank0.json")
    for stale in [out] + [phase_file(rank) for rank in range(WORLD_SIZE)]:
        if os.path.exists(stale):
            os.remove(stale)  # another run's, in a REPRO_WORKDIR given again
    try:
        torch.multiprocessing.start_processes(rank_main, args=(port, out), nprocs=WORLD_SIZE, start_method="spawn")
    except Exception as exc:  # a rank died (a signal, an error outside the phases)
        if not os.path.exists(out):
            message = (str(exc).strip().splitlines() or [""])[0]
            # the phase the rank that died was in, as the matrix names the call its ranks ran; "launch"
            # when it died before its first phase (the process group, the engine's setup)
            dead = getattr(exc, "error_index", 0)
            phase = "launch"
            if os.path.exists(phase_file(dead)):
                with open(phase_file(dead)) as handle:
                    phase = handle.read().strip() or "launch"
            # named as the matrix's signature names it (matrix/execute/rank_pool.py RankDied)
            return {"failure": {"phase": phase, "name": "rank died", "message": message}, "checks": []}
    with open(out) as handle:
        return json.load(handle)


def is_failure(exc):
    """Whether an exception is the cell's failure to record, as the matrix decides: any Exception, and
    any other BaseException but an exit or an interrupt (DCP's CheckpointException is a
    BaseException: a rank that let it through would die instead of naming it)."""
    return isinstance(exc, Exception) or not isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit))


def message_of(exc):
    """The exception's message as the matrix reads it for a signature: the whole of it (a
    load_state_dict error names the keys on its second line); for one that carries the tracebacks
    of the failures it gathered, its first line and the innermost error's."""
    message = str(exc) or (str(exc.args[0]) if exc.args else "")
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) > 2 and any(line.startswith("Traceback (most recent call last)") for line in lines):
        return f"{lines[0]}: {lines[-1]}"
    return message


def first_line(message):
    return (message.strip().splitlines() or [""])[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the outcome, every check's numbers and the environment here")
    args = parser.parse_args()
    result = launch() if DISTRIBUTED else run_phases()
    failure = result["failure"]
    if failure is None:
        outcome, line, status = "holds", "HOLDS: every check of the cell held", 0
    elif TARGET is None or (failure["phase"], failure["name"]) == (TARGET["phase"], TARGET["name"]):
        outcome, status = "reproduced", 1
        line = f"REPRODUCED in {failure['phase']}: {failure['name']}: {first_line(failure['message'])}"
    else:
        outcome, status = "another", 2
        line = f"ANOTHER FAILURE in {failure['phase']}: {failure['name']}: {first_line(failure['message'])}"
        line += f" (the matrix saw {TARGET['phase']}: {TARGET['name']})"
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {
                    "outcome": outcome,
                    "phase": failure and failure["phase"],
                    "failure": failure and {"name": failure["name"], "message": failure["message"]},
                    "target": TARGET,
                    "checks": result["checks"],
                    "environment": environment(),
                },
                handle,
                indent=1,
                default=str,
            )
    print(line)
    return status


if __name__ == "__main__":
    sys.exit(main())
