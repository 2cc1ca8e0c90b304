"""The command-line plumbing lab.py, train.py and `lab.py watch` share: argparse errors on one line, and a
user error (LabError, a rung that does not compile) printed as one line with exit status 2."""

from __future__ import annotations

import argparse
import sys

from .errors import LabError


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line; `prog` names the command."""

    def error(self, message):  # one line, not argparse's usage block
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def command(prog: str, run, args) -> int:
    """run(args) as a command's exit status: a user error one line on stderr and 2, Ctrl-C 130 without a
    traceback."""
    import kernels  # the CLI's own errors need no compiler; a rung's compile error is the user's too

    try:
        return run(args)
    except (LabError, kernels.KernelCompileError) as exc:
        sys.stdout.flush()
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
