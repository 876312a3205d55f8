"""The harness's measurements and rules, written out for a standalone script: the precision's
autocast and grad scaler, the seeded training forwards, the torch loop's step, the references
(the fp32 copy, the torch loop's curve, the fresh model's seeded loss) and each check with the
allowance the matrix applied. Not imported: its text goes into the script after SETTINGS and the
model's code (create, save, load_weights, loss_of, evaluate_model, build, reload)."""


class CheckFailed(AssertionError):
    """A rule of the cell did not hold: its name is the matrix's check (OutOfTolerance, ...)."""

    def __init__(self, name, message, details=""):
        super().__init__(message)  # the stable message, as the matrix's signature has it
        self.name, self.details = name, details


CHECKS = []  # every comparison the script made, in order
NOW = {"phase": None}


def compared(name, what, value, reference, allowance, held):
    CHECKS.append(
        {
            "name": name,
            "phase": NOW["phase"],
            "what": what,
            "value": value,
            "reference": reference,
            "allowance": allowance,
            "held": held,
        }
    )
    verdict = "held" if held else "FAILED"
    print(f"CHECK {NOW['phase']} {name}: {what}: {value} against {reference}, allowed {allowance}: {verdict}")


def allowance_of(row, reference):
    return row["atol"] + row["rtol"] * abs(reference)


def finite_loss(loss, what):
    value = float(loss.float().item()) if isinstance(loss, torch.Tensor) else float(loss)
    if not math.isfinite(value):
        raise CheckFailed("NonFiniteValue", f"{what} is {value}")
    return value


def within(name, what, value, reference, row, message):
    """|value - reference| <= atol + rtol * |reference|, as the matrix's tolerance rows allow."""
    allowed = allowance_of(row, reference)
    held = math.isfinite(value) and abs(value - reference) <= allowed
    compared(name, what, value, reference, f"{allowed:.3g} (atol {row['atol']:g} + rtol {row['rtol']:g} * |ref|)", held)
    if not held:
        raise CheckFailed(name, message, f"{value:.6g} vs {reference:.6g}, |difference| {abs(value - reference):.3g}")


def outputs_equal(what, expected, actual):
    """Bit for bit, as the matrix compares a reload (CHECKPOINT_ROUND_TRIP: atol 0, rtol 0)."""
    if expected.dtype != actual.dtype:
        compared("CheckpointMismatch", what + " dtype", str(actual.dtype), str(expected.dtype), "equal", False)
        raise CheckFailed("CheckpointMismatch", f"{what}: dtype {actual.dtype} after reload, {expected.dtype} before")
    difference = (expected.float() - actual.float()).abs()
    differing = ~(difference <= 0)
    worst = difference[torch.isfinite(difference)].max().item() if torch.isfinite(difference).any() else float("nan")
    held = not bool(differing.any())
    compared("CheckpointMismatch", what, f"max |difference| {worst:.3g}", "the saved run's", "0 (bit for bit)", held)
    if not held:
        raise CheckFailed(
            "CheckpointMismatch",
            f"{what} differ after reload",
            f"{int(differing.sum())} of {difference.numel()} values, max abs difference {worst:.3g}",
        )
    return worst


def tensor_dtypes(model):
    found = {f"parameter {n}": p.dtype for n, p in model.named_parameters()}
    found.update({f"buffer {n}": b.dtype for n, b in model.named_buffers()})
    return found


def same_dtypes(before, model, what, fp32_names=()):
    after = tensor_dtypes(model)
    wanted = {n: torch.float32 if n in fp32_names else d for n, d in before.items()}
    changed = sorted(n for n in before if after.get(n) != wanted[n])
    compared("DtypeContractBroken", what, f"{len(changed)} tensors changed dtype", "0", "none", not changed)
    if changed:
        name = changed[0]
        raise CheckFailed(
            "DtypeContractBroken",
            f"{what}: a {name.split()[0]} was {before[name]}, is now {after.get(name)}",
            f"{len(changed)} tensors changed dtype, first {name}",
        )


def declared_fp32(model):
    """Names from_pretrained keeps in fp32 when it loads the model in the precision's half dtype, as
    the matrix counts them: the modules the class declares (its dtype plan where it has one, else
    _keep_in_fp32_modules for float16 and _keep_in_fp32_modules_strict), and the tensors the class
    itself creates in fp32 (a build from the config in that dtype shows them; a non-persistent
    buffer is made again on load, so a cast of it is still a change)."""
    import copy
    import re

    dtype = CELL["weights"]
    declaring = next((m for m in model.modules() if hasattr(m, "_keep_in_fp32_modules") and hasattr(m, "config")), None)
    if declaring is None or dtype not in (torch.float16, torch.bfloat16):
        return set()
    plan = getattr(declaring, "_get_dtype_plan", None)
    if plan is not None:
        patterns = [p for p, kept in plan(dtype).items() if kept == torch.float32]
    else:
        patterns = list(getattr(declaring, "_keep_in_fp32_modules", None) or []) if dtype == torch.float16 else []
        patterns += list(getattr(declaring, "_keep_in_fp32_modules_strict", None) or [])
    created = []
    build = getattr(type(declaring), "_from_config", None)
    if build is not None:
        import transformers
        from packaging.version import Version

        keyword = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
        with torch.random.fork_rng(devices=[]):
            built = build(copy.deepcopy(declaring.config), **{keyword: dtype})
        saved = built.state_dict().keys()
        tensors = [*built.named_parameters(), *((n, b) for n, b in built.named_buffers() if n in saved)]
        created = [n for n, t in tensors if t.dtype == torch.float32]
    found = set()
    for kind, tensors in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, _ in tensors:
            declared = any(re.search(p.replace("*", ".*"), name) for p in patterns)
            if declared or any(name == c or name.endswith("." + c) for c in created):
                found.add(f"{kind} {name}")
    return found


def parameters_changed(before, model, masters_before=None, masters_after=None):
    """Every tensor of `before` changed in `model`; where the optimizer steps a master copy the
    parameters are cast from (`masters_after`, by name), a parameter changed if its master did, where
    its master before (`masters_before`) was read; otherwise the parameters are compared."""
    after = dict(model.named_parameters())
    masters_before, masters_after = masters_before or {}, masters_after or {}

    def unchanged(name, old):
        master = masters_after.get(name)
        earlier = masters_before.get(name)
        if master is not None and earlier is not None:
            return torch.equal(earlier.to(master.device), master)
        return torch.equal(old, after[name].detach().to(old.device))

    unchanged = sorted(n for n, old in before.items() if unchanged(n, old))
    compared("ParametersUnchanged", "trainable tensors unchanged", len(unchanged), 0, "0", not unchanged)
    if unchanged:
        raise CheckFailed(
            "ParametersUnchanged",
            "trainable tensors did not change in training",
            f"{len(unchanged)} of {len(before)}, first {unchanged[0]}",
        )


def finite_parameters(model, when):
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.detach().float()).all()]
    if bad:
        raise CheckFailed("NonFiniteValue", f"parameters are not finite {when}", f"{len(bad)}, first {bad[0]}")


# ---------------------------------------------------------------- the precision, as the matrix defines it


def autocast(precision):
    if precision["autocast"] is None:
        return contextlib.nullcontext()
    return torch.autocast(DEVICE_TYPE, dtype=precision["autocast"])


def eval_grad_mode():
    return torch.inference_mode() if EVAL_GRAD_MODE == "inference_mode" else torch.no_grad()


def outputs_of(result):
    """(loss, logits) of evaluate_model's result."""
    if isinstance(result, tuple):
        return result[0], result[1]
    return result, result.detach().reshape(1)


def evaluate_in(precision, model, around=None):
    """Evaluation as the precision defines it: eval mode, no_grad, its autocast."""
    model.eval()
    with eval_grad_mode(), autocast(precision) if around is None else around:
        return outputs_of(evaluate_model(model, BATCH))


def fp32_evaluation(model):
    """The same weights in an fp32 model of the kind, no autocast: the reference of every eval."""
    reference = build(FP32)
    reference.load_state_dict({name: t.float() for name, t in model.state_dict().items()})
    reference.eval()
    with torch.no_grad():
        return outputs_of(evaluate_model(reference, BATCH))


def forward_seed(step, micro=0):
    return FIRST_FORWARD_SEED + 1000 * step + micro


class SeededForwards:
    """Seeds the global generator before each training forward of `model` in the first STEPS
    steps, from forward_seed(steps applied, micro-batch): the dropout masks every engine draws
    alike. A global hook: a library's wrapper whose .module (or ._orig_mod) is the model counts."""

    def __init__(self, model):
        self.model, self.applied, self.micro, self.done = model, 0, 0, False
        self.seeded = 0  # training forwards seeded so far
        # the model's mode in its first forward: a library may train it in eval mode (dropout off)
        self.training_in_first_forward = None
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self.seed)

    def is_model(self, module):
        """The matrix's rule: the model, torch.compile's wrapper of it, or (in a compiled twin) a
        library's wrapper whose .module is the model; an eager wrapper's call (DDP's) is not
        seeded, the model's own call inside it is (seeding both would draw other masks)."""
        if module is self.model or getattr(module, "_orig_mod", None) is self.model:
            return True
        return COMPILED and getattr(module, "module", None) is self.model

    def seed(self, module, args):
        if self.done or torch.compiler.is_compiling() or not self.is_model(module):
            return
        if self.training_in_first_forward is None:
            self.training_in_first_forward = module.training
        if not module.training:
            if not self.seeded:  # trained in eval mode: no dropout draws to give
                self.stop()
            return
        torch.manual_seed(forward_seed(self.applied, self.micro))
        self.micro, self.seeded = self.micro + 1, self.seeded + 1

    def step_ended(self, applied):
        self.applied += bool(applied)
        self.micro = 0
        if self.applied >= STEPS:
            self.stop()

    def stop(self):
        self.done = True
        self.handle.remove()


def torch_step(precision, model, optimizer, scaler, max_grad_norm=None):
    """One optimizer step of the torch loop: autocast around the forward, the grad scaler around
    backward and step, micro-batches of the precision's accumulation. (loss, applied)."""
    optimizer.zero_grad(set_to_none=True)
    accumulation = precision["grad_accumulation"]
    losses = []
    for _ in range(accumulation):
        with autocast(precision):
            loss = loss_of(model, BATCH) / accumulation
        losses.append(finite_loss(loss, "training loss") * accumulation)
        (loss if scaler is None else scaler.scale(loss)).backward()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if precision["grad_dtype"] is not None:
            for _, p in named:
                if p.grad is not None and p.grad.dtype != precision["grad_dtype"]:
                    p.grad.data = p.grad.data.to(precision["grad_dtype"])
    if scaler is None:
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], max_grad_norm)
        optimizer.step()
        applied = True
    else:
        scaler.unscale_(optimizer)
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], max_grad_norm)
        overflow = any(p.grad is not None and not torch.isfinite(p.grad).all() for _, p in named)
        scaler.step(optimizer)
        scaler.update()
        applied = not overflow
    finite_parameters(model, "after the optimizer step")
    return sum(losses) / len(losses), applied


def new_optimizer(model, decayed=None):
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if decayed is None:
        return torch.optim.AdamW([p for _, p in trainable], lr=LEARNING_RATE)
    groups = [
        {"params": [p for n, p in trainable if n in decayed]},
        {"params": [p for n, p in trainable if n not in decayed], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=LEARNING_RATE)


def new_scaler(precision):
    return torch.amp.GradScaler(DEVICE_TYPE) if precision["grad_scaler"] else None


def take_steps(step, steps):
    """step() -> (loss, applied) until `steps` were applied: every attempt's (loss, applied)."""
    attempts = []
    while sum(applied for _, applied in attempts) < steps:
        if len(attempts) == MAX_STEP_ATTEMPTS:
            raise CheckFailed("NonFiniteValue", "gradients kept overflowing: the grad scaler skipped every step")
        attempts.append(step())
    return attempts


def torch_loop_curve(precision):
    """The torch loop's losses over the first STEPS applied steps in `precision`, on a fresh
    model: the reference of every engine's curve (the matrix's reference_curve)."""
    with torch.random.fork_rng(devices=RNG_DEVICES):
        model = build(precision)
        optimizer = new_optimizer(model, DECAYED(model))
        scaler = new_scaler(precision)
        model.train()
        seeds = SeededForwards(model)
        try:

            def step():
                taken = torch_step(precision, model, optimizer, scaler, MAX_GRAD_NORM)
                seeds.step_ended(taken[1])
                return taken

            return [loss for loss, applied in take_steps(step, STEPS) if applied]
        finally:
            seeds.stop()


def seeded_training_loss(precision, model):
    """The loss as the first training forward measures it: train mode, autocast, the draws of
    FIRST_FORWARD_SEED, no gradients."""
    was = model.training
    model.train()
    try:
        with torch.no_grad(), autocast(precision), torch.random.fork_rng(devices=RNG_DEVICES):
            torch.manual_seed(FIRST_FORWARD_SEED)
            return float(loss_of(model, BATCH).float().item())
    finally:
        model.train(was)


def half_dtype_of(values):
    """The half dtype every finite value is exactly a number of (the losses were handed over in
    it; an fp32 loss lands on a bfloat16 number with probability 2^-16), else None."""
    finite = torch.tensor([v for v in values if math.isfinite(v)], dtype=torch.float64)
    if len(finite) == 0 or not torch.equal(finite.float().double(), finite):
        return None
    for dtype in (torch.bfloat16, torch.float16):
        normal = (finite == 0).logical_or(finite.abs() >= torch.finfo(dtype).tiny).all()
        if torch.equal(finite.float().to(dtype).double(), finite) and bool(normal):
            return dtype
    return None


def half_step(dtype, around):
    """Half the spacing of `dtype`'s numbers at `around` (0 for None: a float32 curve)."""
    if dtype is None or around == 0 or not math.isfinite(around):
        return 0.0
    return 2.0 ** (math.floor(math.log2(abs(around))) - {torch.bfloat16: 7, torch.float16: 10}[dtype]) / 2


def curve_within(name, losses, reference, row, what):
    """Step s (1-based) may differ by atol + rtol * |reference| + per_step * (s - 1), plus half a
    step of a half dtype at the larger loss for each side whose losses are all numbers of it (as
    the matrix: it judges the arithmetic, not the rounding of the number an engine reports)."""
    first_outside, worst_share = None, 0.0
    rounded = [half_dtype_of(losses), half_dtype_of(reference)]
    for side, dtype in zip(("losses", "reference"), rounded, strict=True):
        if dtype is not None:
            print(f"       the {what} comparison's {side} are {dtype} numbers: half a step of it added per step")
    for step, (loss, ref) in enumerate(zip(losses, reference, strict=False), start=1):
        allowed = row["atol"] + row["rtol"] * abs(ref) + row["per_step"] * (step - 1)
        allowed += sum(half_step(dtype, max(abs(loss), abs(ref))) for dtype in rounded)
        share = abs(loss - ref) / allowed if allowed else math.inf
        worst_share = max(worst_share, share)
        held = abs(loss - ref) <= allowed
        compared(name, f"{what}, step {step}", loss, ref, f"{allowed:.3g}", held)
        if not held and first_outside is None:
            first_outside = step
    if len(losses) < len(reference):
        first_outside = first_outside or len(losses) + 1
    if first_outside is not None:
        return CheckFailed(
            "CurveDiverged",
            f"the training loss curve leaves the {what}'s at step {first_outside}",
            f"losses {losses} against {reference}",
        )
    print(f"       the worst step used {worst_share:.0%} of its allowance")
    return None


def model_holding(weights, into=None):
    """A model of the kind in the cell's precision holding `weights` (a full state dict) in their
    own dtypes: a tensor of another dtype than the fresh model's replaces its data."""
    model = build(CELL) if into is None else into
    found = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, tensor in weights.items():
            target = found.get(name)
            if target is None or not target.is_floating_point():
                continue
            value = tensor.to(DEVICE)
            if target.dtype == value.dtype and target.shape == value.shape:
                target.copy_(value)
            else:
                target.data = value
    return model
