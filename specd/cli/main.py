"""The `specd` command line.

Contract: every subcommand either does its job or exits 2 with one line `specd: error: <reason>`
on stderr (a mistake on the command line: argparse's usage, then one line `specd SUBCOMMAND:
error: ...`); a traceback is never the answer to bad input. `--json` output is one JSON object on
stdout. Ctrl+C ends a command with status 130 and one line, from the first moment (the
subcommands' modules, which import torch, load inside `main`), and SIGTERM the same way with status
143 (servers drain first, by their own handlers); a reader that goes away (`specd
versions | head`) ends it with status 141 and no word. A full disk (`core.errors.out_of_space`) is
said in one line, status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from specd.core.errors import SpecdError, out_of_space


def build_parser() -> argparse.ArgumentParser:
    from specd.cli.demo_command import add_demo_parser
    from specd.cli.generate import add_generate_parser
    from specd.cli.pretrain_command import add_pretrain_parser
    from specd.cli.service import add_learner_parser, add_serve_parser
    from specd.cli.store_commands import add_store_parsers
    from specd.serving.vllm.shared.command import add_vllm_parser

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


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an interruption so that the same cleanup runs as for Ctrl+C (a demo's
    learner process stopped, its temporary store removed). Servers install their own handlers."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    if argv is None and threading.current_thread() is threading.main_thread():   # the command itself, not a test
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        args = build_parser().parse_args(argv)
        # timed: a service's log is read against what happened when (a broker restart, a swap)
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return int(args.run(args))
    except SpecdError as error:  # every failure a person can fix; anything else is a bug and shows as one
        print(f"specd: error: {error}", file=sys.stderr)
        return 2
    except Terminated:
        print("specd: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:  # Ctrl+C: what was written stays written (pretraining resumes from its work folder)
        print("specd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout's reader went away: nothing more can be said there, and Python's own flush at exit
        # must not fail again on the closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as error:
        if not out_of_space(error):
            raise
        # a full disk is the machine's state, not a bug: say where, in one line
        print(f"specd: error: no space left on the device: {str(error).splitlines()[0][:300]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
