"""The one home of what a dataset URI may carry: a location, never a credential.

A dataset's URI is stored in the manager's registry, sent with every assignment and kept in the
servers' state, shown by ``/v1/status`` and ``kspeed dataset show``, and written to logs. So it
must hold nothing secret: credentials belong to the servers' configuration (``backend_options``,
per protocol), never to a dataset. A URI is refused, wherever it enters (a training script, the
manager, a server), if it carries

* a user name and password (``http://alice:pw@host/...``, ``s3://KEY:SECRET@bucket/...``), or a
  user name alone (a token passed as a user, ``https://TOKEN@host/...``), except on Azure's
  protocols, whose ``container@account`` names a container;
* a query parameter that carries a credential: a signature (presigned S3, GCS and Azure SAS
  URLs), a token, a key, a password or a secret (:data:`SECRET_WORDS`);
* a control character (it would forge log lines and terminal output), or more than
  :data:`MAX_URI` characters.

Refusing is the sound choice rather than splitting a credential off and keeping it for the servers:
a credential kept anywhere but the servers' configuration is one more copy to leak, and a client
should not choose what the servers authenticate as. A refusal's message shows the URI with
credentials replaced by ``***`` (:func:`redact`), so the secret is not echoed either. Secrets that a
path itself embeds (``/token/abc/data``) cannot be told from a path and are not caught.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote_plus

from kspeed.errors import KSpeedError, ProtocolError

__all__ = ["MAX_URI", "SECRET_WORDS", "check", "credentials", "redact"]

MAX_URI = 4096
_SHOWN = 200

#: Query parameter names (lower-cased) that are credentials whole: Azure SAS's ``sig``, API keys.
SECRET_NAMES = frozenset({"sig", "key", "code", "auth", "pass", "pw", "pwd", "jwt", "sas"})
#: Words that make a query parameter a credential wherever they occur in its name
#: (``X-Amz-Signature``, ``X-Amz-Credential``, ``X-Amz-Security-Token``, ``X-Goog-Signature``,
#: ``AWSAccessKeyId``, ``GoogleAccessId``, ``access_token``, ``client_secret``, ``api_key``...).
SECRET_WORDS = (
    "signature",
    "credential",
    "token",
    "secret",
    "passw",
    "apikey",
    "api_key",
    "api-key",
    "accesskey",
    "access_key",
    "accessid",
    "authoriz",
    "session",
)
#: Protocols whose ``user@host`` names a container, not a user (``abfs://container@account...``).
CONTAINER_AT = frozenset({"abfs", "abfss", "az", "wasb", "wasbs"})

_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<authority>[^/?#]*)")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_PARAM = re.compile(r"(?P<sep>[?&;#])(?P<name>[^=&;#?]*)(?P<eq>=?)(?P<value>[^&;#?]*)")


def _secret_param(name: str) -> bool:
    key = unquote_plus(name).strip().lower()
    return key in SECRET_NAMES or any(word in key for word in SECRET_WORDS)


def _query_at(part: str) -> int:
    """Where the query or fragment of one URL starts (its length if it has neither)."""
    found = [i for i in (part.find("?"), part.find("#")) if i >= 0]
    return min(found) if found else len(part)


def credentials(uri: str) -> str:
    """What credentials ``uri`` carries, in words that never include them; ``""`` if none.

    Each URL of a chained URL (``simplecache::https://...``) is looked at; a plain path has none.
    """
    found: list[str] = []
    for part in uri.split("::"):
        match = _URL.match(part)
        if match is None:
            continue
        userinfo, at, _ = unquote_plus(match["authority"]).rpartition("@")
        if at and ":" in userinfo:
            found.append("a user name and password (user:password@)")
        elif at and match["scheme"].lower() not in CONTAINER_AT:
            found.append("a user name (user@), which may be a token")
        names = [m["name"] for m in _PARAM.finditer(part, _query_at(part)) if _secret_param(m["name"])]
        if names:
            shown = ", ".join(repr(unquote_plus(n)) for n in names[:3])
            found.append(f"the query parameter{'s' if len(names) > 1 else ''} {shown}")
    return " and ".join(found)


def redact(uri: str) -> str:
    """``uri`` with its credentials replaced by ``***``, cut to 200 characters: safe to show."""

    def one(part: str) -> str:
        match = _URL.match(part)
        if match is None:
            return part
        authority = match["authority"]
        if "@" in unquote_plus(authority) and match["scheme"].lower() not in CONTAINER_AT:
            authority = "***@" + authority.rpartition("@")[2]
        start = _query_at(part)
        tail = _PARAM.sub(
            lambda m: m.group(0) if not _secret_param(m["name"]) else f"{m['sep']}{m['name']}{m['eq']}***",
            part[start:],
        )
        return f"{match['scheme']}://{authority}{part[match.end() : start]}{tail}"

    shown = "::".join(one(part) for part in uri.split("::"))
    shown = _CONTROL.sub("?", shown)
    return shown if len(shown) <= _SHOWN else shown[:_SHOWN] + "..."


def check(uri: object, error: type[KSpeedError] = ProtocolError, /, *, what: str = "dataset URI", **fields: Any) -> str:
    """Return ``uri`` if a dataset may carry it, else raise ``error``.

    Args:
        uri: the URI (positional: ``fields`` may hold a ``value`` for the error).
        error: the exception class to raise (its keyword fields come from ``fields``).
        what: what the caller calls the URI, first in the message (``"dataset 'imgs': uri"``).

    Raises:
        KSpeedError: of class ``error``: the URI is empty, too long, holds a control character or
            carries credentials (the message says where credentials belong, and shows the URI
            redacted).
    """
    if not isinstance(uri, str) or not uri or len(uri) > MAX_URI:
        length = len(uri) if isinstance(uri, str) else type(uri).__name__
        raise error(f"{what} must be a string of 1-{MAX_URI} characters (got {length})", **fields)
    if _CONTROL.search(uri):
        raise error(f"{what} {redact(uri)!r} holds a control character; a URI is printable text", **fields)
    found = credentials(uri)
    if found:
        raise error(
            f"{what} {redact(uri)!r} carries credentials ({found}); credentials belong in the servers' configuration "
            "(backend_options, per protocol: KSPEED_BACKEND_OPTIONS or --backend-options), never in a URI, which is "
            "stored, shown and logged: remove them from the URI and have the servers' operator configure them",
            **fields,
        )
    return uri
