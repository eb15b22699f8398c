"""``rgt``: the laptop side. Deploy, observe, pull and teardown arrive with the controller issue;
until then it reports its version and points at the agent."""

from __future__ import annotations

import sys
from typing import List, Optional

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="remote-gpu-trainer", prog_name="rgt")
def cli() -> None:
    """rgt: train on a rented GPU without losing work.

    The laptop commands (deploy, status, pull, down) are not built yet; on the box, use
    `rgt-agent`.
    """


def main(argv: Optional[List[str]] = None) -> int:
    try:
        cli.main(args=argv, prog_name="rgt", standalone_mode=False)
    except click.exceptions.UsageError as e:
        click.echo(f"rgt: {e.format_message()}", err=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
