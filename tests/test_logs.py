"""Log settings: text by default, JSON lines on request, applied once per process."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import pytest

from kspeed.config import ManagerConfig, load_config
from kspeed.control.logs import JsonFormatter
from kspeed.errors import ConfigError


def test_json_formatter_writes_the_fields_and_the_traceback():
    try:
        raise RuntimeError("disk gone")
    except RuntimeError:
        record = logging.getLogger("kspeed.x").makeRecord(
            "kspeed.x", logging.ERROR, __file__, 1, "read %s failed", ("a.jpg",), sys.exc_info()
        )
    entry = json.loads(JsonFormatter("server").format(record))
    assert entry["level"] == "error" and entry["logger"] == "kspeed.x" and entry["process"] == "server"
    assert entry["message"] == "read a.jpg failed" and entry["time"].endswith("+00:00")
    assert "RuntimeError: disk gone" in entry["exception"]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_process_logs_in_the_configured_format(fmt):
    code = (
        "import logging; from kspeed.control.logs import LogSettings;"
        f"LogSettings('info', {fmt!r}).apply('feeder', helper=True);"
        "logging.getLogger('kspeed.t').info('hello %d', 7); logging.getLogger('kspeed.t').debug('hidden')"
    )
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stderr
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    if fmt == "json":
        assert json.loads(lines[0])["message"] == "hello 7"
    else:
        assert re.search(r" INFO kspeed\.t\[feeder \d+\]: hello 7$", lines[0]), lines[0]


def test_an_unknown_log_format_is_refused_by_name():
    with pytest.raises(ConfigError, match="log_format"):
        load_config(ManagerConfig, environ={"KSPEED_LOG_FORMAT": "xml"})
