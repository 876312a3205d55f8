"""The CPU's bit-for-bit rules hold for weights wherever they lie in memory (matrix/devices/cpu.py
REPRODUCIBLE_BLAS): the cells, and the scripts written for them, run under MKL's reproducible mode.

transformers' safetensors loader hands over tensors off torch's 64-byte alignment; on an AVX-512 CPU,
MKL's products over them rounded differently from the saved model's, and hf:granitemoe's DDP cells
failed their bit-for-bit reload and resume. On a CPU whose MKL rounds alike at any alignment the
comparison below holds without the mode too: there it shows only that the reload is exact.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# In a fresh process (MKL reads its mode once, at its first call): the cells' variables applied as
# the plugin applies them, then the matrix's hf:granitemoe built, saved and reloaded by its own
# loader, and its logits for the batch's third row (2 real tokens in 8) compared bit for bit.
RELOAD = """
    import json, os, sys, tempfile
    from pathlib import Path

    from matrix.execute import environment_variables

    if sys.argv[1] == "cells":
        environment_variables.apply()
    import torch

    from matrix.models import MODELS
    from matrix.precisions.policies import PRECISIONS

    kind, cpu = MODELS["hf:granitemoe"], torch.device("cpu")
    directory = Path(tempfile.mkdtemp())
    with torch.random.fork_rng():
        torch.manual_seed(0)
        saved = kind.build(PRECISIONS["fp32"], cpu, directory).eval()
    kind.save(saved, directory / "checkpoint")
    reloaded = kind.load_weights(directory / "checkpoint", torch.float32, cpu).eval()
    row = {key: value[2:] for key, value in kind.batch(cpu).items()}
    with torch.no_grad():
        difference = (saved(**row).logits - reloaded(**row).logits).abs().max().item()
    print(json.dumps({
        "MKL_CBWR": os.environ.get("MKL_CBWR"),
        "misaligned": sum(p.data_ptr() % 64 != 0 for p in reloaded.parameters()),
        "aligned_before": all(p.data_ptr() % 64 == 0 for p in saved.parameters()),
        "difference": difference,
    }))
"""


def reload_in_a_fresh_process(how: str) -> dict:
    import json

    environment = {key: value for key, value in os.environ.items() if key != "MKL_CBWR"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RELOAD), how],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_reloaded_model_off_alignment_gives_the_saved_models_bits_under_the_cells_variables():
    seen = reload_in_a_fresh_process("cells")
    assert seen["MKL_CBWR"] == "AUTO"
    # the case this is about: torch allocated the saved weights aligned, the loader's are not
    assert seen["aligned_before"] and seen["misaligned"] > 0
    assert seen["difference"] == 0.0


def test_a_script_sets_the_mode_before_torch_computes_anything():
    from matrix.releases.repro import generate

    script = generate("tiny-llama-fp32-eval-cpu-torch", None, None)
    mode = 'os.environ.setdefault("MKL_CBWR", "AUTO")'
    assert mode in script
    assert script.index(mode) < script.index("\nimport torch")
