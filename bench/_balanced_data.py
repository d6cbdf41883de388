"""The workloads of ``bench/balanced.py`` and their photographs, made once and kept on disk.

Each workload's JPEGs live in ``<cache>/<name>/class*/`` with a record ``<cache>/<name>.json`` beside
the folder (outside it, so the tree holds only the class folders ``ImageFolder`` and the servers
list); a folder whose record matches what would be written is reused as it is.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from preprocess import write_photos

__all__ = ["CACHE", "WORKLOADS", "Workload", "ensure_data", "quick"]

CACHE = Path("/var/tmp/kspeed-balanced")
IMAGENET_SHORT_SIDE = (400, 500)  # ImageNet's photographs are mostly 500 px on the long side, ~375-500 short
IMAGENET_ASPECT = (1.0, 1.5)  # long side over short side
IMAGENET_CLASSES = 16
JPEG_QUALITY = 90


@dataclass(frozen=True)
class Workload:
    """One workload: its photographs, how they are read, and how long it is timed.

    Attributes:
        name: the workload's name (``--workload``).
        kind: ``"crops"`` (``bench/preprocess.py``'s 300-500 px crops of scikit-learn's two
            photographs, two class folders) or ``"imagenet"`` (photographs at ImageNet-like sizes).
        images: photographs in the set.
        seed: seed of the crops.
        batch_size: samples per batch.
        warmup_epochs: untimed epochs first.
        timed_epochs: epochs timed after them (one more, untimed, follows).
        seeded_sampler: ``RandomSampler(folder, generator=torch.Generator().manual_seed(0))``;
            otherwise ``RandomSampler(folder)``, drawing from torch's global generator.
    """

    name: str
    kind: str
    images: int
    seed: int
    batch_size: int
    warmup_epochs: int
    timed_epochs: int
    seeded_sampler: bool


WORKLOADS = {
    w.name: w
    for w in (
        Workload("project", "crops", 480, 0, 32, 1, 4, seeded_sampler=True),
        Workload("crops600", "crops", 600, 1, 32, 1, 2, seeded_sampler=False),
        Workload("imagenet2048", "imagenet", 2048, 2, 64, 1, 2, seeded_sampler=True),
    )
}


def quick(workload: Workload) -> Workload:
    """A small version of ``workload`` that checks the benchmark runs (its figures mean little)."""
    images = max(4 * workload.batch_size, 96)
    return replace(workload, images=images, warmup_epochs=1, timed_epochs=1)


def photographs() -> tuple[list[np.ndarray], list[str]]:
    """RGB photographs to crop from: scikit-learn's two, and scikit-image's where it is installed."""
    from sklearn.datasets import load_sample_images

    images = list(load_sample_images().images)
    names = ["sklearn:china", "sklearn:flower"]
    try:
        from skimage import data
    except ImportError:
        print("scikit-image not installed: ImageNet-like photographs from scikit-learn's two only", file=sys.stderr)
        return images, names
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        images.append(getattr(data, name)())
        names.append(f"skimage:{name}")
    left, right, _ = data.stereo_motorcycle()
    images += [left, right]
    names += ["skimage:motorcycle_left", "skimage:motorcycle_right"]
    return images, names


def write_imagenet_like(root: Path, count: int, seed: int) -> tuple[int, list[str]]:
    """``count`` JPEGs (quality 90) whose short side is 400-500 px and long side up to 1.5 times it:
    random crops (a third of the photograph or more, flipped half the time) of the photographs,
    rescaled to that size, in 16 class folders; their total bytes and the sources used."""
    from PIL import Image

    photos, names = photographs()
    rng = np.random.default_rng(seed)
    total = 0
    for i in range(count):
        photo = photos[int(rng.integers(len(photos)))]
        h, w = photo.shape[:2]
        aspect = float(rng.uniform(*IMAGENET_ASPECT))
        landscape = bool(rng.integers(2))
        area = float(rng.uniform(1 / 3, 1.0)) * h * w
        ch = min(h, round((area / (aspect if landscape else 1 / aspect)) ** 0.5))
        cw = min(w, round(ch * (aspect if landscape else 1 / aspect)))
        y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        crop = Image.fromarray(photo[y : y + ch, x : x + cw])
        if rng.integers(2):
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        short = int(rng.integers(IMAGENET_SHORT_SIDE[0], IMAGENET_SHORT_SIDE[1] + 1))
        scale = short / min(crop.size)
        crop = crop.resize((max(short, round(crop.size[0] * scale)), max(short, round(crop.size[1] * scale))))
        folder = root / f"class{i % IMAGENET_CLASSES:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        crop.save(buffer, format="JPEG", quality=JPEG_QUALITY)
        (folder / f"{i:05d}.jpg").write_bytes(buffer.getvalue())
        total += buffer.tell()
    return total, names


def ensure_data(workload: Workload, cache: Path = CACHE) -> tuple[Path, dict]:
    """The folder of ``workload``'s photographs and its record, written unless a complete one is there."""
    root = cache / f"{workload.name}-{workload.images}"
    record_path = cache / f"{root.name}.json"
    wanted = {"kind": workload.kind, "images": workload.images, "seed": workload.seed, "quality": JPEG_QUALITY}
    if record_path.exists() and root.is_dir():
        record = json.loads(record_path.read_text())
        if {k: record.get(k) for k in wanted} == wanted and len(list(root.glob("*/*.jpg"))) == workload.images:
            return root, record
    shutil.rmtree(root, ignore_errors=True)
    record_path.unlink(missing_ok=True)
    root.mkdir(parents=True)
    if workload.kind == "crops":
        total, sources = write_photos(root, workload.images, seed=workload.seed), ["sklearn:china", "sklearn:flower"]
    else:
        total, sources = write_imagenet_like(root, workload.images, workload.seed)
    record = {**wanted, "bytes": total, "sources": sources, "workload": asdict(workload)}
    record_path.write_text(json.dumps(record, indent=2) + "\n")  # last: a folder without it is incomplete
    return root, record
