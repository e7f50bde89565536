"""pytest plugin loaded (``-p upstream_plugin``) into each upstream-module subprocess by
``run_upstream.py``. It adapts the harness only, never the package under test:

* refuses to run if ``import deepspeed`` does not resolve to the package named by
  ``DS_UPSTREAM_EXPECT`` (upstream's conftest puts its repository root on ``sys.path``; the
  driver copies only ``tests/`` so that cannot shadow ours, and this check makes sure);
* drops the node ids listed in ``DS_UPSTREAM_DESELECT`` (what an earlier attempt already ran);
* appends one JSON line per event to ``DS_UPSTREAM_EVENTS``: ``start`` when a test begins,
  ``done`` with its outcome when it ends, ``collect_error`` for a file that does not collect.
  The driver reads the file after the subprocess ends (or is killed), so a test that started
  and never finished is known to have hung, and a resumed run deselects what already ran.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

_EVENTS = os.environ.get("DS_UPSTREAM_EVENTS")
_OUTCOMES: dict = {}


def _emit(record: dict) -> None:
    if not _EVENTS:
        return
    with open(_EVENTS, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _short(report) -> str:
    """The last meaningful line of a failure (the exception line), at most 400 characters."""
    longrepr = getattr(report, "longrepr", None)
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # skip: (file, line, reason)
        return str(longrepr[2])[:400]
    crash = getattr(getattr(longrepr, "reprcrash", None), "message", None)
    if crash and crash.strip():
        return " | ".join(line.strip() for line in crash.strip().splitlines()[:4])[:400]
    text = str(longrepr).strip().splitlines()
    for line in reversed(text):
        if line.startswith("E ") or "Error" in line:
            return line[:400]
    return (text[-1] if text else "")[:400]


def pytest_configure(config):
    expect = os.environ.get("DS_UPSTREAM_EXPECT")
    if expect:
        import deepspeed
        got = os.path.realpath(os.path.dirname(deepspeed.__file__))
        if got != os.path.realpath(expect):
            pytest.exit(f"upstream driver: 'deepspeed' resolves to {got}, expected {expect}", returncode=4)


def pytest_collection_modifyitems(session, config, items):
    """Drop the tests a previous attempt at this module already ran (or hung in)."""
    path = os.environ.get("DS_UPSTREAM_DESELECT")
    if not path or not os.path.exists(path):
        return
    with open(path) as f:
        done = {line.strip() for line in f if line.strip()}
    keep = [it for it in items if it.nodeid not in done]
    dropped = [it for it in items if it.nodeid in done]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def _register_distributed_fixtures(module) -> None:
    """Upstream's ``DistributedFixture`` subclasses (``unit/common.py``) become fixtures through a
    ``_pytestfixturefunction`` class attribute, which pytest 8.4+ no longer reads (DeepSpeed pins
    pytest < 8.4), so a test naming one errors with "fixture not found". Register each such class
    of the module as a function-scoped fixture whose body is what upstream's conftest does for it
    (``cls()(request)``: run ``cls.run`` on its own world size)."""
    import _pytest.fixtures as fx
    if not hasattr(fx, "FixtureFunctionDefinition"):   # pytest < 8.4: upstream's mechanism works
        return
    namespace = vars(module.obj)   # imports the test module (and with it unit.common)
    common = sys.modules.get("unit.common")
    base = getattr(common, "DistributedFixture", None)
    if base is None:
        return
    manager = module.session._fixturemanager
    for name, obj in list(namespace.items()):
        if isinstance(obj, type) and issubclass(obj, base) and obj is not base:
            def run_distributed_fixture(request, _cls=obj):
                _cls()(request)
            manager._register_fixture(name=name, func=run_distributed_fixture, node=module, scope="function")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    if isinstance(collector, pytest.Module):
        try:
            _register_distributed_fixtures(collector)
        except Exception as err:   # an import error is reported by the collection itself
            print(f"upstream_plugin: distributed fixtures not registered: {err!r}", file=sys.stderr)
    return (yield)


def pytest_collectreport(report):
    if report.failed:
        _emit({"event": "collect_error", "nodeid": report.nodeid, "message": _short(report)})


def pytest_runtest_logstart(nodeid, location):
    _OUTCOMES[nodeid] = ("passed", "")
    _emit({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report):
    outcome, message = _OUTCOMES.get(report.nodeid, ("passed", ""))
    if report.failed:
        # A failure in setup/teardown is an error; in the call, a failure.
        new = "failed" if report.when == "call" else "error"
        if outcome == "passed" or outcome == "skipped":
            outcome, message = new, _short(report)
    elif report.skipped and outcome == "passed":
        outcome, message = "skipped", _short(report)
    _OUTCOMES[report.nodeid] = (outcome, message)


def pytest_runtest_logfinish(nodeid, location):
    outcome, message = _OUTCOMES.pop(nodeid, ("passed", ""))
    _emit({"event": "done", "nodeid": nodeid, "outcome": outcome, "message": message})
