"""Version stacks (matrix/releases/stacks.toml): named sets of pins that rebuild the stack a bug was
reported on. Imported by noxfile.py, so it needs nothing beyond the standard library and
packaging."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

STACKS_FILE = Path(__file__).with_name("stacks.toml")
CAPABILITIES = ("cuda",)

# The project's extras every environment the matrix is run from has: nox's sessions
# (noxfile.py install_stack) and the scratch environments of a sweep or bisection
# (matrix/releases/bisection.py ScratchEnvironment). bitsandbytes for the quantized precisions (small, and a
# CPU build): without it their cells skip, and a sweep of them would compare skips.
DEFAULT_EXTRAS = ("quantized",)


def project_requirement(root: Path | str, extras: tuple[str, ...] = ()) -> str:
    """The pip argument that installs the project at `root` with the default extras and `extras`."""
    chosen = (*DEFAULT_EXTRAS, *extras)
    return f"{root}[{','.join(chosen)}]" if chosen else str(root)


class StackError(ValueError):
    """The stacks file is malformed: the message names the file, the stack and the field."""


@dataclass(frozen=True)
class Stack:
    name: str
    description: str
    pins: tuple[str, ...]
    select: tuple[str, ...]
    requires: tuple[str, ...]


def parse(text: str, path: Path = STACKS_FILE) -> dict[str, Stack]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise StackError(f"{path}: file: not valid TOML ({error})") from None
    stacks = {}
    for name, raw in data.get("stack", {}).items():
        where = f"{path}: stack {name!r}"
        if "description" not in raw:
            raise StackError(f"{where}: missing field 'description'")
        for pin in raw.get("pins", []):
            try:
                requirement = Requirement(pin)
            except InvalidRequirement as error:
                raise StackError(f"{where}: pins has {pin!r}, not a requirement ({error})") from None
            if not requirement.specifier:
                raise StackError(f"{where}: pins has {pin!r} without a version specifier")
        unknown = [c for c in raw.get("requires", []) if c not in CAPABILITIES]
        if unknown:
            raise StackError(
                f"{where}: requires has unknown capability {unknown[0]!r} (known: {', '.join(CAPABILITIES)})"
            )
        stacks[name] = Stack(
            name=name,
            description=raw["description"],
            pins=tuple(raw.get("pins", [])),
            select=tuple(raw.get("select", [])),
            requires=tuple(raw.get("requires", [])),
        )
    if "default" not in stacks:
        raise StackError(f"{path}: stack 'default': missing (nox -s matrix runs it)")
    return stacks


def load(path: Path = STACKS_FILE) -> dict[str, Stack]:
    return parse(path.read_text(), path)
