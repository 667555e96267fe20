"""Shared CLI output: one rich console for people, plain lines for machines, and the exit codes.

Exit codes of every command:
  0  done (the spec is valid)
  2  invalid input: the spec has errors (or the command line is wrong; click's usage errors also use 2)
  1  anything else: a file that cannot be read, a deployment that cannot be reached, an internal failure
"""

from __future__ import annotations

import sys
from typing import NoReturn

import typer
from rich.console import Console

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_INVALID = 2

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def plain(line: str = "", *, err: bool = False) -> None:
    """A line that tools parse (FILE:LINE:COL: ...): never wrapped, never styled, no markup interpreted."""
    print(line, file=sys.stderr if err else sys.stdout, flush=True)


def warn(message: str) -> None:
    plain(f"warning: {message}", err=True)


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    """Print `error: message` on stderr and end the command with `code`."""
    plain(f"error: {message}", err=True)
    raise typer.Exit(code)


def examples(*lines: str) -> str:
    """A help epilog listing example invocations (kept verbatim by rich's help renderer)."""
    body = "\n\n".join(f"  [bold]$ {line}[/bold]" for line in lines)
    return f"[bold]Examples[/bold]\n\n{body}"
