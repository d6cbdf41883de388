"""Refuse to start worker processes from a line of the main script that each of them would run again.

A process started with ``spawn`` imports the training script again, as ``__mp_main__``, before it
does any work: every statement at the script's top level runs once more in it, except under
``if __name__ == "__main__":``. So does one forked from multiprocessing's forkserver: it runs the
same preparation after the fork, since KSpeed does not have the forkserver preload ``__main__``
(:mod:`kspeed.client.prep.start_method`; on CPython 3.11 asking for it has no effect: the server is
never told the script's path).
A script that starts the transform workers from its top level (wrapping or iterating a dataset
there, or calling a function that does) makes each worker connect, wrap and start workers of its
own; multiprocessing refuses the last step, the worker dies, and the training loop learned only
after its timeouts that "a worker died". :func:`check_main_guarded` finds the statement of the main
script the call comes from and refuses at once, naming the guard, as torch's DataLoader and
multiprocessing advise.
"""

from __future__ import annotations

import ast
import sys
from types import FrameType

from kspeed.errors import StateError

__all__ = ["check_main_guarded"]


def _is_main_test(test: ast.expr) -> bool:
    """Whether ``test`` is ``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = (test.left, test.comparators[0])
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(
        isinstance(s, ast.Constant) and s.value == "__main__" for s in sides
    )


def _within(body: list[ast.stmt], line: int) -> bool:
    return bool(body) and body[0].lineno <= line <= (body[-1].end_lineno or body[-1].lineno)


def _guarded(body: list[ast.stmt], line: int) -> bool:
    """Whether ``line`` lies under ``if __name__ == "__main__":`` within the statements ``body``
    (directly, or inside another block such as a ``try``)."""
    for stmt in body:
        if not stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
            continue
        if isinstance(stmt, ast.If) and _is_main_test(stmt.test) and _within(stmt.body, line):
            return True
        blocks = [getattr(stmt, name, None) for name in ("body", "orelse", "finalbody")]
        blocks += [handler.body for handler in getattr(stmt, "handlers", [])]
        return any(isinstance(block, list) and _guarded(block, line) for block in blocks)
    return False


def _main_statement(main: object) -> int | None:
    """The line of the main script's top-level statement that the current call comes from."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is getattr(main, "__dict__", None) and frame.f_code.co_name == "<module>":
            return frame.f_lineno
        frame = frame.f_back
    return None


def check_main_guarded(what: str) -> None:
    """Refuse to start ``what`` (processes that import the main script again, whether spawned or
    forked from the forkserver) from a top-level statement of the main script that is not under
    ``if __name__ == "__main__":``, since each process would run it again.

    Nothing is refused when there is no script to import again (an interactive session,
    ``python -c``) or its source cannot be read.

    Raises:
        StateError: naming the script, the line and the guard.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return
    line = _main_statement(main)
    if line is None:
        return
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
    except (OSError, SyntaxError, ValueError):
        return
    if _guarded(tree.body, line):
        return
    raise StateError(
        f"{what} are processes that each import the main script {path} again: its line {line}, which starts "
        "them, would run again in each one (and fail there). Put the script's top-level code under "
        '`if __name__ == "__main__":` (as for DataLoader workers), or pass num_workers=0'
    )
