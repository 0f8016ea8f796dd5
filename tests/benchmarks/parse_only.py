"""Parses command lines with the argparse of the script or module each names, running nothing after the parse.

Reads a JSON list of command lines on stdin, each `[SCRIPT.py, ARG...]` or `["-m", MODULE, ARG...]`, and prints a JSON
list of {"ok", "output"}: each runs as `python ...` would (its module-level code and `main` up to its first
`parse_args`), and stops right after that call returns, so nothing is measured and no GPU is needed. `--help` in a
command line prints the help and counts as parsed. A command whose arguments its parser refuses is not ok, with
argparse's message as its output.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import sys
import traceback
from pathlib import Path


class Parsed(Exception):
    """Raised by the first parse_args once it has parsed: the command line is accepted."""


def parse_then_stop(original):
    def parse_args(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    return parse_args


def check(command: list[str]) -> dict:
    output = io.StringIO()
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            if command[0] == "-m":
                sys.argv = [command[1], *command[2:]]
                runpy.run_module(command[1], run_name="__main__", alter_sys=True)
            else:
                script = Path(command[0]).resolve()
                sys.argv = [str(script), *command[1:]]
                sys.path.insert(0, str(script.parent))  # as `python script.py` puts the script's folder first
                runpy.run_path(str(script), run_name="__main__")
        return dict(ok=False, output=output.getvalue() + "\nran to its end without parsing its arguments")
    except Parsed:
        return dict(ok=True, output=output.getvalue())
    except SystemExit as e:  # --help exits 0; a refused argument 2
        return dict(ok=e.code in (0, None), output=output.getvalue())
    except BaseException:
        return dict(ok=False, output=output.getvalue() + traceback.format_exc())
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def main() -> None:
    commands = json.loads(sys.stdin.read())
    argparse.ArgumentParser.parse_args = parse_then_stop(argparse.ArgumentParser.parse_args)
    results = [check(command) for command in commands]
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
