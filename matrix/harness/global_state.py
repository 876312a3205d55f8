"""The process-global state a library can change, and a cell's watch over it: each cell starts
from the state the one before it found, and one that changes it is named for it, setting by
setting, with the phase that did it, instead of a later cell failing for it.

A setting is one row of SETTINGS (its name, how to read it, how to write it back): adding one is
one line. Beside them, namespaces whose entries come and go: the environment variables, and the
entries of Dynamo's and Inductor's configs a process has set. Reading everything is cheap next to
a phase, so a cell is compared after each of its phases (Watch.checkpoint) and a change attributed
to the phase that left the setting as it stayed.

The fp32 matmul precision has two APIs since torch 2.9: the legacy torch.set_float32_matmul_precision
and the per-backend fp32_precision fields. Once they disagree, the legacy getter (and the legacy
allow_tf32 flags) refuse to answer, so their reading is then REFUSED, and the per-backend fields
are what is compared. They are put back the legacy setters first, then the per-backend fields,
parents (torch.backends, cudnn, mkldnn) before their operations, the order issue 46 names from
PyTorch's test base (pytorch/pytorch#197369): the legacy setter writes the matmul fields of
every backend, so written last it would undo them (torch starts with 'none' there, which the
legacy setter never writes).

The random number generators are put back after every cell too but are not a finding: every cell
draws from them (reported=False).
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

import torch

REFUSED = "(refused: the legacy and per-backend APIs were mixed)"
MIXED_API_MESSAGE = "mix of the legacy and new APIs"
UNSET = "(unset)"  # an environment variable that was not set
# Environment variables that are bookkeeping, not settings: their values do not depend on the cell
# that happens to set them first in a process, a cell alone sets them too where it uses the
# library, and a library that set them once per process does not set them again. Neither named
# nor put back (putting them back would take from a later cell what its library relies on).
BOOKKEEPING_VARIABLES = {
    "PYTEST_CURRENT_TEST": "pytest names the test and its stage",
    "TORCHINDUCTOR_CACHE_DIR": "Inductor's cache_dir() writes the directory it chose, for its workers",
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR": "Inductor, before loading each compiled C++ library: an address",
    "PYTORCH_NVML_BASED_CUDA_CHECK": "lightning.fabric's import, once per process: torch's CUDA check through NVML",
}
DEFAULT = "(default)"  # a config entry at its default
VALUE_CHARS = 200  # a value as a record shows it


@dataclass(frozen=True)
class Setting:
    name: str
    read: Callable[[], object]
    write: Callable[[object], None] | None  # None: cannot be put back in a running process
    legacy: bool = False  # written back before the others: the legacy half of a two-API setting
    reported: bool = True  # False: state every cell consumes (random numbers): put back, not a finding


def attribute(path: str, legacy: bool = False) -> Setting | None:
    """A setting that is an attribute of torch ("backends.cuda.matmul.fp32_precision"); None where
    this torch has no such attribute."""
    owner_path, _, leaf = path.rpartition(".")
    try:
        owner = attrgetter(owner_path)(torch)
        if not hasattr(owner, leaf):
            return None
    except AttributeError:
        return None
    return Setting(
        f"torch.{path}", refusing(lambda: getattr(owner, leaf)), lambda value: setattr(owner, leaf, value), legacy
    )


def legacy_matmul_getter_refuses() -> bool:
    """Whether torch.get_float32_matmul_precision() refuses in this process now: the mechanism of
    the catalogue's torch-mixed-matmul-precision-api-after-inductor, recorded per cell."""
    return refusing(torch.get_float32_matmul_precision)() == REFUSED


def refusing(read: Callable[[], object]) -> Callable[[], object]:
    """A legacy reading that torch refuses once the two fp32 precision APIs disagree: REFUSED then."""

    def reading():
        try:
            return read()
        except RuntimeError as error:
            if MIXED_API_MESSAGE not in str(error):
                raise
            return REFUSED

    return reading


def autocast(device_type: str) -> list[Setting]:
    return [
        Setting(
            f"torch.is_autocast_enabled({device_type!r})",
            lambda: torch.is_autocast_enabled(device_type),
            lambda value: torch.set_autocast_enabled(device_type, value),
        ),
        Setting(
            f"torch.get_autocast_dtype({device_type!r})",
            lambda: torch.get_autocast_dtype(device_type),
            lambda value: torch.set_autocast_dtype(device_type, value),
        ),
    ]


def sdp(backend: str) -> Setting | None:
    cuda = torch.backends.cuda
    if not hasattr(cuda, f"{backend}_sdp_enabled"):
        return None
    return Setting(
        f"torch.backends.cuda.{backend}_sdp_enabled()",
        getattr(cuda, f"{backend}_sdp_enabled"),
        getattr(cuda, f"enable_{backend}_sdp"),
    )


def _cuda_rng_read():
    return torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # never initializes CUDA


def _cuda_rng_write(states) -> None:
    if states is not None:
        torch.cuda.set_rng_state_all(states)


def _numpy_rng_read():
    numpy = sys.modules.get("numpy")  # seeded by Lightning and the Trainer; never imported here
    return None if numpy is None else numpy.random.get_state()


def _numpy_rng_write(state) -> None:
    if state is not None:
        sys.modules["numpy"].random.set_state(state)


def _settings() -> tuple[Setting, ...]:
    rows = [
        # the legacy halves first: they are written back first
        Setting(
            "torch.get_float32_matmul_precision()",
            refusing(torch.get_float32_matmul_precision),
            torch.set_float32_matmul_precision,
            legacy=True,
        ),
        attribute("backends.cuda.matmul.allow_tf32", legacy=True),
        attribute("backends.cudnn.allow_tf32", legacy=True),
        # the per-backend fp32 precisions, a parent before its operations
        attribute("backends.fp32_precision"),
        attribute("backends.cuda.matmul.fp32_precision"),
        attribute("backends.cudnn.fp32_precision"),
        attribute("backends.cudnn.conv.fp32_precision"),
        attribute("backends.cudnn.rnn.fp32_precision"),
        attribute("backends.mkldnn.fp32_precision"),
        attribute("backends.mkldnn.matmul.fp32_precision"),
        attribute("backends.mkldnn.conv.fp32_precision"),
        attribute("backends.mkldnn.rnn.fp32_precision"),
        attribute("backends.cuda.matmul.allow_fp16_reduced_precision_reduction"),
        attribute("backends.cuda.matmul.allow_bf16_reduced_precision_reduction"),
        attribute("backends.cudnn.enabled"),
        attribute("backends.cudnn.benchmark"),
        attribute("backends.cudnn.deterministic"),
        attribute("backends.mkldnn.enabled"),
        attribute("backends.mkldnn.deterministic"),
        *(sdp(backend) for backend in ("flash", "mem_efficient", "math", "cudnn")),
        Setting(
            "torch.are_deterministic_algorithms_enabled()",
            lambda: (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1]),
        ),
        attribute("utils.deterministic.fill_uninitialized_memory"),
        Setting("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
        Setting("torch.get_default_device()", torch.get_default_device, torch.set_default_device),
        Setting("torch.is_grad_enabled()", torch.is_grad_enabled, torch.set_grad_enabled),
        Setting(
            "torch.is_anomaly_enabled()",
            lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            lambda value: torch.set_anomaly_enabled(*value),
        ),
        *autocast("cpu"),
        *autocast("cuda"),
        Setting("torch.is_autocast_cache_enabled()", torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled),
        Setting("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
        Setting("torch.get_num_interop_threads()", torch.get_num_interop_threads, None),  # settable once, before use
        Setting("torch.random.get_rng_state()", torch.random.get_rng_state, torch.random.set_rng_state, reported=False),
        Setting("torch.cuda.get_rng_state_all()", _cuda_rng_read, _cuda_rng_write, reported=False),
        Setting("random.getstate()", random.getstate, random.setstate, reported=False),
        Setting("numpy.random.get_state()", _numpy_rng_read, _numpy_rng_write, reported=False),
    ]
    return tuple(row for row in rows if row is not None)


SETTINGS = _settings()


@dataclass(frozen=True)
class Namespace:
    """Entries that come and go: each present one is a setting named `prefix[name]` or
    `prefix.name`; an absent one reads as `absent`."""

    prefix: str
    entries: Callable[[], dict]
    write: Callable[[str, object], None]  # the value `absent` removes the entry
    absent: str
    dotted: bool = False
    # cheap to read, and different after any change that matters between two checkpoints: where it
    # is unchanged a checkpoint takes the entries from the last one instead of reading them again
    fingerprint: Callable[[], object] | None = None

    def setting_name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.dotted else f"{self.prefix}[{key!r}]"


def _environment() -> dict:
    return {name: value for name, value in os.environ.items() if name not in BOOKKEEPING_VARIABLES}


def _write_environment(name: str, value) -> None:
    if value is UNSET:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _config_entries(module_name: str) -> Callable[[], dict]:
    """The entries of a config module (torch.utils._config_module) whose values differ from their
    defaults (Inductor writes some of its own entries with their default values: no change); none
    while the module is not imported (nothing can have set them: never imported here)."""

    def entries() -> dict:
        config = sys.modules.get(module_name)
        if config is None or not hasattr(config, "get_config_copy"):
            return {}
        defaults = config._config  # the module's entries, each with its default
        return {
            name: value
            for name, value in config.get_config_copy().items()
            if name not in defaults or not same(value, defaults[name].default)
        }

    return entries


def _config_hash(module_name: str) -> Callable[[], object]:
    """The config's own hash (cached by torch until an entry is written): entries its hash leaves
    out (compile_ignored: logging, debug knobs) are compared at the cell's end only."""

    def fingerprint():
        config = sys.modules.get(module_name)
        return None if config is None or not hasattr(config, "get_hash") else config.get_hash()

    return fingerprint


def _config_write(module_name: str) -> Callable[[str, object], None]:
    def write(name: str, value) -> None:
        config = sys.modules[module_name]
        if value is DEFAULT:  # back to its default: what delattr does, less hiding the entry as it also does
            delattr(config, name)
            config._config[name].hide = False
        else:
            setattr(config, name, value)

    return write


NAMESPACES = (
    Namespace("os.environ", lambda: _environment(), _write_environment, UNSET),
    *(
        Namespace(module, _config_entries(module), _config_write(module), DEFAULT, True, _config_hash(module))
        for module in ("torch._dynamo.config", "torch._inductor.config")
    ),
)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except (RuntimeError, ValueError, TypeError):  # values that do not compare (tensors in a tuple)
        return a is b


def describe(value) -> str:
    text = value if any(value is marker for marker in (REFUSED, UNSET, DEFAULT)) else repr(value)
    return text if len(text) <= VALUE_CHARS else text[: VALUE_CHARS - 1] + "…"


@dataclass(frozen=True)
class Leak:
    """A setting a cell left changed: its value before and after the cell, the phase that left it
    so, and whether it could be put back."""

    setting: str
    before: str
    after: str
    phase: str
    restored: bool

    def as_dict(self) -> dict:
        return {
            "setting": self.setting,
            "before": self.before,
            "after": self.after,
            "phase": self.phase,
            "restored": self.restored,
        }


def snapshot(reported_only: bool = False, skip: frozenset = frozenset()) -> dict:
    """Every setting's value: SETTINGS' by name, the namespaces' entries by (prefix, key), but those
    of the namespaces in `skip`."""
    values: dict = {s.name: s.read() for s in SETTINGS if s.reported or not reported_only}
    for namespace in NAMESPACES:
        if namespace.prefix not in skip:
            values.update({(namespace.prefix, k): v for k, v in namespace.entries().items()})
    return values


def fingerprints() -> dict:
    return {n.prefix: n.fingerprint() for n in NAMESPACES if n.fingerprint is not None}


NAMESPACE_OF = {namespace.prefix: namespace for namespace in NAMESPACES}
UNREPORTED = frozenset(s.name for s in SETTINGS if not s.reported)


def display(name) -> str:
    return NAMESPACE_OF[name[0]].setting_name(name[1]) if isinstance(name, tuple) else name


def value_of(values: dict, name):
    """A setting's value in a snapshot; a namespace's entry that is not there reads as absent."""
    return values[name] if name in values or not isinstance(name, tuple) else NAMESPACE_OF[name[0]].absent


def changed(before: dict, after: dict) -> list:
    names = [n for n in before if n in after or isinstance(n, tuple)]
    names += [n for n in after if n not in before and isinstance(n, tuple)]
    return [n for n in names if not same(value_of(before, n), value_of(after, n))]


def restore(before: dict) -> None:
    """Write back every setting that differs from `before`: the legacy ones first, then the others
    in SETTINGS' order, then the namespaces' entries. A REFUSED value cannot be written: the
    per-backend fields that follow it carry the state."""
    for setting in sorted(SETTINGS, key=lambda s: not s.legacy):
        value = before[setting.name]
        if setting.write is None or value is REFUSED:
            continue
        if not setting.reported or not same(value, setting.read()):  # read now: a legacy write moves others
            setting.write(value)
    for name in changed(before, snapshot(reported_only=True)):
        if isinstance(name, tuple):
            NAMESPACE_OF[name[0]].write(name[1], value_of(before, name))


_OPEN: list[Watch] = []  # the watches open in this process, the innermost last


def left_in_another_process(process: str, leaks: list[dict]) -> None:
    """What a cell left changed in another process it ran in (a rank of its process group, which
    the next cell reuses), as that process put back and reported it (Leak.as_dict()): added to
    the innermost open watch of this process, the setting named with the process."""
    if _OPEN:
        _OPEN[-1].elsewhere += [Leak(**{**leak, "setting": f"{process}: {leak['setting']}"}) for leak in leaks]


@dataclass(eq=False)  # one watch is itself alone (its snapshots hold tensors that do not compare)
class Watch:
    """One cell's watch: the state it started from, the phase each change came in, and at its
    end (close) the settings it left changed, put back."""

    before: dict = field(default_factory=snapshot)
    last: dict = field(init=False)
    changed_in: dict = field(default_factory=dict)  # setting -> the phase of its last change
    closed: bool = False
    elsewhere: list = field(default_factory=list)  # Leaks in another process of the cell's (its ranks)
    prints: dict = field(default_factory=fingerprints)  # the namespaces' fingerprints at the last checkpoint

    def __post_init__(self) -> None:
        self.last = {n: v for n, v in self.before.items() if n not in UNREPORTED}
        _OPEN.append(self)

    def checkpoint(self, phase: str, full: bool = False) -> None:
        """After a phase: the settings it changed are attributed to it. A namespace whose
        fingerprint has not changed since the last checkpoint is not read again, unless `full`."""
        prints = fingerprints()
        unchanged = frozenset() if full else frozenset(p for p, f in prints.items() if f == self.prints.get(p))
        now = snapshot(reported_only=True, skip=unchanged)
        now.update({n: v for n, v in self.last.items() if isinstance(n, tuple) and n[0] in unchanged})
        self.prints = prints
        for name in changed(self.last, now):
            self.changed_in[name] = phase
        self.last = now

    def close(self, phase: str = "cleanup") -> list[Leak]:
        """The settings the cell left changed (after a last checkpoint for `phase`), all put back;
        those that could not be are marked so. Once: a second close finds nothing."""
        if self.closed:
            return []
        self.checkpoint(phase, full=True)
        self.closed = True
        if self in _OPEN:
            _OPEN.remove(self)
        left = [n for n in changed(self.before, self.last) if n not in UNREPORTED]
        restore(self.before)
        still = set(changed(self.before, snapshot(reported_only=True)))
        return [
            Leak(
                setting=display(name),
                before=describe(value_of(self.before, name)),
                after=describe(value_of(self.last, name)),
                phase=self.changed_in.get(name, phase),
                restored=name not in still,
            )
            for name in left
        ] + self.elsewhere
