"""Fixtures of the training tests."""

from __future__ import annotations

import subprocess

import pytest

from tests.training.launch import launch_worker


@pytest.fixture(scope="module")
def torchrun_worker_once(tiny_model_dir, tmp_path_factory):
    """run(worker, world, *extra, timeout=600) -> dict: launch_worker on the tiny model, each (worker, world, *extra)
    at most once per test module. The first test that asks launches it, the others get the same dict (a
    failed launch fails them all with the same error, without launching again). For workers that run
    several phases in one launch."""
    out_dir = tmp_path_factory.mktemp("torchrun_once")
    done: dict[tuple, dict | BaseException] = {}

    def run(worker: str, world: int, *extra: str, timeout: int = 600) -> dict:
        key = (worker, world, *extra)
        if key not in done:
            try:
                done[key] = launch_worker(tiny_model_dir, out_dir, worker, world, *extra, timeout=timeout)
            except (AssertionError, subprocess.TimeoutExpired, OSError, ValueError) as e:
                done[key] = e
        if isinstance(done[key], BaseException):
            raise done[key]
        return done[key]

    return run
