"""The `specd` command line.

Contract: every subcommand either does its job or prints one line `specd: error: <reason>` to
stderr and exits 2; a traceback is never the answer to bad input. `--json` output is one JSON
object on stdout.
"""

from __future__ import annotations

import argparse
import logging
import sys

from specd.cli.demo_command import add_demo_parser
from specd.cli.generate import add_generate_parser
from specd.cli.pretrain_command import add_pretrain_parser
from specd.cli.service import add_learner_parser, add_serve_parser
from specd.cli.store_commands import add_store_parsers
from specd.core.errors import SpecdError
from specd.serving.vllm.shared.command import add_vllm_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_demo_parser(sub)
    add_store_parsers(sub)
    add_serve_parser(sub)
    add_learner_parser(sub)
    add_pretrain_parser(sub)
    add_vllm_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args))
    except SpecdError as error:  # every failure a person can fix; anything else is a bug and shows as one
        print(f"specd: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl+C: what was written stays written (pretraining resumes from its work folder)
        print("specd: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
