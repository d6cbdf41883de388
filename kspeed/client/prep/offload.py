"""Where a dataset's pipeline runs for this rank: how much of each batch the servers preprocess.

A pipeline's ``server`` stages run on the servers for a fraction of each batch's samples
(``offload=``, all of them by default) and on this client's workers for the rest; the split is
exact per batch (:func:`kspeed.client.planning.plans.remote_positions`). The same sample must come out the
same wherever it was preprocessed, so a split that would mix library versions (between this
client and the servers, or among the servers) is refused with the versions named.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kspeed.client.options import FeedOptions
from kspeed.client.planning.plans import PrepSplit
from kspeed.errors import ConfigError
from kspeed.preprocess.pipeline import STATUS, Output, Pipeline, Stage
from kspeed.preprocess.versions import libraries, mismatch
from kspeed.proto import kspeed_pb2

__all__ = ["attached_pipeline", "folder_pipeline", "plan_prep"]

log = logging.getLogger(__name__)

#: The split ``offload="auto"`` starts from: the servers run every sample's server stages (as
#: when no ratio is given) until the rates measured say otherwise.
AUTO_START = 1.0


def attached_pipeline(message: kspeed_pb2.Pipeline) -> Pipeline | None:
    """The pipeline of a dataset attached by name: every stage up to the last that declares its
    output runs on the servers, the rest on this client."""
    return Pipeline.from_proto(message) if message.stages else None


def plan_prep(
    dataset: str,
    pipeline: Pipeline | None,
    cached: int,
    options: FeedOptions,
    servers: Mapping[str, Mapping[str, str]],
) -> PrepSplit | None:
    """How this rank's plans split the pipeline (``None``: the servers preprocess nothing per epoch).

    Args:
        dataset: the dataset's name (for messages).
        pipeline: its pipeline with this rank's places.
        cached: leading stages the servers keep applied (every sample arrives past them).
        options: the feed's options (``offload``, ``seed``); with ``offload="auto"`` the split
            starts at :data:`AUTO_START` and may change while the job runs (``adjustable``).
        servers: per server of the dataset, the libraries it reported.

    Raises:
        ConfigError: the split would mix library versions (named); with ``"auto"`` only when the
            servers differ among themselves (a client that differs from them keeps the split at 1).
    """
    if pipeline is None or pipeline.server_stages <= cached:
        return None
    auto = options.auto_offload
    fraction = AUTO_START if auto else float(options.fixed_offload or 0.0)
    if auto and options.group is not None and options.share == "samples":
        # A group's server stages run once for all its jobs (docs/groups.md): the servers' capacity
        # is shared, not divided, and a sample prepared here would be prepared once per job.
        log.info("dataset %s: offload='auto' in group %s runs the server stages on the servers", dataset, options.group)
        auto, fraction = False, 1.0
    if fraction <= 0.0 and not auto:
        return None
    problems = []
    reports = sorted(servers.items())
    if reports:
        first_id, first = reports[0]
        for server_id, theirs in reports[1:]:
            problems += [f"servers {first_id} and {server_id}: {m}" for m in mismatch(dict(first), dict(theirs))]
    split_problems = []
    ours = libraries()
    for server_id, theirs in reports:
        split_problems += [f"this client and server {server_id}: {m}" for m in mismatch(ours, dict(theirs))]
    if auto and split_problems and not problems:
        log.warning(
            "dataset %s: offload='auto' keeps every sample's server stages on the servers: a split would give "
            "samples different bytes depending on where they run (%s)",
            dataset,
            "; ".join(split_problems[:4]),
        )
        auto = False
    elif fraction < 1.0 or auto:
        problems += split_problems
    if problems:
        raise ConfigError(
            f"dataset {dataset!r}: preprocessing split {options.offload if options.offload is not None else 'auto'} "
            f"would give samples different bytes depending on where they run ({'; '.join(problems[:4])}); install "
            "the same versions everywhere, or use offload=1.0 (servers only) or offload=0 (this client only)",
            field="offload",
            value=options.offload,
        )
    stages = pipeline.server_stages
    skip = options.on_error == "skip"
    nbytes = pipeline.output(stages).nbytes + (STATUS if skip else 0)
    return PrepSplit(stages, fraction, options.seed, nbytes, skip, adjustable=auto)


def folder_pipeline(
    loader: Any, transform: Any, *, cache: bool = False, region_decode: bool = False
) -> tuple[Pipeline | None, str]:
    """The pipeline that runs a folder dataset's loader and transforms on the servers, or why not.

    Possible when the loader is torchvision's PIL loader (an exact ``decode_image`` to RGB) and
    every transform can be sent as data (:func:`kspeed.preprocess.transforms.describe`). The
    servers run the transforms up to the last one that yields uint8 (float stages such as
    ``ToTensor``/``Normalize`` would send 4x the bytes: they stay on this client), which must give
    a fixed size so the ring can be laid out before the bytes exist. With ``cache`` the last of the
    leading transforms that are not random and give a fixed size declares its output too, so a
    dataset cached preprocessed keeps the samples as they leave it (e.g. after ``Resize`` and
    ``CenterCrop``); none such is a reason not to offload. With ``region_decode`` the decode and a
    leading ``RandomResizedCrop`` become one ``decode_random_resized_crop`` stage
    (:mod:`kspeed.preprocess.jpeg_region`: only the crop's region is decoded).

    Raises:
        ConfigError: ``region_decode`` where it cannot apply (no pipeline, a first transform that is
            not ``RandomResizedCrop``, ``cache``, an interpolation Pillow lacks, or no region decoder
            in this install), named.
    """
    from kspeed.client.prep.workers import pil_file_loader
    from kspeed.preprocess import transforms

    if loader is not pil_file_loader:
        return None, "its loader is not torchvision's PIL loader"
    if transform is None:
        return None, "it has no transforms that give a fixed size"
    try:
        described = transforms.describe(transform)
    except ConfigError as exc:
        return None, str(exc)
    produced = transforms.Produces("pil", "uint8", None)
    cut = transforms.default_cut(described, produced)
    outputs: dict[int, Output] = {}
    deterministic = True
    for k, (op, params) in enumerate(described[:cut]):
        produced = transforms.produces(op, params, produced)
        deterministic = deterministic and not transforms.is_random(op)
        if cache and deterministic and produced.size is not None:
            outputs = {k: _declared(produced)}
    if cut == 0 or produced.size is None:
        return None, "no leading uint8 transform gives a fixed size (e.g. a crop), so nothing is worth sending"
    if cache and not outputs:
        return None, "cache='preprocessed' needs a leading transform that is not random and gives a fixed size"
    outputs[cut - 1] = _declared(produced)
    stages = [Stage("decode_image", {"mode": "RGB"}, "server")]
    for k, (op, params) in enumerate(described):
        stages.append(Stage(op, params, "server" if k < cut else "client", outputs.get(k)))
    if region_decode:
        stages[:2] = [_region_decode(described[0], cache, outputs.get(0))]
    return Pipeline(stages), ""


def _region_decode(first: tuple[str, Mapping[str, Any]], cache: bool, output: Output | None) -> Stage:
    """The ``decode_random_resized_crop`` stage that stands for the decode and ``first``, a
    ``RandomResizedCrop``; ``output``: the crop's declared output, when the cut is after it.

    Raises:
        ConfigError: it cannot (named).
    """
    from kspeed.preprocess import image, jpeg_region

    op, params = first
    why = ""
    if op.partition(":")[2] != "RandomResizedCrop":
        why = f"the first transform is {op.partition(':')[2]}, not RandomResizedCrop"
    elif cache:
        why = "cache='preprocessed' keeps a sample before its random stages, and the crop is the first"
    elif params["interpolation"] not in image.INTERPOLATIONS:
        why = (
            f"its interpolation {params['interpolation']!r} is not one of Pillow's ({', '.join(image.INTERPOLATIONS)})"
        )
    if why:
        raise ConfigError(f"region_decode=True: {why}", field="region_decode", value=True)
    jpeg_region.require()
    fused = {name: params[name] for name in ("size", "scale", "ratio", "interpolation")}
    return Stage("decode_random_resized_crop", fused, "server", output)


def _declared(produced: Any) -> Output:
    """How a fixed-size uint8 stage's result travels and is stored."""
    height, width = produced.size
    if produced.kind == "pil":
        return Output(shape=(height, width, 3), dtype="uint8", kind="pil")
    return Output(shape=(3, height, width), dtype=produced.dtype, kind="tensor")
