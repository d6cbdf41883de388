"""What every ``kspeed`` subcommand shares: how it is declared, and how it speaks."""

from __future__ import annotations

import argparse

from kspeed.config import CONNECTION_FIELDS, ClientConfig, add_arguments


def say(text: str) -> None:
    """Print one line at once (a pipe sees it before the command ends)."""
    print(text, flush=True)


def subcommand(
    sub: argparse._SubParsersAction, name: str, help: str, examples: str = "", *, manager: bool = True
) -> argparse.ArgumentParser:
    """A subcommand; ``manager``: it talks to a manager, so it takes the connection flags (and only those)."""
    parser = sub.add_parser(
        name,
        help=help,
        description=help[0].upper() + help[1:] + ".",
        epilog=f"examples:\n{examples}" if examples else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if manager:
        add_arguments(parser, ClientConfig, only=CONNECTION_FIELDS)
    return parser
