"""pytest plugin: every test's outcome and first error line, and how many tests were
deselected, written as JSON to the path in ``PEER_SUITE_RECORD`` when the session ends
(read by ``run.py``)."""
from __future__ import annotations

import json
import os

_RESULTS: dict[str, dict] = {}
_DESELECTED: list[str] = []


def _first_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message.strip().splitlines()[0] if crash.message.strip() else ""
    if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        return str(report.longrepr[2])
    return str(report.longrepr).strip().splitlines()[-1] if report.longrepr else ""


def pytest_runtest_logreport(report):
    """A test's outcome is its worst phase (subtests report under the test's own id): failed
    (in its call) or error (in set-up / tear-down), else passed if its call passed, else skipped."""
    entry = _RESULTS.setdefault(report.nodeid, {"outcome": None, "message": ""})
    if report.failed:
        if entry["outcome"] not in ("failed", "error"):  # the first failure says why
            entry.update(outcome="failed" if report.when == "call" else "error", message=_first_line(report))
    elif report.skipped:
        if entry["outcome"] is None:
            entry.update(outcome="skipped", message=_first_line(report))
    elif report.when == "call" and entry["outcome"] in (None, "skipped"):
        entry.update(outcome="passed", message="")


def pytest_deselected(items):
    _DESELECTED.extend(item.nodeid for item in items)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("PEER_SUITE_RECORD")
    if path:
        with open(path, "w") as f:
            tests = {k: {**v, "outcome": v["outcome"] or "passed"} for k, v in _RESULTS.items()}
            json.dump({"tests": tests, "deselected": len(_DESELECTED)}, f, indent=1, sort_keys=True)
