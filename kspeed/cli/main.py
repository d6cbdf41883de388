"""The ``kspeed`` command: run a local cluster and look at a running one.

kspeed up [--servers N] [--port PORT] [--http-port PORT] [--state-dir DIR] [--memory SIZE]
kspeed status [--manager HOST:PORT] [--json] [--job NAME]
kspeed dataset add NAME URI [--kind K] [--labels dirname] [--quota SIZE] [--policy P]
kspeed dataset list [--json] | show NAME | rm NAME [--force]
kspeed preload NAME
kspeed server drain ID [--wait] [--allow-degraded] | purge [--config FILE]
kspeed doctor server|client [--config FILE] [--json]
kspeed analyze --dataset NAME --batch-size N --step PKG.MOD:FUNC|--step-ms MS|--step-cpu-ms MS [--report DIR]
kspeed demo [--servers N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from kspeed._version import version_line
from kspeed.cli import analyze, doctor, servers
from kspeed.cli.args import say, subcommand
from kspeed.cli.cluster import LocalCluster
from kspeed.cli.tables import dataset_table, job_table, status_table
from kspeed.client.spec import DatasetSpec
from kspeed.config import ClientConfig, format_bytes, load_config, parse_bytes
from kspeed.control.daemon import StopSignals
from kspeed.control.manager_client import ManagerClient
from kspeed.control.progress import follow_preload
from kspeed.control.status import dataset_dict, human_bytes, job_dict, status_dict
from kspeed.errors import ConfigError, KSpeedError
from kspeed.policies import POLICIES
from kspeed.proto import kspeed_pb2

READY = kspeed_pb2.ServerState.SERVER_STATE_READY


def cmd_up(args: argparse.Namespace) -> int:
    """Run one manager and N servers on loopback in the foreground until Ctrl-C or SIGTERM."""
    if args.servers < 0:
        raise KSpeedError(f"--servers must be 0 or more, not {args.servers}")
    keep = bool(args.state_dir)
    # A temporary cluster keeps its pools in memory (tmpfs) when it can, and removes them on exit.
    state_dir = args.state_dir or tempfile.mkdtemp(
        prefix="kspeed-up-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    allow = args.backend_allow or f"{os.getcwd()},{tempfile.gettempdir()}"
    server_args = ["--memory", args.memory, "--region-size", args.region_size, "--backend-allow", allow]
    cluster = LocalCluster(
        state_dir,
        servers=args.servers,
        port=args.port,
        http_port=args.http_port,
        token_file=args.token_file or "",
        server_args=server_args,
    )
    stop = StopSignals()
    watch = _Watch(cluster)
    try:
        cluster.start_manager()
        say(f"manager grpc {cluster.address}")
        say(f"manager http http://{cluster.http_address}")
        say(f"backends allowed: {allow}")
        if args.token_file:
            say(f"auth: bearer token from {args.token_file}")
        else:
            say("auth: off (loopback-only cluster; pass --token-file to require a token)")
        for _ in range(args.servers):
            server = cluster.add_server(member=False)
            say(f"server {server.ready['id']} grpc {server.ready['grpc']} http http://{server.ready['http']}")
        cluster.wait_members(timeout=60)
        say(f"state {state_dir}{'' if keep else ' (removed on a clean exit)'}; logs in {state_dir}/logs")
        say(f"ready: {args.servers} server(s) READY. Try: kspeed status --manager {cluster.address}. Ctrl-C to stop.")
        while not stop.wait(0.5):
            if not watch.check():
                return 1
        return 0
    finally:
        say("stopping the local cluster")
        cluster.stop()
        if watch.exited and not keep:
            freed = cluster.discard_pools()  # the logs are what is worth keeping, not the pooled memory
            say(
                f"kept {state_dir} for the logs of {', '.join(watch.exited)} (pools discarded, "
                f"{format_bytes(freed)} freed); remove it when done"
            )
        elif not keep:
            shutil.rmtree(state_dir, ignore_errors=True)
        say("stopped")


class _Watch:
    """Reports daemons of a local cluster that exit, and what the manager does about a server that did."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.exited: list[str] = []

    def check(self) -> bool:
        """Report newly exited daemons; False once the manager has exited (the cluster cannot go on)."""
        for daemon in [*self.cluster.servers, self.cluster.manager]:
            if daemon.name in self.exited or daemon.running or daemon.process is None:
                continue
            self.exited.append(daemon.name)
            what = f"{daemon.name} ({daemon.ready.get('id', '?')})" if daemon is not self.cluster.manager else "manager"
            say(
                f"{what} exited with status {daemon.process.returncode} at {time.strftime('%H:%M:%S')}; its log: "
                f"{daemon.log_file}"
            )
            if daemon is self.cluster.manager:
                say("stopping: the cluster cannot run without its manager")
                return False
            if daemon.process.returncode == 0:
                say(
                    "the cluster keeps running; the server stopped cleanly, so the manager waits restart_grace for it "
                    "to come back before moving its shares (kspeed status shows it stopped)"
                )
            else:
                say(
                    "the cluster keeps running; the manager marks the server failed once it has been silent for "
                    "fail_after and moves its shares (kspeed status shows it)"
                )
        return True


def _token_overrides(args: argparse.Namespace) -> dict[str, str]:
    if getattr(args, "token_file", None):
        return {"security.auth": "token", "security.token_file": args.token_file}
    return {"security.auth": "none"}


def cmd_status(args: argparse.Namespace) -> int:
    """Print the cluster as a table (or JSON)."""
    config = load_config(ClientConfig, args)
    with ManagerClient(config, peer_name="kspeed-cli") as client:
        if args.job:
            job = client.call("GetJobStats", kspeed_pb2.JobRequest(job=args.job, history=bool(args.plot)))
            say(json.dumps(job_dict(job), indent=2, sort_keys=True) if args.json else job_table(job))
            if args.plot:
                from kspeed.cli.plot import plot_job  # (matplotlib, optional, only for this)

                drawn = plot_job(job_dict(job), args.plot)
                print(f"kspeed: wrote {args.plot} ({drawn} rank(s))", file=sys.stderr)
            return 0
        if args.plot:
            raise ConfigError("--plot draws a job's ranks: give --job NAME too", field="plot")
        status = client.status()
        # The status lists the live servers; the ones that left stay known, with why they left.
        shown = {record.id for record in status.servers}
        status.servers.extend(r for r in client.servers(include_left=True) if r.id not in shown)
    if args.json:
        say(json.dumps(status_dict(status), indent=2, sort_keys=True))
    else:
        say(status_table(status))
    return 0


def _client(args: argparse.Namespace) -> ManagerClient:
    return ManagerClient(load_config(ClientConfig, args), peer_name="kspeed-cli")


def _held(info: kspeed_pb2.DatasetInfo) -> str:
    """ ", policy P: H of N regions held" for a dataset held in part."""
    if not info.shares or not info.shares[0].policy:
        return ""
    held, need = sum(s.memory_regions for s in info.shares), sum(s.num_regions for s in info.shares)
    return f", policy {info.shares[0].policy}: {held} of {need} regions held"


def cmd_dataset(args: argparse.Namespace) -> int:
    """Manage datasets: add (operator-owned), list, show, rm."""
    with _client(args) as client:
        if args.action == "add":
            try:
                quota = parse_bytes(args.quota) if args.quota else 0
            except ValueError as exc:
                raise KSpeedError(f"--quota {args.quota!r}: {exc}") from None
            spec = DatasetSpec(
                name=args.name, uri=args.uri, kind=args.kind, labels=args.labels, quota_bytes=quota, policy=args.policy
            )
            reply = client.create_dataset(spec.to_proto(), operator=True)
            verb = "registered" if reply.created else "already registered"
            info = reply.dataset
            size = human_bytes(info.fingerprint.total_bytes)
            say(
                f"{verb} {info.spec.name}: {info.fingerprint.count:,} samples, {size} on {len(info.shares)} server(s)"
                + (f", quota {format_bytes(quota)}" if quota else "")
                + _held(info)
            )
        elif args.action == "list":
            datasets = client.datasets()
            say(json.dumps([dataset_dict(d) for d in datasets], indent=2) if args.json else dataset_table(datasets))
        elif args.action == "show":
            say(json.dumps(dataset_dict(client.dataset(args.name)), indent=2, sort_keys=True))
        elif args.action == "rm":
            client.remove_dataset(args.name, force=args.force)
            say(f"removed {args.name}")
    return 0


def cmd_preload(args: argparse.Namespace) -> int:
    """Preload a dataset with a progress bar."""
    with _client(args) as client:
        follow_preload(client, args.name, out=sys.stdout)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """A short tour of a local cluster."""
    from kspeed.cli.demo import run

    return run(servers=args.servers)


EXAMPLES = """\
examples:
  kspeed up --servers 2                          run a local cluster (one manager, 2 servers) in the foreground
  kspeed status --manager 10.0.0.5:7070          servers, pooled memory and datasets
  kspeed status --job resnet50                   per-rank delivery statistics of a training job
  kspeed dataset add imgs /data/train --labels dirname --quota 200GiB
  kspeed preload imgs                            load it into the servers' memory (progress bar)
  kspeed dataset rm imgs --force                 remove it even while a job holds it
  kspeed server drain srv-1a2b3c4d --wait        retire a server: its shares move first, jobs only switch
  kspeed doctor server --config /etc/kspeed/kspeed.yaml   what in a server's configuration will bite
  kspeed analyze --dataset imgs --batch-size 256 --step train:step --report out/   why a job waits

Every command that talks to a manager reads the `client` and `security` sections of --config
(or KSPEED_CONFIG) and KSPEED_* variables; see deploy/config/kspeed.yaml.
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kspeed``."""
    parser = argparse.ArgumentParser(
        prog="kspeed",
        description="KSpeed: datasets preloaded and preprocessed on spare nodes, written into training processes.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=version_line("kspeed"))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = subcommand(
        sub,
        "up",
        "run a local cluster (one manager, N servers on loopback) in the foreground",
        "  kspeed up                                      2 servers, manager on 127.0.0.1:7070\n"
        "  kspeed up --servers 4 --memory 2GiB --port 0   any free ports (printed first)\n"
        "  kspeed up --token-file ~/.kspeed-token         require a bearer token\n",
        manager=False,
    )
    up.add_argument("--servers", type=int, default=2, metavar="N", help="number of servers (default 2)")
    up.add_argument(
        "--port", type=int, default=7070, metavar="PORT", help="manager gRPC port on 127.0.0.1 (default 7070; 0: any)"
    )
    up.add_argument(
        "--http-port", type=int, default=7080, metavar="PORT", help="manager HTTP port (default 7080; 0: any)"
    )
    up.add_argument(
        "--state-dir", default="", metavar="DIR", help="keep state and logs here (default: a temporary directory)"
    )
    up.add_argument("--token-file", default="", metavar="FILE", help="require the bearer token in FILE on every RPC")
    up.add_argument("--memory", default="256MiB", metavar="SIZE", help="memory each server may pool (default 256MiB)")
    up.add_argument("--region-size", default="128MiB", metavar="SIZE", help="bytes per region (default 128MiB)")
    up.add_argument(
        "--backend-allow",
        default="",
        metavar="PREFIX,...",
        help="backend prefixes the servers may read (default: the current and the temporary directory)",
    )
    up.set_defaults(func=cmd_up)

    status = subcommand(
        sub,
        "status",
        "print the cluster: servers, pooled memory, datasets (or one job's ranks)",
        "  kspeed status --manager 10.0.0.5:7070\n"
        "  kspeed status --json                  GET /v1/status, and the servers that left\n"
        "  kspeed status --job resnet50          data wait and throughput per rank, and their spread\n"
        "  kspeed status --job resnet50 --plot waits.png   each rank's wait over time, by cause\n",
    )
    status.add_argument("--job", default="", metavar="NAME", help="show this training job's ranks instead")
    status.add_argument(
        "--plot",
        default="",
        metavar="FILE",
        help="with --job: draw each rank's wait over time by cause (pip install 'kspeed[plot]')",
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(func=cmd_status)

    dataset = sub.add_parser("dataset", help="manage datasets: add, list, show, rm", description="Manage datasets.")
    actions = dataset.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = subcommand(
        actions,
        "add",
        "register an operator-owned dataset (kept until removed)",
        "  kspeed dataset add imgs /data/train --labels dirname\n"
        "  kspeed dataset add shards s3://bucket/train.manifest --kind manifest --quota 500GiB\n",
    )
    add.add_argument("name", metavar="NAME", help="the dataset's name")
    add.add_argument("uri", metavar="URI", help="backend URI: a directory, a list or manifest file, or a .npy array")
    add.add_argument(
        "--kind", default="auto", choices=("auto", "dir", "list", "manifest", "npy", "tar"), help="(default auto)"
    )
    add.add_argument(
        "--labels",
        default="",
        choices=("dirname", "cls"),
        help="dirname: a sample's class is its parent directory; cls: its .cls member (tar shards)",
    )
    add.add_argument("--quota", default="", metavar="SIZE", help="most pooled memory the dataset may take (e.g. 20GiB)")
    add.add_argument(
        "--policy",
        default="auto",
        choices=POLICIES,
        help="what the servers keep in memory: auto (default: all of it when it fits, else stream), cache, stream, "
        "or for comparison minio, reuse, lru",
    )
    add.set_defaults(func=cmd_dataset)
    listing = subcommand(actions, "list", "list the datasets")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(func=cmd_dataset)
    show = subcommand(actions, "show", "show one dataset as JSON (shares, progress, changes, leases)")
    show.add_argument("name", metavar="NAME", help="the dataset's name")
    show.set_defaults(func=cmd_dataset)
    remove = subcommand(
        actions,
        "rm",
        "remove a dataset and free its memory",
        "  kspeed dataset rm imgs            refused while a job holds a lease on it\n"
        "  kspeed dataset rm imgs --force    the jobs reading it get an error naming the removal\n",
    )
    remove.add_argument("name", metavar="NAME", help="the dataset's name")
    remove.add_argument("--force", action="store_true", help="remove it even while jobs hold leases on it")
    remove.set_defaults(func=cmd_dataset)

    preload = subcommand(
        sub,
        "preload",
        "load a dataset into the servers' memory, with a progress bar",
        "  kspeed preload imgs\n",
    )
    preload.add_argument("name", metavar="NAME", help="the dataset's name")
    preload.set_defaults(func=cmd_preload)

    servers.add_commands(sub)
    doctor.add_commands(sub)
    analyze.add_commands(sub)

    demo = subcommand(sub, "demo", "a short tour of a local cluster (make demo)", manager=False)
    demo.add_argument("--servers", type=int, default=2, metavar="N", help="number of servers (default 2)")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kspeed``."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KSpeedError as exc:
        print(f"kspeed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `kspeed dataset show x | head`
        return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
