"""Command line of spscan: ``python -m spscan demo`` (the main job), ``python -m spscan bench`` and
``python -m spscan calibrate``."""

from __future__ import annotations

import argparse
import sys

_DESCRIPTION = "spscan: back-propagation as a parallel scan over sparse transposed Jacobians."

_EPILOG = """commands:
  demo    train the paper's RNN with autograd and with spscan, check their gradients agree,
          and write a plot and summary.json (python -m spscan demo --quick: a short run)
  bench   run the benchmark suites and write a report (python -m spscan bench --quick)
  calibrate
          fit this machine's step-cost profile (what spscan.wrap's backward="auto" predicts
          from) and cache it; once per machine, torch build and thread count

Each command has its own options: python -m spscan demo --help, python -m spscan bench --help."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spscan", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["demo", "bench", "calibrate"], help="what to run (see below)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help(sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    ns, _ = parser.parse_known_args(argv[:1])
    if ns.command == "demo":
        from spscan.cli.demo import main as run
    elif ns.command == "calibrate":
        from spscan.cli.calibrate import main as run
    else:
        from spscan.cli.bench import main as run
    return int(run(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
