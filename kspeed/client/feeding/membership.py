"""This job in a group that shares preparation (``docs/groups.md``): what a feed tells its servers.

A group's servers count each sample's uses per **member**, one per job whatever its ranks, so
every rank of a job must give the same member name and two jobs never the same one: the job's
name when one is set (``KSPEED_JOB``), else its launcher's rendezvous (``MASTER_ADDR`` and
``MASTER_PORT``, which torchrun and Slurm scripts set and which differ between jobs running at
once), else this process (a job of one process).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from kspeed import names
from kspeed.client.options import FeedOptions
from kspeed.client.stats import default_job
from kspeed.errors import ConfigError
from kspeed.proto import kspeed_pb2

__all__ = ["group_fields", "member_name"]


def member_name(job: str = "", environ: Mapping[str, str] | None = None, pid: int | None = None) -> str:
    """This job's name within a group (see the module's doc): ``job`` when given, else the
    launcher's rendezvous, else ``user@host:pid``; made a valid group name."""
    env = os.environ if environ is None else environ
    if job:
        name = job
    elif int(env.get("WORLD_SIZE", "1") or 1) > 1 and env.get("MASTER_PORT"):
        name = f"{env.get('MASTER_ADDR', 'localhost')}:{env['MASTER_PORT']}"
    else:
        name = f"{default_job()}:{os.getpid() if pid is None else pid}"
    name = re.sub(r"[^A-Za-z0-9._:@-]", "-", name).lstrip("._:@-")[:128]
    return names.GROUP.check(name or "job", ConfigError, what="group member")


def group_fields(info: kspeed_pb2.DatasetInfo, options: FeedOptions, job: str) -> dict[str, object]:
    """The :class:`~kspeed.proto.kspeed_pb2.OpenFeedRequest` fields naming this job's group (none
    without one).

    Raises:
        ConfigError: ``share="decoded"`` on a dataset not cached preprocessed (it has no decoded
            form to share).
    """
    if options.group is None:
        return {}
    if options.share == "decoded" and info.spec.cache != "preprocessed":
        raise ConfigError(
            f"dataset {info.spec.name!r}: share='decoded' shares the pipeline's deterministic leading stages "
            "as the servers store them, which needs the dataset registered with cache='preprocessed'; "
            "use share='samples' (every job of the group with one seed) or register it cached",
            field="share",
            value=options.share,
        )
    return {
        "group": options.group,
        "member": member_name(job),
        "share": options.share,
        "group_lag": options.group_lag or 0,
    }
