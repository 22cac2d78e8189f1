"""The project's log lines: every one starts with an ISO 8601 UTC time with milliseconds."""
import io
import logging
import re

from freetoken import log

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def test_every_line_starts_with_the_time_in_milliseconds(monkeypatch):
    sink = io.StringIO()
    monkeypatch.setattr(log.sys, "stderr", sink)
    log.setup("INFO")                      # tests/conftest.py puts the logger back afterwards
    log.logger.info("first")
    log.logger.warning("second")
    lines = sink.getvalue().splitlines()
    assert re.fullmatch(STAMP + r" \[freetoken\] INFO first", lines[0]), lines
    assert re.fullmatch(STAMP + r" \[freetoken\] WARNING second", lines[1]), lines


def test_stamp_is_utc_with_milliseconds():
    assert log.stamp(86400 * 365 + 0.0456) == "1971-01-01T00:00:00.045Z"
    assert re.fullmatch(STAMP, log.stamp())
    assert logging.getLogger("freetoken") is log.logger
