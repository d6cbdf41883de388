"""The explicit registry of rails, keyed by name, with what each can do.

Callers (and operators forcing a rail) name a rail; an unknown or unusable name fails loudly with
what this host offers instead of silently falling back to another rail. Everything outside this
package that chooses or lists rails asks the registry (names, availability, capabilities), so a
new rail is one :func:`register_rail` away from being offered, chosen and validated everywhere.
"""

from __future__ import annotations

import logging

from kspeed.errors import RailUnavailableError

from .base import Rail, RailCapabilities
from .shm import ShmRail
from .tcp import TcpRail
from .verbs import VerbsRail

__all__ = [
    "available_rails",
    "capabilities",
    "get_rail",
    "rail_names",
    "rail_status",
    "register_rail",
    "unregister_rail",
    "use_verbs_api",
]

log = logging.getLogger(__name__)

_RAILS: dict[str, Rail] = {}


def register_rail(rail: Rail) -> None:
    """Add a rail under ``rail.name`` (replacing one of the same name)."""
    _RAILS[rail.name] = rail


def unregister_rail(name: str) -> None:
    """Remove the rail called ``name`` (nothing happens if there is none)."""
    _RAILS.pop(name, None)


def rail_names() -> list[str]:
    """Every registered rail, usable here or not, sorted by name (the names a peer may announce)."""
    return sorted(_RAILS)


def rail_status() -> dict[str, str | None]:
    """Every registered rail with the reason it is unavailable here (``None`` when usable)."""
    return {name: rail.unavailable_reason() for name, rail in sorted(_RAILS.items())}


def available_rails() -> list[str]:
    """Names of the rails usable on this host, most preferred first (then by name)."""
    usable = [name for name, reason in rail_status().items() if reason is None]
    return sorted(usable, key=lambda name: (-_RAILS[name].capabilities.preference, name))


def capabilities(name: str) -> RailCapabilities:
    """What the rail called ``name`` can do (whether or not it is usable here).

    Raises:
        RailUnavailableError: no such rail.
    """
    rail = _RAILS.get(name)
    if rail is None:
        raise RailUnavailableError(f"unknown rail {name!r}; this host offers: {_offer()}")
    return rail.capabilities


def _offer() -> str:
    parts = []
    for name, reason in rail_status().items():
        parts.append(name if reason is None else f"{name} (unavailable: {reason})")
    return ", ".join(parts) or "none"


def get_rail(name: str) -> Rail:
    """The rail called ``name``.

    Raises:
        RailUnavailableError: no such rail, or it cannot run on this host; the message lists the
            rails this host offers and why the others are out.
    """
    rail = _RAILS.get(name)
    if rail is None:
        raise RailUnavailableError(f"unknown rail {name!r}; this host offers: {_offer()}")
    reason = rail.unavailable_reason()
    if reason is not None:
        raise RailUnavailableError(f"rail {name!r} is unavailable: {reason}; this host offers: {_offer()}")
    log.debug("rail %s selected", name)
    return rail


def use_verbs_api(spec: str | None) -> None:
    """Make the ``verbs`` rail drive ``spec`` in this process (``None``/``"pyverbs"``: pyverbs; else
    ``module:attribute`` of another :class:`~kspeed.rdma.verbs.api.VerbsApi`). Each process that
    offers or uses the rail calls it with its configuration (``verbs_api``)."""
    spec = None if spec in (None, "", "pyverbs") else spec
    current = _RAILS.get(VerbsRail.name)
    if not isinstance(current, VerbsRail) or current.api_spec != spec:
        if isinstance(current, VerbsRail):
            current.close()  # the NICs it opened
        register_rail(VerbsRail(spec))


register_rail(ShmRail())
register_rail(TcpRail())
register_rail(VerbsRail())
