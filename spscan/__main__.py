"""Command line: ``python -m spscan demo`` (the main job) and ``python -m spscan bench``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m spscan", description=__doc__)
    parser.add_argument("command", choices=["demo", "bench"], help="what to run")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    ns, rest = parser.parse_known_args(argv[:1])
    if ns.command == "demo":
        from spscan.cli.demo import main as run
    else:
        from spscan.cli.bench import main as run
    return int(run(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
