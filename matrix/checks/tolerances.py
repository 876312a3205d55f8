"""Numeric tolerances, as data.

Evaluation loss of a cell vs an fp32 reference computed from the same weights on the same
batch. Rows are keyed by the precision's compute dtype (the lowest dtype its matmuls run
in); a model kind may override a row. A value passes when |x - ref| <= atol + rtol * |ref|.
The deviation is recorded even when it passes; `python -m matrix diff` calls its growth
between two runs drift when it exceeds a fraction of the allowance (matrix/results/compare.py).

Unit roundoff: fp16 2**-11 ~ 4.9e-4, bf16 2**-8 ~ 3.9e-3. The rows leave room for the
accumulation over two tiny layers, not for a wrong answer: a cross entropy near ln(vocab)
~ 4.6 that is off by more than a few percent is a bug, not rounding.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from matrix.results.curves import DEFAULT_FAMILY, FP32_TWIN, TORCH_ENGINE, CurveTolerance


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def allows(self, value: float, reference: float) -> bool:
        return abs(value - reference) <= self.atol + self.rtol * abs(reference)

    def as_dict(self) -> dict[str, float]:
        return {"atol": self.atol, "rtol": self.rtol}


EVAL_LOSS_VS_FP32: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
    # float8 training (matrix/precisions/float8.py): its converted matmuls in e4m3 over bf16 compute.
    # Measured (issue 37, eval losses 3.5-5.5, every passing cell of tiny-llama and gemma-cache in
    # the four single-process engines and their compiled twins), largest |eval loss - fp32|: on
    # the CPU (torch 2.13.0, torchao 0.18.0) tensorwise 1.7e-3, rowwise 2.9e-3, rowwise_with_gw_hp
    # 3.1e-3; on an H200 (torch 2.11.0, torchao 0.17.0) 3.6e-3, 2.1e-3 and 5.6e-3 (bf16-mixed:
    # 3.2e-4 and 9.1e-4). The row allows 4 to 6 times the largest at those losses. By torchao's
    # own measure (metrics.logits_sqnr_db, the logits at real positions against fp32's; CPU) the
    # float8 cells gave 20.6 to 41 dB, bf16-mixed 42.8 to 54 dB: above torchao's 18 dB bar for a
    # Linear's output, below its 25 dB for a cast, for a whole model's output through two layers.
    torch.float8_e4m3fn: Tolerance(atol=5e-3, rtol=5e-3),
}

# (model kind, compute dtype) -> Tolerance, for a kind that needs its own row. The pretrained
# minilm-bert needs none: measured on CPU (torch 2.13.0, eval loss 1.0984), its largest
# deviations from fp32 were 3.2e-3 in bf16-true (allowed 4.2e-2) and 2.2e-4 in fp16-true
# (allowed 1.05e-2); with fp32 master weights 5e-5 or less.
MODEL_OVERRIDES: dict[tuple[str, torch.dtype], Tolerance] = {}

# A quantized base (matrix/precisions/quantization.py) is measured twice. Its eval loss against the same
# quantized weights multiplied in fp32 (the precision's own error) takes the row of its compute
# dtype above. Against the unquantized fp32 model with the same adapters (the quantization's
# error) it takes the row of its scheme here. Measured on CPU (bitsandbytes 0.50.2, torch
# 2.13.0, eval losses 3.9-4.6), largest |eval loss - unquantized fp32 loss| over every engine:
# nf4 1.07e-2 (qlora, bf16 compute; 9.0e-3 with fp16 compute), int8 2.6e-4 (lora). The rows
# allow about 5x (nf4) and 40x (int8) that at those losses. fp4 is run by no precision yet: it
# has nf4's row until one measures it. The int8 figure is the AVX512 path's (torch._int_mm, an
# exact int8 product). Without AVX-512, bitsandbytes 0.50 computes the product in fp16 under the
# torch loop's fp16 autocast. There qlora's evaluation measured 1.9e-2 and lora's 1.6e-3 (issue
# 46, ATEN_CPU_CAPABILITY=avx2). That is a bug, not rounding the row should allow: it is the
# catalogue's bnb-cpu-int8-product-autocast-to-fp16-without-avx512. The engines that do not
# autocast to fp16 on a CPU measured the same on both paths.
QUANTIZED_VS_UNQUANTIZED: dict[str, Tolerance] = {
    "nf4": Tolerance(atol=1e-2, rtol=1e-2),
    "fp4": Tolerance(atol=1e-2, rtol=1e-2),
    "int8": Tolerance(atol=2e-3, rtol=2e-3),
}

# A checkpoint reloaded into a fresh model must reproduce the outputs bit for bit: the same
# weights in the same dtype run the same kernels on the same batch.
CHECKPOINT_ROUND_TRIP = Tolerance(atol=0.0, rtol=0.0)


# A resumed step k+1 against the uninterrupted run's (matrix/harness/resume.py). Where the device steps
# deterministically (the CPU: Device.deterministic_steps) both compare bit for bit and these rows
# are not used. On a device whose kernels are not deterministic (CUDA: atomic adds in backward),
# the same weights give losses within `loss` of each other, and one AdamW step from the same
# state moves every tensor to within `tensors` of the other's: a gradient differing in its last
# bits moves an update by about that share of the learning rate, and a half-precision weight may
# round one ulp apart (bf16 2**-8, fp16 2**-11 relative). A lost optimizer state moves an update
# by the whole learning rate, and it is caught exactly anyway (resume.check_restored). Not yet
# measured on a GPU: no GPU was lent when these rows were written.
@dataclass(frozen=True)
class ResumeTolerance:
    loss: Tolerance
    tensors: Tolerance


RESUME_VS_UNINTERRUPTED: dict[torch.dtype, ResumeTolerance] = {
    torch.float32: ResumeTolerance(loss=Tolerance(atol=1e-6, rtol=1e-6), tensors=Tolerance(atol=1e-6, rtol=1e-5)),
    torch.float16: ResumeTolerance(loss=Tolerance(atol=1e-3, rtol=1e-3), tensors=Tolerance(atol=1e-4, rtol=2e-3)),
    torch.bfloat16: ResumeTolerance(loss=Tolerance(atol=1e-2, rtol=1e-2), tensors=Tolerance(atol=1e-4, rtol=1e-2)),
    # float8: its scales come from the same tensors on both sides, so a step differs as bf16's does
    # (bf16's row; the float8 train cells on the H200 resumed within it)
    torch.float8_e4m3fn: ResumeTolerance(loss=Tolerance(atol=1e-2, rtol=1e-2), tensors=Tolerance(atol=1e-4, rtol=1e-2)),
}

# A compiled twin's evaluation loss against its eager twin's (matrix/harness/compiling.py): the same
# weights, the same batch. Inductor fuses operations and keeps intermediates in fp32 where eager
# rounds them to the autocast dtype (pytorch/pytorch#181568), so the two differ by rounding, not
# bit for bit: Inductor's emulate_precision_casts made bf16-mixed bit-identical on the CPU in the
# issue's probe but not on CUDA (logits 2e-3 apart), and users do not set it. Measured (issue 37,
# eval losses 3.5-5.5, tiny-llama and gemma-cache, every passing compiled cell of the four
# twins), largest |compiled - eager| loss, CPU (torch 2.13.0) / H200 (torch 2.11.0): fp32 0 /
# 6.9e-6; fp16-mixed 2.6e-4 / 2.0e-4; bf16-mixed 6.6e-4 / 4.5e-4; bf16-true 1.0e-3 / 3.6e-4;
# float8 1.8e-3 / 3.6e-3 (their logits up to 0.028 apart). Each row allows 4 to 6 times the
# largest at those losses, 5 to 20 times less than the rows against fp32 above. The distributed
# twins (ddp-compile, fsdp2-compile, accelerate-fsdp2-compile; CPU, the same kinds and
# precisions, 84 cells) stay within them but for one: accelerate-fsdp2 gives the loss in fp16
# (its FSDP2 policy casts the forward's outputs, the loss too, to output_dtype), where one ulp at
# a loss of 3.6 is 2**-9 = 2.0e-3, and gemma-cache's fp16-mixed train cell measured 1.8e-3
# (largest otherwise: fp32 4.8e-7, fp16 1.0e-4, bf16 8.4e-4, float8 2.6e-3). The fp16 row's rtol
# is therefore one fp16 ulp (2**-10 relative, 1e-3: Inductor's own fp16 rtol), not a multiple of
# what a loss computed in fp32 measured.
COMPILED_VS_EAGER: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.float16: Tolerance(atol=3e-4, rtol=1e-3),
    torch.bfloat16: Tolerance(atol=1e-3, rtol=1e-3),
    torch.float8_e4m3fn: Tolerance(atol=4e-3, rtol=4e-3),
}


# ---------------------------------------------------------------- loss-curve rows
# A training cell's loss curve against a reference curve, step by step (matrix/results/curves.py): step s
# (1-based) may differ by atol + rtol * |reference| + per_step * (s - 1). A row is chosen by the
# reference (the torch engine at the same precision, the fp32 twin), by the engine's curve family
# (curves.FAMILIES, from its traits: engines whose library legitimately computes the update another
# way, as DeepSpeed's optimizers stepping fp32 master weights of a half-precision module do), and
# by the dtype the run computed in (its precision's compute dtype, or the coarser autocast it was
# seen in) or, against the fp32 twin, a quantized base's scheme.
#
# The rows are derived, not written: matrix/checks/curve_spread.json holds, per reference, family and
# row, the largest deviation right engines measured (python -m matrix.tools.curve_spread, from the
# results.json of runs at the default curve length; how, in that file and docs/loss-curves.md).
# Every row has one shape, CURVE_FORM, scaled: k at step 1 and k more per step after it. Two right
# arithmetics part by what each update rounds differently, about as much again every step, and not
# by the size of the loss: the right engines' largest deviations were as large on tiny-transformer
# (losses 1.2 to 0.2) as on the kinds near 4.6, so a part that grows with |reference| would let
# those kinds' curves stray the furthest (it made DeepSpeed 0.18.5's tiny-llama curve 1.2x its
# row where this shape makes it 2x, and a right engine over 8 steps 1.4x where it is 0.8x). k is
# CURVE_SAFETY times the largest measured deviation in units of the shape, never below
# CURVE_ROW_FLOOR: a row allows twice what the right engines of its family did, at the step they
# did it. A library that applies another update (a gradient never zeroed: DeepSpeed 0.18.3-0.18.5's
# ZeRO-0 in bf16) leaves it at the step the update shows, with the default curve length. Where a
# family has no measurement for a row, it takes the default family's.
CURVE_SPREAD_FILE = Path(__file__).with_name("curve_spread.json")
CURVE_SAFETY = 2.0
# a loss is an fp32 number: a row never allows less than a few of its ulps, even where every right
# engine matched its reference bit for bit
CURVE_ROW_FLOOR = 4 * torch.finfo(torch.float32).eps
# a scheme no precision runs yet takes the row of a scheme that was measured
CURVE_ROW_ALIASES = {"fp4": "nf4"}


# the shape of every derived row, up to its scale k: atol k, per_step k (k x the step)
CURVE_FORM = CurveTolerance(atol=1.0, rtol=0.0, per_step=1.0)


def curve_form(step: int, reference: float) -> float:
    """What a row allows at step s of a reference loss, in units of its scale k (CURVE_FORM)."""
    return CURVE_FORM.allowed(step, reference)


def curve_row_dtype(compute_dtype: torch.dtype, observed_autocast: str | None) -> torch.dtype:
    """The dtype a training cell's curve is judged in: its precision's compute dtype, or the coarser
    autocast its run was seen computing in (results.json effective.autocast_dtype_in_forward:
    Lightning runs 16-mixed as bf16 on a CPU, and a curve computed in bf16 is judged by bf16's row)."""
    dtype = getattr(torch, observed_autocast, None) if isinstance(observed_autocast, str) else None
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        if torch.finfo(dtype).eps > torch.finfo(compute_dtype).eps:
            return dtype
    return compute_dtype


def curve_row_key(compute_dtype: torch.dtype, quantization: str | None = None) -> str:
    """The row's name in matrix/checks/curve_spread.json: a quantized base's scheme (against the fp32 twin),
    else the compute dtype's name (bfloat16)."""
    if quantization is not None:
        return CURVE_ROW_ALIASES.get(quantization, quantization)
    return str(compute_dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CurveSpread:
    """The largest deviation right engines of one family measured against one reference, in one
    row: where (a cell of a run, a step, the reference's loss there) and how much."""

    reference: str  # curves.TORCH_ENGINE or curves.FP32_TWIN
    family: str  # curves.FAMILIES (engines/traits.py curve_family)
    row: str  # curve_row_key()
    deviation: float
    step: int
    reference_loss: float
    cell: str
    comparisons: int  # how many comparisons of right engines the largest is the largest of

    @property
    def share_of_form(self) -> float:
        return self.deviation / curve_form(self.step, self.reference_loss)

    def derived_row(self) -> CurveTolerance:
        """CURVE_SAFETY times this spread, in the shape every row has (CURVE_FORM), never below
        CURVE_ROW_FLOOR; its scale rounded up to two significant digits, so a row reads as a number
        and allows at least that."""
        k = max(CURVE_SAFETY * self.share_of_form, CURVE_ROW_FLOOR)
        digits = 1 - math.floor(math.log10(k))  # decimals that keep two significant digits
        k = round(math.ceil(round(k * 10.0**digits, 9)) / 10.0**digits, digits)
        return CurveTolerance(
            atol=k * CURVE_FORM.atol,
            rtol=k * CURVE_FORM.rtol,
            per_step=k * CURVE_FORM.per_step,
            row=f"{self.family} {self.row}",  # the report's name for it: "the master-weights bfloat16 row"
        )


def load_curve_spread(path: Path = CURVE_SPREAD_FILE) -> dict[tuple[str, str, str], CurveSpread]:
    """(reference, family, row) -> the spread matrix/checks/curve_spread.json holds for it."""
    document = json.loads(Path(path).read_text())
    spread = {}
    for entry in document["spread"]:
        worst = entry["worst"]
        measured = CurveSpread(
            reference=entry["reference"],
            family=entry["family"],
            row=entry["row"],
            deviation=float(worst["deviation"]),
            step=int(worst["step"]),
            reference_loss=float(worst["reference_loss"]),
            cell=worst["cell"],
            comparisons=int(entry["comparisons"]),
        )
        spread[measured.reference, measured.family, measured.row] = measured
    return spread


CURVE_SPREAD = load_curve_spread()
# (reference, family, row) -> the row derived from its spread
CURVE_ROWS: dict[tuple[str, str, str], CurveTolerance] = {key: s.derived_row() for key, s in CURVE_SPREAD.items()}


class NoCurveRow(KeyError):
    """No right engine was measured for the row a cell needs, in its family or the default one."""


def curve_row(reference: str, row: str, family: str = DEFAULT_FAMILY) -> CurveTolerance:
    """The derived row of a reference, row key (curve_row_key) and engine family: the family's own
    where its spread was measured, else the default family's."""
    for key in ((reference, family, row), (reference, DEFAULT_FAMILY, row)):
        if key in CURVE_ROWS:
            return CURVE_ROWS[key]
    raise NoCurveRow(
        f"no measured spread of right engines against the {reference} in row {row} ({CURVE_SPREAD_FILE.name}): "
        "python -m matrix.tools.curve_spread measures it from a run of the cells that train in that row"
    )


# The kinds the spread was measured on (curve_spread.json "kinds"): a derived row holds for them.
# How far the right engines of another model part (an hf: architecture, a user's model) nothing
# measured: the every-engine sweep's architectures left the derived rows in 93 of 123 comparisons
# where these rows held them (issue 47: mbart's bf16-true curve 4.6x the torch family's row against
# its fp32 twin, the torch engine's own). Such a kind is judged by the rows written before any
# measurement (issue 38: about twice the largest deviation of 322 cells of the default kinds over 8
# steps, atol + rtol * |reference| + per_step * (s - 1)), named so in every report; measuring the
# architectures' spread (python -m matrix.tools.curve_spread over a sweep) is what tightens them.
MEASURED_KINDS = frozenset(json.loads(CURVE_SPREAD_FILE.read_text()).get("kinds", []))
UNMEASURED_KIND_ROWS: dict[tuple[str, str], CurveTolerance] = {
    (TORCH_ENGINE, "float32"): CurveTolerance(atol=1e-5, rtol=1e-5, per_step=0.0, row="unmeasured-kind float32"),
    (TORCH_ENGINE, "float16"): CurveTolerance(atol=1e-3, rtol=1e-3, per_step=1e-3, row="unmeasured-kind float16"),
    (TORCH_ENGINE, "bfloat16"): CurveTolerance(atol=5e-3, rtol=5e-3, per_step=2e-3, row="unmeasured-kind bfloat16"),
    (TORCH_ENGINE, "float8_e4m3fn"): CurveTolerance(
        atol=2e-2, rtol=1e-2, per_step=1e-2, row="unmeasured-kind float8_e4m3fn"
    ),
    (FP32_TWIN, "float16"): CurveTolerance(atol=2e-3, rtol=1e-3, per_step=1e-3, row="unmeasured-kind float16"),
    (FP32_TWIN, "bfloat16"): CurveTolerance(atol=1e-2, rtol=5e-3, per_step=3e-3, row="unmeasured-kind bfloat16"),
    (FP32_TWIN, "float8_e4m3fn"): CurveTolerance(
        atol=3e-2, rtol=1e-2, per_step=1e-2, row="unmeasured-kind float8_e4m3fn"
    ),
    (FP32_TWIN, "nf4"): CurveTolerance(atol=1e-2, rtol=5e-3, per_step=3e-3, row="unmeasured-kind nf4"),
    (FP32_TWIN, "int8"): CurveTolerance(atol=5e-3, rtol=2e-3, per_step=1e-3, row="unmeasured-kind int8"),
}


def kind_row(reference: str, row: str, family: str, kind: str | None) -> CurveTolerance:
    """The row a kind's curve is judged by: derived (curve_row) for a kind the spread measured, or
    for no kind named; the unmeasured kind's row for any other."""
    if kind is not None and kind not in MEASURED_KINDS and (reference, row) in UNMEASURED_KIND_ROWS:
        return UNMEASURED_KIND_ROWS[reference, row]
    return curve_row(reference, row, family)


def curve_vs_torch_engine(
    compute_dtype: torch.dtype, family: str = DEFAULT_FAMILY, kind: str | None = None
) -> CurveTolerance:
    return kind_row(TORCH_ENGINE, curve_row_key(compute_dtype), family, kind)


def curve_vs_fp32_twin(
    compute_dtype: torch.dtype, quantization: str | None, family: str = DEFAULT_FAMILY, kind: str | None = None
) -> CurveTolerance:
    if quantization is None and compute_dtype == torch.float32:
        # an fp32 run's fp32 twin is the torch engine's fp32 run (such a cell is not compared with it twice)
        return curve_vs_torch_engine(compute_dtype, family, kind)
    return kind_row(FP32_TWIN, curve_row_key(compute_dtype, quantization), family, kind)


def compiled_vs_eager_tolerance(compute_dtype: torch.dtype) -> Tolerance:
    return COMPILED_VS_EAGER[compute_dtype]


def resume_tolerance(compute_dtype: torch.dtype) -> ResumeTolerance:
    return RESUME_VS_UNINTERRUPTED[compute_dtype]


def relative_fall(before: float, after: float) -> float:
    """(before - after) / before: how far a loss fell, as a fraction of where it started."""
    return (before - after) / before if before else 0.0


@dataclass(frozen=True)
class LossDecrease:
    """How much the training loss on the fixed batch must fall over training: (loss before -
    loss after) / loss before >= min_relative, both measured the same way (measurements.
    seeded_training_loss). A precision path that runs but does not learn fails it."""

    min_relative: float

    def allows(self, before: float, after: float) -> bool:
        return before > 0 and relative_fall(before, after) >= self.min_relative


# Established from fp32 (torch 2.13.0 CPU, AdamW lr 1e-2, 3 applied steps, the loss before and
# after training measured alike): tiny-transformer fell by 91%, tiny-llama 24%, gemma-cache 21%,
# liger-llama 24%, lora 2.0% (its B matrices start at zero, so the first update moves little).
# Every passing cell of every engine and precision fell within 1.2 points of its kind's fp32
# figure (CPU grid, 2026-11-23); on an H100 the slowest passing cells were lora's at 2.0% too.
# minilm-bert (pretrained, its own learning rate 1e-4, dropout 0.1) fell 16% in fp32,
# bf16-mixed and fp16-mixed alike. The bound sits below the slowest learner's figure with room
# for rounding, and far above "did not learn".
TRAINING_LOSS_DECREASE = LossDecrease(min_relative=0.005)
# model kind -> LossDecrease, for a kind that learns differently (a pretrained model, say)
LOSS_DECREASE_OVERRIDES: dict[str, LossDecrease] = {}

# The bound above is what fp32 must fall by: a kind that does not learn in fp32 at its learning
# rate (matrix/harness/learning_rate.py) is one finding, on its fp32 cells. Every other precision is
# judged against its fp32 twin: its fall must be at least this share of the twin's (fp32, the
# torch engine, the same learning rate, steps and measurement). Every passing cell fell within
# 1.2 points of its kind's fp32 figure (the comment above): a quarter leaves room for half
# precision's rounding of small updates (lora, 2.0% in fp32, is bounded at 0.5% as before) and
# fails a precision path that trains but does not learn.
LOSS_FALL_VS_FP32 = 0.25


def loss_decrease_bound(model: str) -> LossDecrease:
    return LOSS_DECREASE_OVERRIDES.get(model, TRAINING_LOSS_DECREASE)


def eval_loss_tolerance(model: str, compute_dtype: torch.dtype) -> Tolerance:
    return MODEL_OVERRIDES.get((model, compute_dtype), EVAL_LOSS_VS_FP32[compute_dtype])
