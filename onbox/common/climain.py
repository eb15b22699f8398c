"""The one entry point both CLIs (``rgt-agent`` and ``rgt``) run their click group through:
the job's command split off after ``--``, an ``RgtError`` printed as one line (control
characters as '?'; each line of another machine's text it carries under ``  | ``) and exited
with its code (onbox.common.errors), click's own usage errors exit 2, each with its code
even where its line cannot be written (a stderr that is gone); anything else is a bug and
shows its traceback."""

from __future__ import annotations

import sys
from typing import Any, Callable, List, Optional

import click

from onbox.common.errors import RgtError
from onbox.common.terminal import printable_error


def run_cli(
    group: click.Group,
    prog_name: str,
    argv: Optional[List[str]] = None,
    line: Optional[Callable[[RgtError], str]] = None,
) -> int:
    """Run ``group`` on ``argv`` (default: this process's arguments); its exit code. The words
    after ``--`` reach the commands as ``ctx.obj["command"]``; ``line`` renders an error
    (default: its own ``line()``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = None
    if "--" in args:
        i = args.index("--")
        args, command = args[:i], args[i + 1 :]
    try:
        rv: Any = group.main(
            args=args, prog_name=prog_name, standalone_mode=False, obj={"command": command}
        )
    except RgtError as e:
        # Many an error carries what another machine said (a box's stderr, a store's reason):
        # none of its escape sequences reaches the terminal, and none of its lines passes for
        # a further line of rgt's own.
        _said(printable_error(e.line() if line is None else line(e)))
        return e.exit_code
    except click.exceptions.UsageError as e:
        _said(f"rgt: {e.format_message()}")
        return 2
    except click.exceptions.Abort:
        return 130
    except click.exceptions.Exit as e:
        return int(e.exit_code)
    return rv if isinstance(rv, int) else 0


def _said(text: str) -> None:
    """``text`` on stderr, where it still goes: a stderr that is gone (``| head`` done: EPIPE;
    a closed file) must not turn the error's exit code into a traceback's 1."""
    try:
        click.echo(text, err=True)
    except (OSError, ValueError):
        pass
