"""The known-failure catalogue (matrix/catalogue/known_failures.toml) and outcome classification.

The built-in catalogue is matrix/catalogue/known_failures.toml. A downstream project adds its own entries,
never replaces these: register(path) from its plugin or conftest, or --catalogue FILE on the
command line; an entry can select by a model kind's declared traits, so the built-in known
classes apply to a user's kinds too. --no-builtin-catalogue starts from no entries (a run
that shows every failure as if unannounced).

An entry is in force for a cell when the installed versions satisfy its specifiers, one of its
selectors matches the cell (its axes, its model kind's traits, its engine's traits) and every
condition its `when` names holds (matrix/catalogue/conditions.py: the hardware, the run's settings, and,
once the cell ran, what the cell observed). Then:
  known        - the cell failed and its signature text matches the entry's pattern;
  failed       - the cell failed and no entry in force matches (a new failure);
  fixed        - the cell passed although an entry in force says it fails (narrow the entry), but
                 for an entry that says `may_pass = true` (its mechanism, which a cell condition
                 probes, shows as a deviation whose size the model decides: a cell it claims may
                 stay within the check's tolerance and pass);
  inapplicable - the cell passed, and an entry selects it whose hardware condition does not hold
                 on this machine (the bug's path is not taken here) and whose cell conditions the
                 cell's metrics do not refute: not applicable here, neither fixed nor a failure.
`min_curve_steps = N`, the older spelling, is `when = ["curve-steps-at-least-N"]`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from matrix.catalogue import conditions
from matrix.catalogue.conditions import Context, Requirement
from matrix.engines.traits import ENGINE_TRAITS
from matrix.models import MODELS
from matrix.selection.cells import Cell, axis_values, model_traits, trait_names

CATALOGUE_FILE = Path(__file__).with_name("known_failures.toml")
KINDS = ("bug", "intended")
TRAIT_KEY = "trait"  # a selector key beside the axes: {trait = ["full-weights"]} (models/base.py TRAITS)
ENGINE_TRAIT_KEY = "engine_trait"  # {engine_trait = ["casts-parameters"]} (engines/traits.py ENGINE_TRAITS)
EXCEPT_PREFIX = "not_"  # {not_engine = ["deepspeed-zero1"]}: any value of the axis but those


class CatalogueError(ValueError):
    """The catalogue file is malformed: the message names the file, the entry and the field."""


@dataclass(frozen=True)
class Entry:
    id: str
    title: str
    kind: str  # bug | intended
    upstream: tuple[str, ...]
    signature: re.Pattern
    selectors: tuple[dict[str, frozenset[str]], ...]
    versions: dict[str, SpecifierSet]
    workaround: str
    notes: str = ""
    when: tuple[Requirement, ...] = ()  # conditions that must all hold (matrix/catalogue/conditions.py)
    may_pass: bool = False  # a claimed cell that passes is passed, not fixed (a deviation's size varies)
    shown_by: str = ""  # a bug's cell whose standalone script shows it (matrix/releases/entry_releases.py)

    def unmet(self, context: Context, reads: str) -> list[Requirement]:
        """The entry's conditions reading `reads` ("hardware", "run", "cell") that do not hold."""
        return conditions.unmet(self.when, context, reads)

    @property
    def link(self) -> str:
        if not self.upstream:
            return "found by this matrix"
        owner_repo, number = self.upstream[0].split("#")
        return f"https://github.com/{owner_repo}/issues/{number}"

    def selects(self, cell: Cell, traits: frozenset[str] | None = None) -> bool:
        """Whether a selector matches the cell's axes and, where it names traits, one of the
        cell's model traits (default: its registered kind's, observed or declared; asked for
        only where the axes match, since observing builds the model)."""
        axes = {axis: {value} for axis, value in cell.axes().items()}
        # an engine's compiled twin is that engine too: what an entry says of the engine holds for
        # the twin, unless it names the twin itself (engine = ["torch-compile"])
        axes["engine"] |= {twin} if (twin := eager_twin_of(cell.engine)) else set()
        axes[ENGINE_TRAIT_KEY] = set(engine_traits_of(cell.engine))
        for selector in self.selectors:
            named = {axis: values for axis, values in selector.items() if axis != TRAIT_KEY}
            if not all(
                not (axes[axis.removeprefix(EXCEPT_PREFIX)] & values)
                if axis.startswith(EXCEPT_PREFIX)
                else bool(axes[axis] & values)
                for axis, values in named.items()
            ):
                continue
            wanted = selector.get(TRAIT_KEY)
            if wanted is None:
                return True
            if wanted & (model_traits(cell.model, wanted) if traits is None else traits):
                return True
        return False

    def versions_hold(self, installed: dict[str, str | None]) -> bool:
        for package, specifiers in self.versions.items():
            version = installed.get(package)
            if version is None or not specifiers.contains(Version(version), prereleases=True):
                return False
        return True

    def matches(self, signature_text: str) -> bool:
        return bool(self.signature.search(signature_text))


def engine_traits_of(engine: str) -> frozenset[str]:
    """The traits an engine declares (engines/traits.py); none for an engine not registered here."""
    from matrix.engines import ENGINES

    return getattr(ENGINES.get(engine), "traits", frozenset())


def local_context() -> Context:
    """This machine's hardware facts and this run's settings, as conditions read them."""
    from matrix.devices import hardware_facts
    from matrix.grid.schedule import train_steps

    return Context(hardware=hardware_facts(), run={"train_steps": train_steps()})


def eager_twin_of(engine: str) -> str | None:
    """The engine a compiled twin compiles (matrix/harness/compiling.py); None for any other engine."""
    from matrix.engines import ENGINES

    return getattr(ENGINES.get(engine), "eager_twin", None)


@dataclass
class Catalogue:
    entries: list[Entry] = field(default_factory=list)

    def in_force(self, cell: Cell, installed: dict[str, str | None], context: Context | None = None) -> list[Entry]:
        """The entries that claim the cell before it runs: selected, versions met, and every
        hardware and run condition holding (a cell condition is decided by classify())."""
        context = local_context() if context is None else context
        return [
            e
            for e in self.entries
            if not e.unmet(context, "run")
            and not e.unmet(context, "hardware")
            and e.selects(cell)
            and e.versions_hold(installed)
        ]

    def inapplicable(self, cell: Cell, installed: dict[str, str | None], context: Context | None = None) -> list[Entry]:
        """The entries that would claim the cell but for a hardware condition that does not hold here."""
        context = local_context() if context is None else context
        return [
            e
            for e in self.entries
            if e.unmet(context, "hardware")
            and not e.unmet(context, "run")
            and e.selects(cell)
            and e.versions_hold(installed)
        ]

    def by_id(self, entry_id: str) -> Entry:
        return next(e for e in self.entries if e.id == entry_id)


def classify(
    outcome: str,
    signature_text: str | None,
    entries_in_force: list[Entry],
    metrics: dict | None = None,
    inapplicable: list[Entry] = (),
) -> tuple[str, Entry | None]:
    """(outcome, entry): passed/failed become known, failed (new), fixed or inapplicable.
    `metrics`: the cell's metrics as results.json writes them, which the entries' cell
    conditions read (None: not known, they are taken to hold); `inapplicable`: the entries
    whose hardware condition does not hold here (Catalogue.inapplicable)."""
    observed = Context(metrics=metrics)
    claiming = [e for e in entries_in_force if not e.unmet(observed, "cell")]
    if outcome == "failed":
        entry = next((e for e in claiming if e.matches(signature_text or "")), None)
        return ("known", entry) if entry else ("failed", None)
    if outcome == "passed":
        expected = [e for e in claiming if not e.may_pass]
        if expected:
            return "fixed", expected[0]
        # an entry whose cell condition this cell's metrics refute would not claim it on any hardware
        elsewhere = [e for e in inapplicable if not e.unmet(observed, "cell")]
        if elsewhere:
            return "inapplicable", elsewhere[0]
    return outcome, None


def _fail(path: Path, where: str, problem: str) -> CatalogueError:
    return CatalogueError(f"{path}: {where}: {problem}")


def parse(text: str, path: Path = CATALOGUE_FILE, axes: dict[str, tuple[str, ...]] | None = None) -> Catalogue:
    axes = {**(axes or axis_values()), TRAIT_KEY: trait_names(), ENGINE_TRAIT_KEY: tuple(ENGINE_TRAITS)}
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise _fail(path, "file", f"not valid TOML ({error})") from None
    entries, seen = [], set()
    raw_entries = data.get("entry", [])
    if not isinstance(raw_entries, list) or not all(isinstance(raw, dict) for raw in raw_entries):
        raise _fail(path, "entry", "must be an array of tables, one [[entry]] per known failure")
    unknown_keys = sorted(set(data) - {"entry"})
    if unknown_keys:
        raise _fail(path, "file", f"unknown top-level key {unknown_keys[0]!r} (only [[entry]] tables)")
    for index, raw in enumerate(raw_entries):
        where = f"entry {raw.get('id', index)!r}"
        for key in ("id", "title", "kind", "signature", "cells", "workaround"):
            if key not in raw:
                raise _fail(path, where, f"missing field '{key}'")
        for key, kind in (("id", str), ("title", str), ("signature", str), ("cells", list), ("upstream", list)):
            if key in raw and not isinstance(raw[key], kind):
                raise _fail(path, where, f"field '{key}' must be a {'string' if kind is str else 'list'}")
        if not all(isinstance(selector, dict) for selector in raw["cells"]):
            raise _fail(path, where, "field 'cells' must be a list of {axis = [values]} tables")
        if not isinstance(raw.get("versions", {}), dict):
            raise _fail(path, where, "field 'versions' must be a table of package = specifier")
        steps = raw.get("min_curve_steps", 0)
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise _fail(path, where, "field 'min_curve_steps' must be a whole number of training steps")
        when_names = raw.get("when", [])
        if not isinstance(when_names, list) or not all(isinstance(n, str) for n in when_names):
            raise _fail(path, where, "field 'when' must be a list of condition names (matrix/catalogue/conditions.py)")
        if steps:  # the older spelling of a run condition
            when_names = [*when_names, f"curve-steps-at-least-{steps}"]
        try:
            when = tuple(Requirement.parse(name) for name in when_names)
        except conditions.UnknownCondition as error:
            raise _fail(path, where, f"field 'when': {error.args[0]}") from None
        may_pass = raw.get("may_pass", False)
        if not isinstance(may_pass, bool):
            raise _fail(path, where, "field 'may_pass' must be true or false")
        if may_pass and not any(r.reads == "cell" for r in when):
            raise _fail(path, where, "field 'may_pass' needs a cell condition in 'when' that probes the mechanism")
        if not isinstance(raw.get("shown_by", ""), str):
            raise _fail(path, where, "field 'shown_by' must be a cell id (a string)")
        if raw["id"] in seen:
            raise _fail(path, where, "duplicate id")
        seen.add(raw["id"])
        if raw["kind"] not in KINDS:
            raise _fail(path, where, f"field 'kind' is {raw['kind']!r}, expected one of {', '.join(KINDS)}")
        try:
            pattern = re.compile(raw["signature"])
        except re.error as error:
            raise _fail(path, where, f"field 'signature' is not a regular expression ({error})") from None
        for reference in raw.get("upstream", []):
            if not re.fullmatch(r"[\w.-]+/[\w.-]+#\d+", reference):
                raise _fail(path, where, f"field 'upstream' has {reference!r}, expected owner/repo#number")
        selectors = []
        for s_index, selector in enumerate(raw["cells"]):
            parsed = {}
            for axis, values in selector.items():
                excluded = axis.removeprefix(EXCEPT_PREFIX)  # not_engine = [...]: any engine but those
                if axis not in axes and not (
                    axis.startswith(EXCEPT_PREFIX) and excluded in axes and excluded != TRAIT_KEY
                ):  # not_trait would ask every kind's traits; not_engine_trait asks the engine only
                    raise _fail(path, where, f"cells[{s_index}] names unknown axis {axis!r}")
                values = [values] if isinstance(values, str) else values
                if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                    raise _fail(path, where, f"cells[{s_index}].{axis} must be a list of strings")
                known = axes[excluded]
                unknown = [v for v in values if v not in known and not (excluded == "model" and MODELS.claims(v))]
                if unknown:
                    raise _fail(path, where, f"cells[{s_index}].{axis} has unknown value {unknown[0]!r}")
                parsed[axis] = frozenset(values)
            selectors.append(parsed)
        versions = {}
        for package, spec in raw.get("versions", {}).items():
            try:
                versions[package] = SpecifierSet(spec)
            except (InvalidSpecifier, TypeError):
                raise _fail(path, where, f"versions.{package} is not a PEP 440 specifier: {spec!r}") from None
        entries.append(
            Entry(
                id=raw["id"],
                title=raw["title"],
                kind=raw["kind"],
                upstream=tuple(raw.get("upstream", [])),
                signature=pattern,
                selectors=tuple(selectors),
                versions=versions,
                workaround=raw["workaround"],
                notes=raw.get("notes", ""),
                when=when,
                may_pass=may_pass,
                shown_by=raw.get("shown_by", ""),
            )
        )
    return Catalogue(entries)


def load(path: Path = CATALOGUE_FILE) -> Catalogue:
    """One catalogue file."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise CatalogueError(f"{path}: cannot read it ({error.strerror or error})") from None
    return parse(text, Path(path))


REGISTERED: list[Path] = []  # files a plugin added with register(), in the order added


def register(path: Path | str) -> Path:
    """Add a catalogue file's entries to the built-in ones in every run of this process. The
    file is read when a run assembles its catalogue (after every plugin registered its model
    kinds, which its entries may name)."""
    path = Path(path)
    if path not in REGISTERED:
        REGISTERED.append(path)
    return path


def assemble(extra: tuple[Path, ...] = (), builtin: bool = True) -> Catalogue:
    """The run's catalogue: the built-in entries (unless builtin is False), then the registered
    files', then `extra`'s (--catalogue). An id given twice is an error naming both files."""
    sources = ([CATALOGUE_FILE] if builtin else []) + [p for p in (*REGISTERED, *extra)]
    entries: list[Entry] = []
    where: dict[str, Path] = {}
    for source in dict.fromkeys(sources):  # a file named twice counts once
        for entry in load(source).entries:
            if entry.id in where:
                raise CatalogueError(f"{source}: entry {entry.id!r}: id already used in {where[entry.id]}")
            where[entry.id] = source
            entries.append(entry)
    return Catalogue(entries)
