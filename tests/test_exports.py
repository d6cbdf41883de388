"""The public surface is exactly what kspeed.__all__ says."""

import kspeed


def test_all_is_pinned():
    assert sorted(kspeed.__all__) == sorted(["PROTOCOL_VERSIONS", "KSpeedError", "__version__"])
    for name in kspeed.__all__:
        assert hasattr(kspeed, name)
