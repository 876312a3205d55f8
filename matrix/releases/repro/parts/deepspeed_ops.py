"""Where a DeepSpeed engine's script has DeepSpeed build its CPU ops, written out before the engine's
part (engine_deepspeed_zero.py, engine_hf_trainer_deepspeed.py). Not imported: text of the script."""

import importlib.metadata

# DeepSpeed's CPU accelerator builds its ops on first use into TORCH_EXTENSIONS_DIR, by default one
# directory for every release (~/.cache/torch_extensions), and loads whatever build it finds there: an
# op another DeepSpeed release built can lack what this one calls ('deepspeed_shm_comm' has no
# attribute 'vector_kernel_level'). This script's ops go in a directory of their own per release.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(
        tempfile.gettempdir(),
        "repro-torch-extensions",
        f"torch-{torch.__version__}-deepspeed-{importlib.metadata.version('deepspeed')}",
    ),
)
