"""Package and protocol versions (one place, read by the handshake of every daemon)."""

__version__ = "0.1.0"

# Control-plane protocol versions this build speaks (package kspeed.v1). A peer must share one.
PROTOCOL_VERSIONS: tuple[int, ...] = (1,)

# Optional capabilities announced at registration; peers use them only when both sides list them.
FEATURES: tuple[str, ...] = ("membership-watch", "health-probe")


def version_line(program: str) -> str:
    """What ``--version`` prints: the program, the package version and the protocol versions."""
    return f"{program} {__version__} (protocol {', '.join(f'v{v}' for v in PROTOCOL_VERSIONS)})"
