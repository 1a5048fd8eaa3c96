"""pytest plugin for tests/test_mutation.py (``-p mutant_plugin``, this folder on PYTHONPATH).

``--mutant-plan FILE`` is JSON ``{nodeid: [mutant, ...]}``. Each planned test runs once as
written, then once under each of its mutants, in this one process (one vLLM engine serves all
the runs; its workers read the switch file too), and ``--mutant-report FILE`` gets
``{nodeid: {"none" | mutant: "passed" | "skipped" | "failed: <first line>"}}``. The test's own
outcome is that of the run without a mutant; when that fails, no mutant runs.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

import interp_mutants

_RESULTS: dict[str, dict[str, str]] = {}


def pytest_addoption(parser) -> None:
    parser.addoption("--mutant-plan", default=None, help="JSON {nodeid: [mutant, ...]}")
    parser.addoption("--mutant-report", default=None, help="where to write the outcomes (JSON)")


def pytest_collection_modifyitems(config, items) -> None:
    path = config.getoption("--mutant-plan")
    if not path:
        return
    with open(path) as f:
        plan = json.load(f)
    for item in items:
        if item.nodeid in plan:
            item.runtest = _under_each(item, item.runtest, plan[item.nodeid])


def _outcome(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"failed: {type(exc).__name__}: {text[:300]}"


def _reset() -> None:
    interp_mutants.set_active("none")
    from interp_engine import _api

    while interp_mutants.LEAKED:  # a steering block left open by steer_exit_leaks
        interp_mutants.LEAKED.pop().__exit__(None, None, None)
    _api._ACTIVE.set(())


def _under_each(item, runtest, mutants):
    def run() -> None:
        record = _RESULTS.setdefault(item.nodeid, {})
        for mutant in ["none", *mutants]:
            interp_mutants.set_active(mutant)
            start = time.perf_counter()
            try:
                runtest()
            except pytest.skip.Exception:
                record[mutant] = "skipped"
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # pytest.fail / pytest.raises failures are BaseException
                record[mutant] = _outcome(exc)
                if mutant == "none":
                    _reset()
                    raise
            else:
                record[mutant] = "passed"
            finally:
                _reset()
                print(f"[mutant] {item.nodeid} {mutant}: {record.get(mutant, '?')[:60]} "
                      f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
            if record[mutant] == "skipped" and mutant == "none":
                pytest.skip("skipped without a mutant")
    return run


def pytest_sessionfinish(session) -> None:
    path = session.config.getoption("--mutant-report")
    if path:
        with open(path, "w") as f:
            json.dump(_RESULTS, f, indent=1, sort_keys=True)
