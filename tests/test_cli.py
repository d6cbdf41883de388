"""The ``kspeed`` command line: readable help, only the flags a command uses, examples that parse."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys

import pytest

from kspeed import __version__
from kspeed.cli.main import EXAMPLES, build_parser
from kspeed.config import format_bytes, format_duration, parse_bytes, parse_duration

COMMANDS = [
    ("up",), ("status",), ("dataset", "add"), ("dataset", "list"), ("dataset", "show"), ("dataset", "rm"),
    ("preload",), ("demo",),
]  # fmt: skip
TRAINING_FLAGS = ["--pacing", "on", "--nic", "mlx5_9", "--rail", "tcp", "--ring-bytes", "1GiB"]


def help_of(*command: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kspeed.cli", *command, "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_names_values_readably(command):
    text = help_of(*command)
    assert "CFG_" not in text and "usage: kspeed " + " ".join(command) in text
    # Every flag's value is named by what it is (HOST:PORT, SIZE, DURATION, FILE...), never by a dest.
    metavars = set(re.findall(r"--[a-z-]+ ([A-Z][A-Z:,._]*|\{[a-z,]+\})", text))
    assert metavars <= {"HOST:PORT", "DURATION", "SIZE", "FILE", "TOKEN", "N", "PORT", "DIR", "NAME", "PREFIX,...",
                        "{token,none}", "{auto,dir,list,manifest,npy,tar}", "{dirname,cls}",
                        "{auto,cache,stream,minio,reuse,lru}"}, metavars  # fmt: skip


@pytest.mark.parametrize("command", [("status",), ("dataset", "list"), ("preload", "imgs")], ids=" ".join)
def test_commands_refuse_flags_they_do_not_use(command, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*command, *TRAINING_FLAGS])
    assert exited.value.code == 2
    assert "unrecognized arguments: --pacing on --nic mlx5_9" in capsys.readouterr().err


def test_version_names_package_and_protocol():
    done = subprocess.run([sys.executable, "-m", "kspeed.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == f"kspeed {__version__} (protocol v1)"
    for daemon in ("kspeed.manager", "kspeed.server"):
        out = subprocess.run([sys.executable, "-m", daemon, "--version"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and __version__ in out.stdout


def _example_lines(text: str) -> list[list[str]]:
    return [
        shlex.split(line.split("  ", 2)[1].strip())[1:] for line in text.splitlines() if line.startswith("  kspeed ")
    ]


def test_every_example_in_the_help_parses():
    parser = build_parser()
    examples = _example_lines(EXAMPLES)
    for command in COMMANDS:
        text = help_of(*command)
        if "examples:" in text:
            examples += _example_lines(text.split("examples:")[-1])
    assert len(examples) >= 10
    for argv in examples:
        args = parser.parse_args(argv)
        assert isinstance(args, argparse.Namespace) and args.func is not None, argv
    assert build_parser().parse_args(["dataset", "rm", "imgs", "--force"]).force is True


@pytest.mark.parametrize("value", [0, 1, 1000, 4096, 3 << 20, 128 << 20, 64 << 30, 2 << 40, (1 << 20) + 1])
def test_sizes_are_shown_as_they_are_read(value):
    assert parse_bytes(format_bytes(value)) == value
    if value and value % 1024 == 0:
        assert format_bytes(value)[-3:] in ("KiB", "MiB", "GiB", "TiB")


@pytest.mark.parametrize("value", [0.003, 0.25, 1.0, 2.5, 60.0, 300.0, 3600.0, 7200.0, 90.0])
def test_durations_are_shown_as_they_are_read(value):
    shown = format_duration(value)
    assert parse_duration(shown) == pytest.approx(value) and shown[-1] in "smh"


def test_status_table_says_why_a_server_is_not_ready():
    from kspeed.cli.tables import status_table
    from kspeed.proto import kspeed_pb2

    S = kspeed_pb2.ServerState
    status = kspeed_pb2.ClusterStatus(cluster_id="c1", manager_version="1.0")
    status.servers.add(id="srv-a", address="10.0.0.1:7071", state=S.SERVER_STATE_READY, state_reason="healthy")
    status.servers.add(id="srv-b", address="10.0.0.2:7071", state=S.SERVER_STATE_LEFT, state_reason="shutdown")
    text = status_table(status, now=0.0)
    assert "3 server(s)" not in text and "2 server(s), 1 of them left" in text
    assert "srv-b is left: shutdown" in text and "srv-a is ready" not in text


def test_status_table_names_a_share_being_handed_off():
    from kspeed.cli.tables import status_table
    from kspeed.proto import kspeed_pb2

    S = kspeed_pb2.ServerState
    status = kspeed_pb2.ClusterStatus(cluster_id="c1", manager_version="1.0")
    status.servers.add(id="srv-a", state=S.SERVER_STATE_DRAINING, state_reason="an operator asked to drain it")
    info = status.datasets.add(spec=kspeed_pb2.DatasetSpec(name="imgs", uri="/data"))
    info.shares.add(server_id="srv-a", first_id=0, end_id=100, num_regions=2, handoff_to="srv-c")
    info.share_status.add()
    text = status_table(status, now=0.0)
    assert "srv-a is draining: an operator asked to drain it" in text
    assert "imgs: samples 0..99 are being handed off from srv-a (draining; it serves them meanwhile) to srv-c" in text


def test_the_job_table_shows_each_ranks_split_of_preprocessing():
    from kspeed.cli.tables import job_table
    from kspeed.control.status import job_dict
    from kspeed.proto import kspeed_pb2

    job = kspeed_pb2.JobStats(job="j")
    job.ranks.add(rank=0, world_size=2, host="h0", dataset="d", offload_ratio=0.4, offload_reason="balance")
    job.ranks.add(rank=1, world_size=2, host="h1", dataset="d")  # a rank without a split of its preprocessing
    table = job_table(job)
    assert "OFFLOAD" in table
    lines = {line.split()[0]: line for line in table.splitlines() if line.startswith(("0/2", "1/2"))}
    assert lines["0/2"].split()[9] == "0.40" and lines["1/2"].split()[9] == "-"
    ranks = job_dict(job)["ranks"]
    assert ranks[0]["offload_ratio"] == 0.4 and ranks[0]["offload_reason"] == "balance"
    assert ranks[1]["offload_ratio"] is None


def _attributed_job():
    from kspeed.proto import kspeed_pb2

    job = kspeed_pb2.JobStats(job="j")
    for rank, (prep, link, step) in enumerate(((9.0, 1.0, 10.0), (0.1, 0.1, 19.8), (2.0, 3.0, 15.0))):
        r = job.ranks.add(rank=rank, world_size=3, host=f"h{rank}", dataset="d", step_s=step)
        r.blocked.add(cause="prep", server="srv-a", stage="1:resize", seconds=prep)
        r.blocked.add(cause="link", server="srv-b", seconds=link)
        h = job.history.add(rank=rank, dataset="d")
        for k in range(5):
            h.samples.add(
                report_unix=100.0 + 5 * k,
                wait_total_s=k * (prep + link) / 4,
                step_s=k * step / 4,
                blocked=[
                    kspeed_pb2.BlockedSeconds(cause="prep", seconds=k * prep / 4),
                    kspeed_pb2.BlockedSeconds(cause="link", seconds=k * link / 4),
                ],
            )
    job.blocked.add(cause="prep", server="srv-a", seconds=11.1)
    return job


def test_the_job_table_names_the_slowest_ranks_and_their_top_cause():
    from kspeed.cli.tables import job_table
    from kspeed.control.status import job_dict

    job = _attributed_job()
    shown = job_dict(job)
    ranks = {r["rank"]: r for r in shown["ranks"]}
    assert ranks[0]["wait_share"] == pytest.approx(0.5) and ranks[0]["blocked_s"] == pytest.approx(10.0)
    assert ranks[0]["top_cause"] == {"cause": "prep", "server": "srv-a", "stage": "1:resize", "seconds": 9.0}
    assert ranks[2]["top_cause"]["cause"] == "link"
    assert shown["blocked"] == [{"cause": "prep", "server": "srv-a", "seconds": 11.1}]
    assert len(shown["history"]) == 3 and shown["history"][0]["samples"][-1]["blocked"]["prep"] == 9.0
    table = job_table(job)
    slowest = table[table.index("SLOWEST RANKS") :].splitlines()
    assert [line.split()[0] for line in slowest[1:]] == ["0/3", "2/3", "1/3"]  # by wait share
    assert "prep (1:resize)" in slowest[1] and "srv-a" in slowest[1] and "90%" in slowest[1]


def test_the_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from kspeed.cli.plot import plot_job, rank_series
    from kspeed.control.status import job_dict

    shown = job_dict(_attributed_job())
    times, shares, steps = rank_series(shown["history"][0]["samples"])
    assert times == [5.0, 10.0, 15.0, 20.0]
    assert shares["prep"][0] == pytest.approx(9.0 / 4 / 5) and steps[0] == pytest.approx(10.0 / 4 / 5)
    out = tmp_path / "waits.png"
    assert plot_job(shown, out, panels=2) == 2
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_names_the_extra_to_install_without_matplotlib(monkeypatch, tmp_path):
    import builtins

    from kspeed.cli.plot import plot_job
    from kspeed.control.status import job_dict
    from kspeed.errors import ConfigError

    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ConfigError, match=r"pip install 'kspeed\[plot\]'"):
        plot_job(job_dict(_attributed_job()), tmp_path / "x.png")


def test_the_status_table_shows_each_servers_preprocessing_workers_and_jobs():
    from kspeed.cli.tables import status_table
    from kspeed.control.status import server_dict
    from kspeed.proto import kspeed_pb2

    status = kspeed_pb2.ClusterStatus(cluster_id="c", manager_version="v")
    record = status.servers.add(id="s1", address="127.0.0.1:1", state=kspeed_pb2.ServerState.SERVER_STATE_READY)
    record.inventory.preprocess_workers = 4
    record.inventory.preprocess_active = 3
    record.inventory.preprocess_share.update({"train-a": 0.75, "train-b": 0.25})
    record.inventory.preprocess_weights.update({"train-a": 3.0, "train-b": 1.0})
    text = status_table(status, now=0.0)
    assert "3/4 active" in text
    assert "s1 preprocesses for train-a 75% (weight 3), train-b 25% (weight 1)" in text
    shown = server_dict(record)["preprocess"]
    assert shown == {
        "workers": 4,
        "active": 3,
        "share": {"train-a": 0.75, "train-b": 0.25},
        "weights": shown["weights"],
    }
    assert shown["weights"] == {"train-a": 3.0, "train-b": 1.0}
