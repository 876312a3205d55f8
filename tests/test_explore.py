"""Exploration: the strategies draw only valid variants that run in fp32, a search finds and
shrinks the encoder fast-path failure to its one needed setting, a recorded finding replays
to the same signature, and the report carries the explorations."""

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from matrix.catalogue import entries as catalogue
from matrix.devices import fingerprint as environment
from matrix.engines import ENGINES
from matrix.execute.cell_run import run_cell
from matrix.explore.exploration import Budget, Search, explore, simplify, why_needed
from matrix.explore.strategies import base_variant, explored_fields, variants
from matrix.grid.cell import Cell
from matrix.grid.variants import Variant, from_json, to_json
from matrix.models import MODELS
from matrix.results.files import SCHEMA_FILE

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # a test about skipped cuda cells makes them skip, GPU or not
BUILT_IN = ("tiny-transformer", "tiny-llama", "lora", "gemma-cache")
SCHEMA = json.loads(SCHEMA_FILE.read_text())
ENCODER_TARGET = Cell("tiny-transformer", "bf16-mixed", "eval", "cpu", "torch")


@settings(max_examples=300)
@given(data=st.data(), model=st.sampled_from(BUILT_IN), engine=st.sampled_from(tuple(ENGINES)))
def test_every_drawn_variant_is_valid_for_its_model_and_engine(data, model, engine):
    kind = MODELS[model]
    variant = data.draw(variants(kind, ENGINES[engine]))
    kind.check_variant(variant)  # raises InvalidVariant for an invalid draw
    # only the fields the kind reads and the engine implements are drawn
    for name in set(Variant.__dataclass_fields__) - set(explored_fields(kind, ENGINES[engine])) - {"pad_counts"}:
        assert getattr(variant, name) == getattr(kind.grid_variant, name), name
    assert variant.batch_size == len(variant.pad_counts) >= 1 and min(variant.pad_counts) == 0
    if "grad_accumulation" in ENGINES[engine].fixed_variant_fields:
        assert variant.grad_accumulation is None


@pytest.mark.parametrize("model", BUILT_IN)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_drawn_variants_build_and_run_in_fp32(model, mode, tmp_path_factory):
    """The property assumes a drawn variant runs in fp32: every draw here does, train and eval."""
    failures = []

    @settings(max_examples=6, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(variants(MODELS[model], ENGINES["torch"]))
    def runs_in_fp32(variant):
        result = run_cell(Cell(model, "fp32", mode, "cpu"), tmp_path_factory.mktemp("v"), variant=variant)
        if result.outcome != "passed":
            failures.append((variant, result.message))
        assert result.metrics.variant == variant.only(MODELS[model].variant_fields)

    runs_in_fp32()
    assert not failures, failures


def test_strategies_reach_the_padding_patterns_the_issue_names():
    from hypothesis import find

    strategy = variants(MODELS["tiny-llama"], ENGINES["torch"])
    quick = settings(max_examples=500, database=None)
    one_token = find(strategy, lambda v: v.padding != "none" and max(v.pad_counts) == v.seq_len - 1, settings=quick)
    assert one_token.lengths[-1] == 1 or 1 in one_token.lengths
    assert find(strategy, lambda v: v.padding == "left" and v.batch_size > 1, settings=quick)
    gemma = variants(MODELS["gemma-cache"], ENGINES["torch"])
    cut = find(gemma, lambda v: v.sliding_window < v.seq_len and not v.use_cache_in_eval, settings=quick)
    assert cut.sliding_window == cut.seq_len - 1  # shrunk to the smallest cut


def test_base_variant_has_no_padding_and_the_grid_sizes():
    base = base_variant(MODELS["tiny-transformer"], ENGINES["torch"])
    assert base.padding == "none" and base.pad_counts == (0,)
    assert (base.hidden_size, base.num_heads, base.num_layers) == (32, 4, 2)
    assert MODELS["tiny-transformer"].with_variant(base).batch("cpu").keys() == {"input_ids", "labels"}


@pytest.fixture(scope="module")
def encoder_exploration(tmp_path_factory):
    return explore(
        ENCODER_TARGET,
        Budget(examples=30, seconds=600, seed=0),
        tmp_path_factory.mktemp("explore"),
        catalogue.load(),
        environment.package_versions(),
    )


def test_exploration_finds_the_encoder_fast_path_failure_shrunk_to_the_padding_mask(encoder_exploration):
    """From a base without padding, the search finds the class that breaks the encoder in eval
    under CPU autocast, and the minimal variant differs from the base in one setting only."""
    findings = encoder_exploration.findings
    assert len(findings) == 1, [f.result.signature.text for f in findings]
    finding = findings[0]
    assert finding.known_as == "torch-encoder-fastpath-autocast"
    assert finding.result.phase == "evaluate"
    assert "expected scalar type Float but found BFloat16" in finding.result.signature.text
    assert finding.differs_from_base == {"padding": "right"}
    assert finding.variant.pad_counts == (0,) and finding.variant.seq_len == 1  # the mask alone is enough
    assert finding.needed == {"padding": "needed: reverted alone, the cell passes"}
    assert encoder_exploration.fp32_failures == 0
    assert encoder_exploration.examples_run <= 30


def test_the_search_is_deterministic_for_a_seed(encoder_exploration, tmp_path):
    again = explore(
        ENCODER_TARGET,
        Budget(examples=30, seconds=600, seed=0),
        tmp_path,
        catalogue.load(),
        environment.package_versions(),
    )
    assert again.examples_run == encoder_exploration.examples_run
    assert [f.variant for f in again.findings] == [f.variant for f in encoder_exploration.findings]


def test_a_recorded_minimal_variant_replays_to_the_same_signature(encoder_exploration):
    finding = encoder_exploration.findings[0]
    command = finding.replay.split(" ", 3)
    assert command[:3] == ["python", "-m", "matrix"]
    variant_json = json.loads(finding.replay.split("--variant ", 1)[1].strip("'"))
    done = subprocess.run(
        [sys.executable, "-m", "matrix", "replay", ENCODER_TARGET.id, "--variant", json.dumps(variant_json)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == f"{finding.result.signature.id} {finding.result.signature.text}"
    # the base variant itself passes: the replay is not failing for some other reason
    base = to_json(encoder_exploration.base, encoder_exploration.fields)
    passed = subprocess.run(
        [sys.executable, "-m", "matrix", "replay", ENCODER_TARGET.id, "--variant", base],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert passed.returncode == 0 and passed.stdout.strip().endswith("passed"), passed.stdout + passed.stderr


def test_replay_refuses_bad_input_with_exit_status_2():
    for args in (["no-such-cell"], [ENCODER_TARGET.id, "--variant", '{"colour": 1}']):
        done = subprocess.run(
            [sys.executable, "-m", "matrix", "replay", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith("python -m matrix replay: ")


def test_simplify_reverts_every_setting_the_failure_does_not_need(tmp_path):
    """A failing variant with extra changes (more layers off, dropout, a padded second row)
    comes back with only the padding mask changed from the base."""
    kind = MODELS["tiny-transformer"]
    base = base_variant(kind, ENGINES["torch"])
    cluttered = base.replace(padding="right", seq_len=5, pad_counts=(0, 3), num_layers=1, dropout=0.1)
    search = Search(ENCODER_TARGET, Budget(seconds=600), tmp_path, 0)
    failure = search.failure(cluttered)
    assert failure is not None
    fields = explored_fields(kind, ENGINES["torch"])
    minimal = simplify(search, kind, cluttered, base, fields, failure.signature.text)
    assert minimal.differences(base, fields) == {"padding": "right"}
    needed = why_needed(search, kind, cluttered, base, fields, failure)
    assert needed["padding"].startswith("needed")
    assert needed["dropout"].startswith("not needed") and needed["num_layers"].startswith("not needed")


def test_variant_json_round_trips_and_names_unknown_fields():
    variant = Variant(padding="left", pad_counts=(0, 2), lora_targets=("q_proj",))
    fields = ("padding", "pad_counts", "lora_targets")
    assert from_json(to_json(variant, fields), Variant()) == variant
    with pytest.raises(ValueError, match="unknown variant field 'colour'"):
        from_json('{"colour": "red"}', Variant())


def test_explorations_are_collected_only_with_explore(run_pytest):
    plain = run_pytest("--collect-only", "-q", "--no-report", "--model", "tiny-transformer")
    assert plain.returncode == 0 and "test_explore" not in plain.stdout
    asked = run_pytest(
        "--collect-only", "-q", "--no-report", "--explore", "--model", "tiny-transformer", "--device", "cpu"
    )
    targets = [line for line in asked.stdout.splitlines() if "test_explore[" in line]
    # every precision but the fp32 reference and the self-contradictory one, 2 modes, every engine
    # a default selection runs (the compiled twins run only where named)
    from matrix.precisions.policies import PRECISIONS
    from matrix.selection.cells import parse_selection

    assert len(targets) == (len(PRECISIONS) - 2) * 2 * len(parse_selection("engine", None))
    assert not any("-fp32-" in t or "fp32-grads" in t for t in targets)


def test_explore_run_writes_explorations_into_the_report(run_pytest, tmp_path):
    done = run_pytest(
        "-k",
        "test_explore",
        "--explore",
        "--model",
        "tiny-transformer",
        "--precision",
        "bf16-mixed,bf16-true",
        "--mode",
        "eval",
        "--device",
        "cpu,cuda",
        "--engine",
        "torch",
        "--explore-examples",
        "15",
        env=NO_GPU,  # the cuda targets skip, GPU or not: the report must carry skipped explorations too
    )
    assert done.returncode == 0, done.stdout[-3000:]
    document = json.loads((tmp_path / "reports" / "latest" / "results.json").read_text())
    jsonschema.validate(document, SCHEMA)
    assert document["cells"] == []
    by_target = {e["target"]: e for e in document["explorations"]}
    assert set(by_target) == {
        f"tiny-transformer-{p}-eval-{d}-torch" for p in ("bf16-mixed", "bf16-true") for d in ("cpu", "cuda")
    }
    assert by_target["tiny-transformer-bf16-mixed-eval-cuda-torch"]["skip_reason"].startswith("Requires: [CUDA")
    found = by_target["tiny-transformer-bf16-mixed-eval-cpu-torch"]["findings"]
    assert [f["known_failure"]["id"] for f in found] == ["torch-encoder-fastpath-autocast"]
    assert found[0]["differs_from_base"] == {"padding": "right"}
    summary = (tmp_path / "reports" / "latest" / "summary.md").read_text()
    assert "## Explorations" in summary and found[0]["replay"] in summary
    assert "2 explorations" in done.stdout


def test_a_finding_the_catalogue_does_not_explain_fails_its_target(run_pytest, tmp_path):
    done = run_pytest(
        "-k",
        "test_explore",
        "--explore",
        "--no-builtin-catalogue",
        "--model",
        "tiny-transformer",
        "--precision",
        "bf16-mixed",
        "--mode",
        "eval",
        "--device",
        "cpu",
        "--engine",
        "torch",
        "--explore-examples",
        "15",
    )
    assert done.returncode == 1, done.stdout[-3000:]
    failure = done.stdout.split("test_explore[tiny-transformer-bf16-mixed-eval-cpu-torch]", 1)[1]
    assert "sig-ae7859b7 evaluate: RuntimeError" in failure
    assert "python -m matrix replay tiny-transformer-bf16-mixed-eval-cpu-torch --variant" in failure
