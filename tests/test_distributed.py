"""The distributed engines' process group (matrix/rank_pool.py, matrix/rank_worker.py) and the
ddp/fsdp2 cells on it: real gloo ranks on this machine, no mocks.

A rank that raises, dies or hangs fails the call with what happened on which rank, never hangs
the run, and the next call gets a new group."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from matrix import rank_pool
from matrix.cell import Cell
from matrix.execute import run_cell

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = Path(__file__).resolve().parent / "plugins"


@pytest.fixture
def group(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))  # the ranks import rank_calls from the driver's path
    monkeypatch.setattr(rank_pool, "ERROR_GRACE_S", 2.0)
    pool = rank_pool.RankPool(world_size=2, device="cpu")
    yield pool
    pool.stop()


def test_a_call_runs_on_every_rank_of_one_real_group_that_stays_up(group):
    first = group.call("rank_calls:rank_and_sum", timeout_s=120)
    second = group.call("rank_calls:rank_and_sum", timeout_s=60)
    assert [r["rank"] for r in first] == [0, 1]
    assert all(r["sum"] == 1.0 and r["backend"] == "gloo" for r in first)  # 0 + 1, all-reduced
    assert [r["pid"] for r in first] == [r["pid"] for r in second]  # the same processes
    assert group.starts == 1


def test_a_rank_that_raises_fails_the_call_with_its_own_exception_and_signature(group):
    with pytest.raises(rank_pool.RankFailure) as raised:
        group.call("rank_calls:raise_on", 1, False, timeout_s=120)
    failure = raised.value
    assert failure.rank == 1 and str(failure).startswith("rank 1 raised ValueError: rank 1 refuses a float16 weight")
    assert failure.remote_signature.exc_type == "ValueError"
    assert failure.remote_signature.origin == "rank_calls:raise_on"
    assert "raise ValueError" in failure.remote_traceback
    assert group.alive  # every rank answered: none is stuck, the group stays
    assert group.call("rank_calls:rank_and_sum", timeout_s=60)[1]["sum"] == 1.0
    assert group.starts == 1


def test_a_rank_left_waiting_in_a_collective_is_stopped_and_the_group_rebuilt(group):
    with pytest.raises(rank_pool.RankFailure) as raised:
        group.call("rank_calls:raise_on", 1, True, timeout_s=120)
    assert raised.value.rank == 1
    assert not group.alive  # rank 0 waited in an all_reduce rank 1 never joined: stopped
    assert group.call("rank_calls:rank_and_sum", timeout_s=120)[0]["sum"] == 1.0
    assert group.starts == 2


def test_a_rank_that_dies_is_named_with_its_signal_and_the_group_rebuilt(group):
    group.call("rank_calls:rank_and_sum", timeout_s=120)
    with pytest.raises(rank_pool.RankDied) as raised:
        group.call("rank_calls:die_on", 1, timeout_s=120)
    assert raised.value.rank == 1
    assert str(raised.value).startswith("rank 1 died (killed by SIGSEGV)")
    assert "Segmentation fault" in str(raised.value)  # the end of the rank's log (faulthandler)
    assert raised.value.remote_signature.text.endswith("rank died: rank <n> died (killed by SIGSEGV) @ <rank process>")
    assert not group.alive
    assert [r["sum"] for r in group.call("rank_calls:rank_and_sum", timeout_s=120)] == [1.0, 1.0]
    assert group.starts == 2


def test_a_call_past_its_timeout_kills_every_rank(group):
    group.call("rank_calls:rank_and_sum", timeout_s=120)
    pids = [rank.process.pid for rank in group.ranks]
    processes = list(group.ranks)
    with pytest.raises(rank_pool.RankTimeout) as raised:
        group.call("rank_calls:sleep_on", 0, 3600, timeout_s=2)
    assert raised.value.waiting == [0]
    assert all(r.process.poll() is not None for r in processes), pids  # both gone, the sleeper too
    assert group.call("rank_calls:rank_and_sum", timeout_s=120)[0]["rank"] == 0


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_a_sharded_run_agrees_with_the_torch_engine_and_splits_the_batch(engine, tmp_path):
    """The loss of the first step is the whole batch's mean, from two ranks' halves."""
    result = run_cell(Cell("tiny-llama", "fp32", "train", "cpu", engine), tmp_path, timeout_s=120)
    assert result.outcome == "passed", result.traceback
    ranks = result.metrics["distributed"]["rank_first_step_losses"]
    cross = result.metrics["cross_engine"]
    assert len(ranks) == 2 and ranks[0] != ranks[1]  # each rank saw other rows
    assert cross["spread_abs"] <= 1e-5
    assert result.metrics["distributed"]["backend"] == "gloo"


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
    from matrix.precisions import PRECISIONS

    settings = ENGINES["fsdp2"].settings(PRECISIONS[precision])
    assert (settings["param_dtype"], settings["reduce_dtype"], settings.get("autocast")) == fsdp2
    assert ENGINES["ddp"].settings(PRECISIONS[precision]) == ddp
    assert ENGINES["torch"].unsupported_reason(PRECISIONS[precision]) == (
        None
        if "reduce" not in precision
        else f"Requires: [gradients reduced across ranks, in {ddp['reduce_dtype']}] (the torch engine runs one process)"
    )


def matrix_run(tmp_path, *args, timeout=600):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGINS), str(ROOT)])}
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
    from matrix.precisions import PRECISIONS

    for engine in ("ddp", "fsdp2"):
        assert ENGINES[engine].unsupported_reason(PRECISIONS["bf16-loaded-mixed-fp32-grads"]) == (
            f"Requires: [micro-batch accumulation and a gradient dtype wired into the {engine} engine]"
        )
