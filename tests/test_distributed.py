"""The distributed engines' process group (matrix/execute/rank_pool.py, matrix/execute/rank_worker.py) and the
ddp/fsdp2 cells on it: real gloo ranks on this machine, no mocks.

A rank that raises, dies or hangs fails the call with what happened on which rank, never hangs
the run, and the next call gets a new group."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import python_path
from matrix.execute import rank_pool, run_cell
from matrix.grid.cell import Cell

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = Path(__file__).resolve().parent / "plugins"


@pytest.fixture(scope="module")
def group():
    """One real group for the tests below, as a run has one: each starts from a live group and
    counts the restarts its own fault causes (a group start imports torch in every rank)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(PLUGINS))  # the ranks import rank_calls from the driver's path
        patch.setattr(rank_pool, "ERROR_GRACE_S", 2.0)
        pool = rank_pool.RankPool(world_size=2, device="cpu")
        yield pool
        pool.stop()


def live_starts(group) -> int:
    """The group's start count once it is up (after a call that needs no fault)."""
    assert [r["sum"] for r in group.call("rank_calls:rank_and_sum", timeout_s=120)] == [1.0, 1.0]
    return group.starts


def test_a_call_runs_on_every_rank_of_one_real_group_that_stays_up(group):
    first = group.call("rank_calls:rank_and_sum", timeout_s=120)
    started = group.starts
    second = group.call("rank_calls:rank_and_sum", timeout_s=60)
    assert [r["rank"] for r in first] == [0, 1]
    assert all(r["sum"] == 1.0 and r["backend"] == "gloo" for r in first)  # 0 + 1, all-reduced
    assert [r["pid"] for r in first] == [r["pid"] for r in second]  # the same processes
    assert started >= 1 and group.starts == started


def test_a_rank_that_raises_fails_the_call_with_its_own_exception_and_signature(group):
    starts = live_starts(group)
    with pytest.raises(rank_pool.RankFailure) as raised:
        group.call("rank_calls:raise_on", 1, False, timeout_s=120)
    failure = raised.value
    assert failure.rank == 1 and str(failure).startswith("rank 1 raised ValueError: rank 1 refuses a float16 weight")
    assert failure.remote_signature.exc_type == "ValueError"
    assert failure.remote_signature.origin == "rank_calls:raise_on"
    assert "raise ValueError" in failure.remote_traceback
    assert group.alive  # every rank answered: none is stuck, the group stays
    assert group.call("rank_calls:rank_and_sum", timeout_s=60)[1]["sum"] == 1.0
    assert group.starts == starts


def test_a_rank_left_waiting_in_a_collective_is_stopped_and_the_group_rebuilt(group):
    starts = live_starts(group)
    with pytest.raises(rank_pool.RankFailure) as raised:
        group.call("rank_calls:raise_on", 1, True, timeout_s=120)
    assert raised.value.rank == 1
    assert not group.alive  # rank 0 waited in an all_reduce rank 1 never joined: stopped
    assert group.call("rank_calls:rank_and_sum", timeout_s=120)[0]["sum"] == 1.0
    assert group.starts == starts + 1


def test_a_rank_that_dies_is_named_with_its_signal_and_the_group_rebuilt(group):
    starts = live_starts(group)
    with pytest.raises(rank_pool.RankDied) as raised:
        group.call("rank_calls:die_on", 1, timeout_s=120)
    assert raised.value.rank == 1
    assert str(raised.value).startswith("rank 1 died (killed by SIGSEGV)")
    assert "Segmentation fault" in str(raised.value)  # the end of the rank's log (faulthandler)
    assert raised.value.remote_signature.text.endswith("rank died: rank <n> died (killed by SIGSEGV) @ <rank process>")
    assert not group.alive
    assert [r["sum"] for r in group.call("rank_calls:rank_and_sum", timeout_s=120)] == [1.0, 1.0]
    assert group.starts == starts + 1


def test_a_rank_aborted_by_a_collective_mismatch_is_named_with_the_mismatch(group):
    """A rank that the C++ runtime aborts (an uncaught exception in gloo's transport: ranks that
    disagree on a gather's size, as ZeRO-3's do when they fetch different modules) prints what
    was thrown before faulthandler's report; the message carries both."""
    starts = live_starts(group)
    with pytest.raises(rank_pool.RankDied) as raised:
        group.call("rank_calls:mismatched_gather", timeout_s=120)
    message = str(raised.value)
    assert "died (killed by SIGABRT)" in message, message
    assert "terminate called after throwing an instance of 'gloo::EnforceNotMet'" in message, message
    assert "Received data size doesn't match expected size" in message, message
    assert "Fatal Python error: Aborted" in message, message
    assert raised.value.remote_signature.text.endswith("rank died: rank <n> died (killed by SIGABRT) @ <rank process>")
    assert [r["sum"] for r in group.call("rank_calls:rank_and_sum", timeout_s=120)] == [1.0, 1.0]
    assert group.starts == starts + 1


def test_a_call_past_its_timeout_kills_every_rank(group):
    starts = live_starts(group)
    pids = [rank.process.pid for rank in group.ranks]
    processes = list(group.ranks)
    with pytest.raises(rank_pool.RankTimeout) as raised:
        group.call("rank_calls:sleep_on", 0, 3600, timeout_s=2)
    assert raised.value.waiting == [0]
    assert all(r.process.poll() is not None for r in processes), pids  # both gone, the sleeper too
    assert group.call("rank_calls:rank_and_sum", timeout_s=120)[0]["rank"] == 0
    assert group.starts == starts + 1


@pytest.mark.parametrize("rows", [5, 1, 8])  # 5: unequal shards; 1: a rank with none; 8: equal
def test_the_harness_gathers_fsdp2_shards_as_torch_does(group, rows):
    """The weights view of a sharded run gathers FSDP2's shards in one collective per dtype; it
    must give back what torch's get_model_state_dict gives, bit for bit, on every rank."""
    for answer in group.call("rank_calls:gathered_like_torch", rows, timeout_s=120):
        assert answer["one_collective_per_dtype"] and answer["names"] and answer["equal"], answer
        assert answer["shapes"]["0.weight"] == [rows, 3] and answer["shapes"]["2.weight"] == [1, rows]


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_a_sharded_run_agrees_with_the_torch_engine_and_splits_the_batch(engine, tmp_path):
    """The loss of the first step is the whole batch's mean, from two ranks' halves."""
    result = run_cell(Cell("tiny-llama", "fp32", "train", "cpu", engine), tmp_path, timeout_s=120)
    assert result.outcome == "passed", result.traceback
    ranks = result.metrics.distributed.rank_first_step_losses
    cross = result.metrics.cross_engine
    assert len(ranks) == 2 and ranks[0] != ranks[1]  # each rank saw other rows
    assert cross.spread_abs <= 1e-5
    assert result.metrics.distributed.backend == "gloo"


def test_ranks_whose_rows_stop_generating_at_different_steps_join_as_one_generate_does(tmp_path):
    """generate() stops once every row it holds has produced the end-of-sequence token and fills a
    finished row with the pad token. hf:gpt_oss's two ranks stop at different steps, so their outputs
    differ in length: the harness joined them with a plain cat and failed every DDP and accelerate-FSDP2
    evaluation of such a model in evaluate_rows (the hf:* run's sig-361aa656: 49 cells of five
    architectures). Joined as one generate() over the whole batch pads them, the fp32 evaluation's
    tokens are those of the fp32 reference generated in one process."""
    from matrix.harness.measurements import joined_generations
    from matrix.selection.cells import parse_selection

    assert joined_generations([torch.tensor([[5, 6, 7]]), torch.tensor([[5, 2]])]).tolist() == [[5, 6, 7], [5, 2, 0]]
    parse_selection("model", "hf:gpt_oss")  # made on demand, as --model hf:gpt_oss makes it
    result = run_cell(Cell("hf:gpt_oss", "fp32", "eval", "cpu", "ddp"), tmp_path, timeout_s=300)
    assert result.outcome == "passed", result.traceback
    assert result.metrics.generation_matches_fp32 is True


def test_the_ranks_compare_with_the_reference_curve_their_driver_measured(tmp_path):
    """The torch engine's curve the driver measured for an accelerate cell is handed to the ranks
    under its key: the ddp cell of the same kind and precision compares with the driver's losses,
    not with its own. Nudged past fp32's row here, they fail the ddp cell's curve at step 1."""
    from matrix.harness import reference_curves

    driver = run_cell(Cell("tiny-llama", "fp32", "train", "cpu", "accelerate"), tmp_path / "driver", timeout_s=120)
    assert driver.outcome == "passed", driver.traceback
    [(key, (losses, error))] = reference_curves._REFERENCE_CURVES.items()
    nudged = [loss + 2.0**-20 for loss in losses]
    reference_curves._REFERENCE_CURVES[key] = (nudged, error)
    result = run_cell(Cell("tiny-llama", "fp32", "train", "cpu", "ddp"), tmp_path / "ranks", timeout_s=120)
    assert result.metrics.curve.torch_engine.reference_losses == nudged != losses
    assert result.phase == "train_steps" and "leaves the torch engine's at step 1" in result.message


def test_a_rank_collects_what_a_cell_left_once_its_end_is_answered(group, tmp_path, monkeypatch):
    """A rank settles its garbage after answering the cell's end, outside any cell (as the driver
    does before a cell's time starts), so that the next cell finds it done."""
    live_starts(group)
    monkeypatch.setitem(rank_pool._POOLS, ("cpu", 2), group)  # the cell runs on this group
    result = run_cell(Cell("tiny-llama", "fp32", "eval", "cpu", "ddp"), tmp_path, timeout_s=120)
    assert result.outcome == "passed", result.traceback
    assert group.call("rank_calls:settled", timeout_s=60) == [{"settled": True, "cell": None, "pending": False}] * 2


def test_a_cell_failing_in_a_rank_records_the_ranks_own_traceback(tmp_path):
    """ddp registers bf16_compress_hook in each rank, and torch refuses it without NCCL (the
    catalogue's ddp-bf16-compress-hook-needs-nccl): the record's traceback is the driver's,
    then the rank's own down to where torch raised."""
    from matrix.catalogue.entries import Catalogue
    from matrix.execute.cell_run import run_and_record

    cell = Cell("tiny-transformer", "bf16-mixed-bf16-reduce", "eval", "cpu", "ddp")
    done = run_and_record(cell, tmp_path, Catalogue(), {}, timeout_s=120)  # no entry: the failure as it is
    assert done.outcome == "failed" and done.record.phase == "evaluate", done.record.message
    driver, rank = done.record.traceback.split("\nraised in the rank as:\n")
    assert "RankFailure: rank 0 raised TypeError" in driver.splitlines()[-1]
    frames = [line.strip() for line in rank.splitlines() if line.strip().startswith('File "')]
    assert frames[0].endswith("in main") and "rank_worker.py" in frames[0]  # the rank's outermost frame
    assert any(frame.endswith("in register_comm_hook") for frame in frames)  # torch, called by the engine in the rank
    assert frames[-1].endswith(f"in {done.record.signature['origin'].split(':')[1]}")  # the innermost: the origin
    assert rank.rstrip("\n").splitlines()[-1].startswith("TypeError: BF16 all reduce communication hook required")


@pytest.mark.parametrize(
    ("precision", "fsdp2", "ddp"),
    [
        ("fp32", (None, None, None), {"reduce_dtype": "float32"}),
        ("bf16-mixed", ("bfloat16", "float32", "bfloat16"), {"reduce_dtype": "float32", "autocast": "bfloat16"}),
        (
            "bf16-mixed-bf16-reduce",
            ("bfloat16", "bfloat16", "bfloat16"),
            {"reduce_dtype": "bfloat16", "autocast": "bfloat16", "comm_hook": "bf16_compress_hook"},
        ),
        (
            "fp16-mixed-fp16-reduce",
            ("float16", "float16", "float16"),
            {"reduce_dtype": "float16", "autocast": "float16", "grad_scaler": True, "comm_hook": "fp16_compress_hook"},
        ),
        ("bf16-true", (None, None, None), {"reduce_dtype": "bfloat16"}),
        ("bf16-loaded-mixed", (None, None, "bfloat16"), {"reduce_dtype": "bfloat16", "autocast": "bfloat16"}),
    ],
)
def test_each_precision_maps_onto_the_distributed_libraries_own_settings(precision, fsdp2, ddp):
    """fsdp2: (param_dtype, reduce_dtype, autocast) of MixedPrecisionPolicy and the cell; ddp: its
    reduce dtype and the communication hook that gives it."""
    from matrix.engines import ENGINES
    from matrix.precisions.policies import PRECISIONS

    settings = ENGINES["fsdp2"].settings(PRECISIONS[precision])
    assert (settings["param_dtype"], settings["reduce_dtype"], settings.get("autocast")) == fsdp2
    assert ENGINES["ddp"].settings(PRECISIONS[precision]) == ddp
    assert ENGINES["torch"].unsupported_reason(PRECISIONS[precision]) == (
        None
        if "reduce" not in precision
        else f"Requires: [gradients reduced across ranks, in {ddp['reduce_dtype']}] (the torch engine runs one process)"
    )


def matrix_run(tmp_path, *args, timeout=600):
    env = {**os.environ, "PYTHONPATH": python_path(PLUGINS)}
    env.pop("PYTEST_ADDOPTS", None)
    command = [sys.executable, "-m", "matrix", "run", "-p", "fault_models", "-p", "no:cacheprovider", *args]
    command += ["--device", "cpu", "--report-dir", str(tmp_path), "--run-id", "run"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    cells = json.loads((tmp_path / "run" / "results.json").read_text())["cells"]
    return done, {cell["id"]: cell for cell in cells}


def test_a_rank_dying_or_hanging_in_a_cell_fails_that_cell_only(tmp_path):
    """fault-rank-segfault takes rank 1 down in its bf16-true cell; fault-sleep's bf16-true cell
    sleeps in both ranks past --cell-timeout. Each fails with what happened and the group is
    rebuilt: fault-sleep's fp32 cell runs on a new group after the rank died."""
    done, cells = matrix_run(
        tmp_path,
        *("--model", "fault-rank-segfault,fault-sleep", "--precision", "bf16-true,fp32", "--engine", "ddp"),
        *("--mode", "eval", "--cell-timeout", "10"),
    )
    assert done.returncode == 1, done.stderr[-3000:]
    died = cells["fault-rank-segfault-bf16-true-eval-cpu-ddp"]
    assert died["outcome"] == "failed" and died["phase"] == "evaluate", died
    assert died["signature"]["text"] == "evaluate: rank died: rank <n> died (killed by SIGSEGV) @ <rank process>"
    assert died["message"].startswith("RankDied: rank 1 died (killed by SIGSEGV)")
    assert "Segmentation fault" in died["message"] and "rank_segfault" in died["message"]  # the rank's stack
    hung = cells["fault-sleep-bf16-true-eval-cpu-ddp"]
    assert hung["outcome"] == "failed" and hung["signature"]["exception"] == "rank timeout", hung
    assert "did not answer within 9 s; every rank was killed" in hung["message"]
    for model in ("fault-rank-segfault", "fault-sleep"):
        assert cells[f"{model}-fp32-eval-cpu-ddp"]["outcome"] == "passed"


@pytest.mark.parametrize(("visible", "world", "reason"), [(1, 2, "(1 visible)"), (2, 2, None), (3, 4, "(3 visible)")])
def test_cuda_cells_need_one_gpu_per_rank(visible, world, reason, monkeypatch):
    """The nccl side's skip, with GPUs simulated on the CPU: a group needs --world-size GPUs."""
    import torch

    from matrix.devices import DEVICES
    from matrix.engines import ENGINES, distributed

    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(distributed, "WORLD_SIZE", world)
    for engine in ("ddp", "fsdp2"):
        found = ENGINES[engine].device_skip_reason(DEVICES["cuda"])
        if reason is None:
            assert found is None
        else:
            assert found == f"Requires: [{world} cuda devices, one per rank] {reason}"
        assert ENGINES[engine].device_skip_reason(DEVICES["cpu"]) is None


def test_the_distributed_engines_refuse_accumulation_by_name():
    from matrix.engines import ENGINES
    from matrix.precisions.policies import PRECISIONS

    for engine in ("ddp", "fsdp2", "accelerate-fsdp2"):
        assert ENGINES[engine].unsupported_reason(PRECISIONS["bf16-loaded-mixed-fp32-grads"]) == (
            f"Requires: [micro-batch accumulation and a gradient dtype wired into the {engine} engine]"
        )


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        ("fp32", {"mixed_precision": "no", "mixed_precision_policy": None}),
        (
            "bf16-mixed",
            {
                "mixed_precision": "bf16",
                "mixed_precision_policy": {
                    "param_dtype": "bfloat16",
                    "reduce_dtype": "float32",
                    "output_dtype": "bfloat16",
                },
            },
        ),
        (
            "fp16-mixed-fp16-reduce",
            {
                "mixed_precision": "fp16",
                "mixed_precision_policy": {
                    "param_dtype": "float16",
                    "reduce_dtype": "float16",
                    "output_dtype": "float16",
                },
            },
        ),
        ("bf16-true", {"mixed_precision": "no", "mixed_precision_policy": None}),
    ],
)
def test_accelerate_fsdp2_states_each_precision_as_an_accelerate_switch_and_fsdp_policy(precision, expected):
    from matrix.engines import ENGINES
    from matrix.precisions.policies import PRECISIONS

    assert ENGINES["accelerate-fsdp2"].settings(PRECISIONS[precision]) == expected


def test_accelerate_fsdp2_keeps_fp32_master_weights_of_half_loaded_weights_and_says_who_chose_fsdp(tmp_path):
    """bf16 weights loaded, bf16 mixed precision: accelerate's FSDP2 path trains fp32 master
    copies (what accelerate declares), and on a CPU group the engine, not accelerate, chose FSDP.
    The two ranks' halves of the batch give the torch engine's first-step loss."""
    result = run_cell(
        Cell("tiny-llama", "bf16-loaded-mixed", "train", "cpu", "accelerate-fsdp2"), tmp_path, timeout_s=120
    )
    assert result.outcome == "passed", result.traceback
    assert result.metrics.declared["weights_dtype"] == "bfloat16"
    effective = result.metrics.engine_effective
    assert effective["trained_parameter_dtypes_after_prepare"] == ["float32"]
    assert set(result.metrics.effective.trainable_parameter_dtypes) == {"bfloat16"}  # FSDP's param_dtype
    assert effective["fsdp_selected_by"].startswith("the matrix (accelerate leaves a cpu group")
    assert effective["mp_policy"]["param_dtype"] == "bfloat16"
    assert result.metrics.resume_reload_max_abs_difference == 0.0  # load_state into a fresh Accelerator
    ranks, cross = result.metrics.distributed.rank_first_step_losses, result.metrics.cross_engine
    assert len(ranks) == 2 and ranks[0] != ranks[1]  # each rank saw other rows
    assert cross.spread_abs <= cross.tolerance.atol + cross.tolerance.rtol * abs(cross.torch_engine_first_step_loss)


def test_a_no_op_upcast_breaks_accelerates_declared_master_weights():
    """What accelerate 1.13.0 did (huggingface/accelerate#3979): trained parameters left in bf16
    under mixed precision. The engine's declared-dtype check names it; fp32 ones pass."""
    import torch

    from matrix.checks.assertions import DtypeContractBroken
    from matrix.engines.accelerate_fsdp2 import check_fp32_master_weights

    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    broken = r"trained parameters .*: weights are torch.bfloat16, not torch.float32"
    with pytest.raises(DtypeContractBroken, match=broken):
        check_fp32_master_weights(model, "after prepare")
    model.float()
    check_fp32_master_weights(model, "after prepare")
    model.weight.requires_grad_(False)
    model.weight.data = model.weight.data.to(torch.bfloat16)  # a frozen base weight keeps its dtype
    check_fp32_master_weights(model, "after prepare")


def test_an_optimizer_state_lost_or_changed_across_a_reload_is_named():
    """What accelerate 1.12.0's FSDP2 load_state did (huggingface/accelerate#3971): a fresh AdamW
    came back without its moments. Missing and differing state both fail; an exact copy passes."""
    import copy

    import torch

    from matrix.checks import assertions as checks

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    saved = checks.optimizer_state(optimizer)
    assert {name.split(": ")[1] for name in saved} == {"step", "exp_avg", "exp_avg_sq"}
    restored = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(checks.CheckpointMismatch, match="optimizer state missing after reload") as missing:
        checks.check_optimizer_state_restored(saved, restored)
    assert missing.value.details.startswith("6 of 6 tensors")
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    checks.check_optimizer_state_restored(saved, restored)
    next(iter(restored.state.values()))["exp_avg"].add_(1.0)
    with pytest.raises(checks.CheckpointMismatch, match="optimizer state differs after reload"):
        checks.check_optimizer_state_restored(saved, restored)


@pytest.mark.parametrize(("backend", "expected"), [("nccl", "cuda:3"), ("gloo", "cpu")])
def test_collectives_put_their_tensor_where_the_backend_reduces(backend, expected, monkeypatch):
    """The rank-agreement collectives (matrix/harness/group.py) on nccl need a CUDA tensor: a CPU one
    raised "No backend type associated with device type cpu" in 420 one-rank cells of the
    first GPU run (docs/gpu-runs/h100-2026-11-22). The backend is simulated; the device chosen is real."""
    import torch
    import torch.distributed as dist

    from matrix.harness import group

    monkeypatch.setattr(dist, "get_backend", lambda *args: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert str(group._collective_device()) == expected
