"""One value of every axis, and a catalogue entry, registered from outside the matrix package
the way the README's "Extending the matrix" says (tests/test_plugin.py loads it with -p or
from a conftest). Each addition is one register() call:

user-broken          a model kind: a classifier whose custom autograd Function is not
                     autocast-aware (seed 002's pattern), so its backward mixes half and fp32
fp16-mixed-unscaled  a precision: fp32 weights, fp16 autocast, no grad scaler
torch-twin           an engine: the torch loop, registered under another name
cpu-alias            a device: the CPU under another name
user_catalogue.toml  a catalogue entry for user-broken's backward, added to the built-in ones
"""

from pathlib import Path

import torch
from broken_models import BrokenClassifier

from matrix import devices, engines, models
from matrix.catalogue import entries as catalogue
from matrix.devices.base import Device, no_autocast_reason
from matrix.engines.torch_loop import TorchEngine
from matrix.models.tiny_transformer import TinyTransformer
from matrix.precisions import policies as precisions


class UserBroken(TinyTransformer):
    name = "user-broken"
    description = "classifier with a custom Function that is not autocast-aware (test plugin)"

    def create(self):
        return BrokenClassifier()


class TorchTwin(TorchEngine):
    name = "torch-twin"
    description = "the torch loop, registered again from a plugin (test plugin)"


class CPUAlias(Device):
    name = "cpu-alias"
    description = "the CPU under another name (test plugin)"

    def torch_device(self, index=0):
        return torch.device("cpu")

    def skip_reason(self, precision, index=0):
        return no_autocast_reason("cpu", precision)


models.register(UserBroken())
precisions.register(
    precisions.Precision("fp16-mixed-unscaled", torch.float32, torch.float16, False, "fp16 autocast, no GradScaler")
)
engines.register(TorchTwin())
devices.register(CPUAlias())
catalogue.register(Path(__file__).with_name("user_catalogue.toml"))
