"""The `medserve` command line: one entry point, sub-commands contributed by the front ends.

Each command group is a module exposing `add_commands(subparsers)`, which registers its sub-commands with
`set_defaults(handler=callable)`; a handler takes the parsed namespace and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import warnings

from medserve.errors import MedserveError, one_line

COMMAND_GROUPS: list[str] = [
    "medserve.server.commands",
    "medserve.packaging.commands",
]


# `import monai` imports Holoscan (through monai.deploy), which warns about the stack size at import. The CLI's
# commands never run a Holoscan graph in this process (apps and MAPs run in their own), so the warning is noise.
warnings.filterwarnings("ignore", message="Current stack size", category=RuntimeWarning)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="medserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (repeatable)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_GROUPS:
        importlib.import_module(module_name).add_commands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from medserve.logs import configure_logging

    configure_logging(args.verbose or None)  # no -v: MEDSERVE_LOG_LEVEL may set the level
    try:
        return int(args.handler(args) or 0)
    except MedserveError as error:
        logging.getLogger("medserve").debug("command failed", exc_info=True)
        print(f"error: {one_line(str(error))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as error:
        stop = signal.Signals(getattr(error, "signum", signal.SIGINT))
        print(f"error: interrupted by {stop.name}", file=sys.stderr)  # one error line, as the app's
        return 128 + stop


if __name__ == "__main__":
    sys.exit(main())
