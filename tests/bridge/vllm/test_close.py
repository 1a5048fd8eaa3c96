"""Closing a multiprocess engine when vLLM's own shutdown stops half-way."""

import multiprocessing
import time

import psutil
import pytest

from bridge.vllm.client import _shutdown


def _sleep() -> None:
    time.sleep(600)


class _Resources:
    def __init__(self, processes) -> None:
        self.engine_manager = type("Manager", (), {"processes": processes})()
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


class _Client:
    """vLLM's multiprocess client whose shutdown raised as kill_process_tree does when a child
    exits between listing the tree and asking the child's name."""

    def __init__(self, processes, fail: bool) -> None:
        self.resources = _Resources(processes)
        self.fail = fail

    def shutdown(self) -> None:
        if self.fail:
            raise psutil.NoSuchProcess(12345, "VLLM::Worker")
        for proc in self.resources.engine_manager.processes:
            proc.kill()
            proc.join()
        self.resources()


@pytest.mark.parametrize("fail", [True, False])
def test_an_engine_process_left_by_a_failed_shutdown_is_killed_and_resources_released(fail):
    proc = multiprocessing.get_context("spawn").Process(target=_sleep, daemon=True)
    proc.start()
    try:
        client = _Client([proc], fail)
        _shutdown(client)  # never raises: a child that exited on its own is not an error
        assert not proc.is_alive()
        assert client.resources.calls == 1
    finally:
        if proc.is_alive():
            proc.kill()


def test_other_shutdown_errors_still_raise():
    class Broken(_Client):
        def shutdown(self) -> None:
            raise RuntimeError("engine manager failed")

    with pytest.raises(RuntimeError, match="engine manager failed"):
        _shutdown(Broken([], False))
