"""The public surface is exactly what kspeed.__all__ says, and importing it needs no torch."""

import subprocess
import sys

import kspeed


def test_all_is_pinned():
    assert sorted(kspeed.__all__) == sorted(
        ["PROTOCOL_VERSIONS", "Batch", "DatasetSpec", "KSpeedClient", "KSpeedDataset", "KSpeedError", "__version__"]
    )
    for name in kspeed.__all__:
        assert hasattr(kspeed, name)


def test_import_kspeed_does_not_import_torch():
    code = (
        "import sys, kspeed; spec = kspeed.DatasetSpec('imgs', '/data/imgs'); "
        "assert 'torch' not in sys.modules, 'torch imported'; print(spec.name)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "imgs"


def test_unknown_name_is_an_attribute_error():
    try:
        kspeed.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("kspeed.NoSuchThing resolved")
