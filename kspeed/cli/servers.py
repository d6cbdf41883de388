"""``kspeed server``: retire a server cleanly (``drain``) and discard what a retired one left (``purge``)."""

from __future__ import annotations

import argparse
import time

from kspeed.cli.args import say, subcommand
from kspeed.config import ClientConfig, ServerConfig, add_arguments, format_bytes, load_config
from kspeed.control.lifecycle import state_name
from kspeed.control.manager_client import ManagerClient
from kspeed.errors import UnavailableError
from kspeed.proto import kspeed_pb2

LEFT = kspeed_pb2.ServerState.SERVER_STATE_LEFT
DRAINING = kspeed_pb2.ServerState.SERVER_STATE_DRAINING
POLL = 0.5  # seconds between looks at a drain being followed


def cmd_drain(args: argparse.Namespace) -> int:
    """Hand every share of a server to other servers while it serves on; with ``--wait``, follow
    the drain until the server has left."""
    with ManagerClient(load_config(ClientConfig, args), peer_name="kspeed-cli") as client:
        reply = client.drain_server(args.id, allow_degraded=args.allow_degraded)
        shares = ", ".join(f"{s.dataset}@{s.first_id}" for s in reply.shares) or "none"
        say(f"draining {args.id}: {len(reply.shares)} share(s) to hand off ({shares})")
        if not args.wait:
            say("follow it with: kspeed status (the server leaves once its shares are held elsewhere)")
            return 0
        deadline = time.monotonic() + args.wait_timeout
        last = ""
        while True:
            record = next((r for r in client.servers(include_left=True) if r.id == args.id), None)
            held = [
                f"{d.spec.name}@{s.first_id}" + (f" -> {s.handoff_to}" if s.handoff_to else "")
                for d in client.datasets()
                for s in d.shares
                if s.server_id == args.id
            ]
            if record is not None and record.state == LEFT:
                say(f"{args.id} left: {record.state_reason}")
                return 0
            line = (
                f"{args.id} {state_name(record.state) if record else 'unknown'}; holds: {', '.join(held) or 'nothing'}"
            )
            if line != last:
                say(line)
                last = line
            if record is not None and record.state != DRAINING and not held:
                say(f"{args.id} holds nothing and is {state_name(record.state)}: {record.state_reason}")
                return 0
            if time.monotonic() > deadline:
                raise UnavailableError(
                    f"{args.id} still holds {', '.join(held) or 'nothing'} after {args.wait_timeout:g}s (the new "
                    "holders are loading; `kspeed status` shows their progress)"
                )
            time.sleep(POLL)


def cmd_purge(args: argparse.Namespace) -> int:
    """Discard a stopped server's pool files, assignments and cluster id (run on its host, with its configuration)."""
    from kspeed.server.local_state import purge

    purged = purge(load_config(ServerConfig, args, overrides={"security.auth": "none"}))  # it calls no one
    where = f"pool {purged.pool_dir} ({format_bytes(purged.pool_bytes)})" if purged.pool_dir else "no pool"
    files = ", ".join(purged.state_files) or "no state files"
    say(f"purged server {purged.server_id or '(no identity yet)'}: {where}; removed {files}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``kspeed server drain`` and ``kspeed server purge``."""
    server = sub.add_parser(
        "server", help="retire servers: drain, purge", description="Retire a server cleanly, or discard what it left."
    )
    actions = server.add_subparsers(dest="action", required=True, metavar="ACTION")
    drain = subcommand(
        actions,
        "drain",
        "hand a server's shares to other servers while it serves on, then let it leave",
        "  kspeed server drain srv-1a2b3c4d --wait\n"
        "  kspeed server drain srv-1a2b3c4d --allow-degraded   no room elsewhere: a survivor serves on demand\n",
    )
    drain.add_argument("id", metavar="ID", help="the server's id (kspeed status lists them)")
    drain.add_argument(
        "--allow-degraded",
        action="store_true",
        help="where no server has room for a share, let a survivor serve it on demand instead of refusing",
    )
    drain.add_argument("--wait", action="store_true", help="follow the drain until the server has left")
    drain.add_argument(
        "--wait-timeout", type=float, default=3600.0, metavar="S", help="with --wait: give up after S seconds"
    )
    drain.set_defaults(func=cmd_drain)
    purge = subcommand(
        actions,
        "purge",
        "discard a stopped server's pool and state (run on its host with its configuration)",
        "  kspeed server purge --config /etc/kspeed/kspeed.yaml\n"
        "  kspeed server purge --state-dir /var/lib/kspeed/server\n",
        manager=False,
    )
    add_arguments(purge, ServerConfig, only=("state_dir", "pool_dir", "server_id"))
    purge.set_defaults(func=cmd_purge)
