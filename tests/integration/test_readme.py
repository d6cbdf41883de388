"""The README's Python snippets run as written, against a local cluster, on real JPEG files."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def photos(root: Path, per_class: int = 12) -> int:
    """``data/imgs/<class>/<n>.jpg``: small JPEGs that torchvision's ImageFolder decodes."""
    rng = np.random.default_rng(0)
    for label in ("ant", "bee", "cat"):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(40 + i, 48, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / label / f"{i:03d}.jpg", quality=85)
    return 3 * per_class


def test_the_readme_has_python_snippets():
    assert len(SNIPPETS) >= 2  # the training loop and wrapping a folder dataset


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs_as_written(cluster_factory, tmp_path, index):
    count = photos(tmp_path / "data" / "imgs")
    cluster = cluster_factory(1, server_args=["--backend-allow", str(tmp_path)])
    env = {**os.environ, "KSPEED_MANAGER": cluster.address, "PYTHONPATH": str(ROOT)}
    for name in ("KSPEED_TOKEN", "KSPEED_TOKEN_FILE", "KSPEED_CONFIG", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", SNIPPETS[index]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"README snippet {index + 1} failed:\n{SNIPPETS[index]}\n{done.stderr[-3000:]}"
    if "print(ds.preload())" in SNIPPETS[index]:
        lines = done.stdout.splitlines()
        assert re.fullmatch(rf"imgs: ready, {count} samples \([\d.]+ KiB\) on 1 server\(s\)", lines[0]), lines[0]
        assert lines[1] == f"0 1 {-(-count // 64)} {count}"  # one process: rank 0 of 1, the whole epoch
