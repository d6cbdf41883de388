"""The one home of name rules: datasets, servers, feeds, jobs and lease holders.

Names reach file names (a pool's side files), log lines, metric labels and status pages, so each
kind has one rule, checked wherever a name enters: a training script (``ConfigError``), an RPC
(``ProtocolError``), a pool (``DatasetError``). The message names the kind, the value (cut to 80
characters) and the rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kspeed.errors import KSpeedError, ProtocolError

__all__ = ["DATASET", "FEED_ID", "HOLDER", "JOB", "SERVER_ID", "NameRule"]

_SHOWN = 80


@dataclass(frozen=True)
class NameRule:
    """What a name of one kind may look like.

    Attributes:
        kind: what the name names, for messages (``"dataset name"``).
        pattern: the whole name must match it.
        rule: the pattern in words.
    """

    kind: str
    pattern: str
    rule: str

    def ok(self, value: object) -> bool:
        """Whether ``value`` is a valid name of this kind."""
        return isinstance(value, str) and re.fullmatch(self.pattern, value) is not None

    def check(
        self, value: object, error: type[KSpeedError] = ProtocolError, /, *, what: str = "", **fields: Any
    ) -> str:
        """Return ``value`` if it is a valid name, else raise ``error``.

        Args:
            value: the name (positional: ``fields`` may hold a ``value`` for the error).
            error: the exception class to raise (its keyword fields come from ``fields``).
            what: what the caller calls the value (default: :attr:`kind`).

        Raises:
            KSpeedError: of class ``error``, naming the kind, the value and the rule.
        """
        if self.ok(value):
            return str(value)
        shown = value[:_SHOWN] if isinstance(value, str) else value
        raise error(f"{what or self.kind} {shown!r} must be {self.rule}", **fields)


DATASET = NameRule(
    "dataset name",
    r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}",
    "1-128 letters, digits, '.', '_' or '-', starting with a letter or digit",
)
SERVER_ID = NameRule(
    "server id",
    r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}",
    "1-63 letters, digits, '.', '_' or '-', starting with a letter or digit",
)
FEED_ID = NameRule("feed id", r"[A-Za-z0-9._-]{1,64}", "1-64 letters, digits, '.', '_' or '-'")
JOB = NameRule(
    "job name",
    r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}",
    "1-128 letters, digits, '.', '_', ':', '@' or '-', starting with a letter or digit",
)
GROUP = NameRule(
    "group name",
    r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}",
    "1-128 letters, digits, '.', '_', ':', '@' or '-', starting with a letter or digit",
)
#: Free text naming who holds a lease (``pid 4242 on node7 rank 0``), shown by status and in logs:
#: no control character (C0, DEL, C1), line separator or bidirectional override, which would forge
#: log lines or disguise what a terminal shows.
HOLDER = NameRule(
    "lease holder",
    r"[^\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]{0,256}",
    "at most 256 characters, none of them a control character, line separator or bidirectional override",
)
