"""python -m matrix bisect ... (matrix/bisect.py) and python -m matrix repro ... (matrix/repro.py)."""

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
    args, extra = parser.parse_known_args(argv)

    if args.command == "repro":
        from matrix.repro import ReproError, generate

        try:
            script = generate(args.cell, args.run)
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


if __name__ == "__main__":
    sys.exit(main())
