"""torch.compile and float8 training (issue 37; docs/compile-and-float8.md): the compiled twins
of the engines, what the harness records of Dynamo and holds a compiled cell to, the float8
precisions' conversion and its record. `nox -s compile` runs this file with torchao installed;
the tests that compile a real model or convert one are its cost, and skip elsewhere."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from matrix.catalogue.entries import Entry
from matrix.engines import ENGINES
from matrix.execute.cell_run import run_cell
from matrix.grid.cell import Cell
from matrix.harness import compiling
from matrix.models import MODELS
from matrix.precisions import float8
from matrix.precisions.policies import FLOAT8_COMPUTE, PRECISIONS
from matrix.selection.cells import parse_selection

needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="Requires: [torchao] (not installed: pip install '.[float8]')",
)
FLOAT8 = ("float8-tensorwise", "float8-rowwise", "float8-rowwise-gw-hp")
BUILT_IN = (
    "torch", "accelerate", "hf-trainer", "lightning", "ddp", "fsdp2", "accelerate-fsdp2",
    "deepspeed-zero0", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3", "hf-trainer-zero2", "hf-trainer-zero3",
)  # fmt: skip
COMPILED = tuple(f"{name}-compile" for name in BUILT_IN)


# ---------------------------------------------------------------- the axes


def test_every_built_in_engine_has_a_compiled_twin_that_runs_only_where_named():
    for twin in COMPILED:
        engine = ENGINES[twin]
        assert engine.compiled and engine.eager_twin == twin.removesuffix("-compile")
        assert engine.compile_how and engine.compile_how == ENGINES[engine.eager_twin].compile_how
        assert engine.distributed == ENGINES[engine.eager_twin].distributed
        assert not ENGINES[engine.eager_twin].compiled
    default = parse_selection("engine", None)
    assert not set(COMPILED) & set(default)
    assert set(BUILT_IN) <= set(default)
    assert parse_selection("engine", "torch-compile,torch") == ("torch", "torch-compile")


@pytest.mark.parametrize("engine", ["hf-trainer", "hf-trainer-zero2", "hf-trainer-zero3"])
def test_the_trainer_twins_are_told_in_training_arguments(engine):
    """Each Trainer twin's settings carry torch_compile=True (TrainingArguments reads them). The
    DeepSpeed Trainers once lost it with their own settings type, and their twins compiled nothing
    (test_a_twin_whose_library_compiles_nothing_fails_not_compiled)."""
    assert ENGINES[f"{engine}-compile"].settings(PRECISIONS["bf16-mixed"])["torch_compile"] is True
    assert ENGINES[f"{engine}-compile"].settings(PRECISIONS["bf16-mixed"])["bf16"] is True
    assert "torch_compile" not in ENGINES[engine].settings(PRECISIONS["bf16-mixed"])


def test_float8_rows_run_bf16_autocast_over_fp32_weights_and_need_torchao():
    for name in FLOAT8:
        precision = PRECISIONS[name]
        assert precision.weights_dtype == torch.float32 and precision.autocast_dtype == torch.bfloat16
        assert precision.compute_dtype == FLOAT8_COMPUTE
        assert precision.requires == (float8.REQUIREMENT,)
        assert precision.settings()["float8"]["recipe"] == precision.float8.recipe
    assert {PRECISIONS[n].float8.recipe for n in FLOAT8} == set(float8.RECIPES)
    with pytest.raises(ValueError, match="float8 recipe"):
        float8.Float8("delayed")


def test_accelerate_is_told_fp8_with_torchao_and_converts_itself():
    settings = ENGINES["accelerate"].settings(PRECISIONS["float8-rowwise"])
    assert settings == {"mixed_precision": "fp8", "fp8_backend": "ao", "fp8_recipe": "rowwise"}
    assert ENGINES["accelerate"].converts_float8 and not ENGINES["torch"].converts_float8


def test_accelerate_fsdp2_is_told_fp8_with_torchao_over_bf16_parameters():
    settings = ENGINES["accelerate-fsdp2"].settings(PRECISIONS["float8-tensorwise"])
    assert settings["mixed_precision"] == "fp8" and settings["fp8_backend"] == "ao"
    assert settings["fp8_recipe"] == "tensorwise"
    assert settings["mixed_precision_policy"]["param_dtype"] == "bfloat16"
    assert ENGINES["accelerate-fsdp2"].converts_float8 and not ENGINES["fsdp2"].converts_float8


def test_without_torchao_float8_cells_skip_naming_it(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, package=None: None if name == "torchao" else find_spec(name, package)
    )
    reason = MODELS["tiny-llama"].precision_skip_reason(PRECISIONS["float8-rowwise"])
    assert reason.startswith("Requires: [torchao >= 0.13.0] (not installed: pip install '.[float8]'")
    assert MODELS["tiny-llama"].precision_skip_reason(PRECISIONS["bf16-mixed"]) is None


def test_a_catalogue_entry_of_an_engine_holds_for_its_compiled_twin_unless_it_names_the_twin():
    def entry(selector):
        return Entry(
            id="e",
            title="t",
            kind="bug",
            upstream=(),
            signature=__import__("re").compile("x"),
            selectors=({key: frozenset(values) for key, values in selector.items()},),
            versions={},
            workaround="w",
        )

    eager_cell = Cell("tiny-llama", "bf16-mixed", "train", "cpu", "torch")
    twin_cell = Cell("tiny-llama", "bf16-mixed", "train", "cpu", "torch-compile")
    assert entry({"engine": ["torch"]}).selects(eager_cell, frozenset())
    assert entry({"engine": ["torch"]}).selects(twin_cell, frozenset())
    assert entry({"engine": ["torch-compile"]}).selects(twin_cell, frozenset())
    assert not entry({"engine": ["torch-compile"]}).selects(eager_cell, frozenset())
    assert not entry({"not_engine": ["torch"]}).selects(twin_cell, frozenset())
    assert entry({"not_engine": ["torch-compile"]}).selects(eager_cell, frozenset())


# ---------------------------------------------------------------- what the harness watches


def test_a_step_that_compiles_a_new_graph_fails_recompiled():
    """A guard that fails on every step (a Python number the forward reads, changed by the loop,
    as a hand-written loop that passes its step count does): the second step compiles again."""
    linear = torch.nn.Linear(4, 4)

    def forward(x, step):
        return linear(x) * step

    compiled = torch.compile(forward, backend="eager", dynamic=False)
    watch = compiling.Watch.begin()
    watch.training_started()
    for step in (1, 2, 3):
        compiled(torch.ones(2, 4), step)
        watch.step_ended()
    watch.training_ended()
    assert watch.per_step[0] == 1 and sum(watch.per_step[1:]) >= 1
    with pytest.raises(compiling.Recompiled, match="training steps after the first compiled new graphs"):
        watch.check_steps()
    assert any("step" in reason for reason in watch.record()["recompile_reasons"])


def test_steps_that_reuse_the_graph_pass_and_a_graph_break_is_recorded():
    def forward(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    compiled = torch.compile(forward, backend="eager")
    watch = compiling.Watch.begin()
    watch.training_started()
    for _ in range(3):
        compiled(torch.ones(3))
        watch.step_ended()
    watch.training_ended()
    watch.check_steps()
    record = watch.record()
    assert record["graphs_per_training_step"][1:] == [0, 0]
    assert sum(record["graph_breaks"].values()) >= 1


def test_a_twin_whose_library_compiles_nothing_fails_not_compiled():
    """A compiled twin whose forwards all ran eagerly (its library was never told to compile, as
    the DeepSpeed Trainers' twins were): NotCompiled, not a pass."""
    linear = torch.nn.Linear(4, 4)
    watch = compiling.Watch.begin()
    linear(torch.ones(2, 4))
    with pytest.raises(compiling.NotCompiled, match="compile was asked for and training compiled no graph"):
        watch.check_compiled("training")
    torch.compile(linear, backend="eager")(torch.ones(2, 4))
    watch.check_compiled("training")


def test_the_harness_hooks_give_layers_compiled_in_place_one_graph(tmp_path):
    """FSDP2's and accelerate's regional compile compile each layer in place. The harness's
    first-forward hooks run inside those graphs; what they read there becomes guards. Asking which
    module fired (an identity) gave each of tiny-llama's two layers a graph of its own, and removing
    a hook after its first eager call made step 2 compile again. With the hooks as they are, the
    layers share one graph and later steps compile nothing, as without the hooks."""
    from matrix.harness.cell_state import CellState
    from matrix.harness.measurements import effective_settings, seed_first_training_forward, watch_first_forward
    from matrix.results.metrics import CellMetrics

    cell = Cell("tiny-llama", "bf16-mixed", "train", "cpu", "fsdp2-compile")
    precision = PRECISIONS["bf16-mixed"]
    state = CellState(cell, MODELS["tiny-llama"], precision, torch.device("cpu"), tmp_path, CellMetrics())
    state.engine = ENGINES["fsdp2-compile"]
    model = state.kind.build(precision, state.device, tmp_path)
    state.metrics.effective = effective_settings(state, model)
    state.batch = state.kind.batch(state.device)
    watch = compiling.Watch.begin()
    watch_first_forward(state, model)
    seed_first_training_forward(state, model)
    layers = [layer for module in model.modules() if isinstance(module, torch.nn.ModuleList) for layer in module]
    assert len(layers) == 2
    for layer in layers:
        layer.compile(backend="eager")
    try:
        watch.training_started()
        for _ in range(3):
            with state.autocast():
                state.kind.loss(model.train(), state.batch).backward()
            watch.step_ended()
        watch.training_ended()
    finally:
        state.hooks.remove()
    assert watch.per_step == [1, 0, 0], watch.record()["recompile_reasons"]
    assert state.metrics.effective.autocast_dtype_in_forward == "bfloat16"
    assert state.metrics.effective.model_training_in_first_forward is True


def test_plain_unwraps_what_torch_compile_wrapped():
    linear = torch.nn.Linear(2, 2)
    assert compiling.plain(torch.compile(linear)) is linear
    assert compiling.plain(linear) is linear


# ---------------------------------------------------------------- float8's conversion


@needs_torchao
def test_float8_leaves_out_the_first_and_last_linear_and_odd_sizes():
    model = MODELS["tiny-llama"].initialise()
    names = float8.linear_names(model)
    reasons = float8.left_out(model)
    assert reasons[names[0]] == "the first Linear layer" and reasons[names[-1]] == "the last Linear layer"
    odd = torch.nn.Sequential(
        torch.nn.Linear(16, 16), torch.nn.Linear(16, 24), torch.nn.Linear(24, 16), torch.nn.Linear(16, 16)
    )
    assert float8.left_out(odd)["1"].startswith("16 x 24 features")
    float8.convert(model, float8.Float8("rowwise"))
    record = float8.record(model)
    assert record["converted"] == [n for n in names if n not in reasons]
    assert set(record["left_out"]) == set(reasons)


@needs_torchao
def test_a_converted_models_state_dict_reloads_into_a_fresh_converted_model_bit_for_bit():
    kind = MODELS["tiny-llama"]
    precision = float8.Float8("tensorwise")
    trained = float8.convert(kind.initialise(), precision)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.01)
    fresh = float8.convert(kind.initialise(), precision)
    fresh.load_state_dict(trained.state_dict())
    batch = kind.batch(torch.device("cpu"))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(kind.evaluate(trained.eval(), batch).logits, kind.evaluate(fresh.eval(), batch).logits)


def test_sqnr_is_torchaos_measure():
    reference = torch.tensor([3.0, 4.0])
    assert float8.sqnr_db(reference, reference) is None
    assert float8.sqnr_db(reference, reference * 1.1) == pytest.approx(20.0)


# ---------------------------------------------------------------- cells


@needs_torchao
@pytest.mark.parametrize("precision", ["bf16-mixed", "float8-rowwise"])
def test_a_compiled_cell_runs_the_pipeline_and_agrees_with_its_eager_twin(tmp_path, precision):
    result = run_cell(Cell("tiny-llama", precision, "train", "cpu", "torch-compile"), tmp_path)
    assert result.outcome == "passed", result.message
    compiled = result.metrics.compiled
    assert compiled.graphs_per_training_step[0] >= 1 and compiled.graphs_per_training_step[1:] == [0, 0]
    assert compiled.frames_run_eagerly == 0 and compiled.graph_breaks == {}
    assert compiled.eager_logits_dtype == result.metrics.eval_logits_dtype
    assert (
        compiled.eager_deviation_abs
        <= compiled.eager_tolerance.atol + compiled.eager_tolerance.rtol * compiled.eager_loss
    )
    if precision.startswith("float8"):
        assert result.metrics.float8.converted and result.metrics.logits_sqnr_db is not None
