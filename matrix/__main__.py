"""python -m matrix bisect ... (matrix/bisect.py), python -m matrix repro ... (matrix/repro.py) and
python -m matrix replay ... (one cell, optionally with an exploration's variant)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m matrix")
    commands = parser.add_subparsers(dest="command", required=True)
    bisect = commands.add_parser("bisect", help="find the release that changed one cell's outcome")
    bisect.add_argument("--package", required=True)
    bisect.add_argument("--good", required=True, help="a version at one end (either order)")
    bisect.add_argument("--bad", required=True, help="a version at the other end")
    bisect.add_argument(
        "--cell", required=True, help="a cell id, e.g. gemma-cache-bf16-loaded-mixed-eval-cpu-accelerate"
    )
    bisect.add_argument("--stack", default="default", help="stack from matrix/stacks.toml to bisect on")
    bisect.add_argument("--report-dir", default=str(Path(__file__).resolve().parent.parent / "reports"))
    repro = commands.add_parser("repro", help="write a standalone script that reproduces one cell")
    repro.add_argument("cell", help="a cell id, e.g. tiny-transformer-bf16-mixed-eval-cpu-torch")
    repro.add_argument("--run", type=Path, help="a report directory or results.json: its pins and failing phase")
    repro.add_argument("-o", "--output", type=Path, help="where to write the script (default: stdout)")
    repro.add_argument("--variant", help="settings as JSON, as an exploration's finding records them")
    replay = commands.add_parser("replay", help="run one cell, optionally with an exploration's variant")
    replay.add_argument("cell", help="a cell id, e.g. tiny-transformer-bf16-mixed-eval-cpu-torch")
    replay.add_argument("--variant", help="settings as JSON (default: the grid's)")
    replay.add_argument("--cuda-device", type=int, default=0)
    args, extra = parser.parse_known_args(argv)

    if args.command == "replay":
        return replay_cell(args.cell, args.variant, args.cuda_device)

    if args.command == "repro":
        from matrix.repro import ReproError, generate

        try:
            script = generate(args.cell, args.run, args.variant)
        except ReproError as error:
            print(f"python -m matrix repro: {error}", file=sys.stderr)
            return 2
        if args.output:
            args.output.write_text(script)
        else:
            sys.stdout.write(script)
        return 0

    from matrix.bisect import BisectError
    from matrix.bisect import bisect as run_bisect

    try:
        run_bisect(args.package, args.good, args.bad, args.cell, args.stack, Path(args.report_dir), extra)
    except BisectError as error:
        print(f"python -m matrix bisect: {error}", file=sys.stderr)
        return 2
    return 0


def replay_cell(cell_id: str, variant_json: str | None, cuda_index: int) -> int:
    """Exit 0 when the cell passes, 1 when it fails (its signature first), 2 on bad input."""
    import tempfile

    from matrix.cells import cell_from_id
    from matrix.models import MODELS
    from matrix.phases import run_cell
    from matrix.variants import InvalidVariant, from_json

    cell = cell_from_id(cell_id)
    if cell is None:
        print(f"python -m matrix replay: no cell {cell_id!r}", file=sys.stderr)
        return 2
    variant = None
    if variant_json is not None:
        try:
            variant = from_json(variant_json, MODELS[cell.model].grid_variant)
            MODELS[cell.model].check_variant(variant)
        except (InvalidVariant, ValueError) as error:
            print(f"python -m matrix replay: --variant: {error}", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="matrix-replay-") as workdir:
        result = run_cell(cell, Path(workdir), cuda_index, variant=variant)
    if result.outcome == "passed":
        print(f"{cell.id}: passed")
        return 0
    print(f"{result.signature.id} {result.signature.text}\n{cell.id}: failed in {result.phase}\n{result.message}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
