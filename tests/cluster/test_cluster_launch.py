"""Starting Ray and Serve (`cluster/launch.py`) fails with a typed error, and gives Serve's
HTTP proxy time to come up on a busy machine; no Ray is started here."""

from __future__ import annotations

import os
from typing import Any

import pytest
import ray
from ray import serve

from kvstack.cluster.launch import SERVE_PROXY_ENV, ClusterStartError, RayInstance, start_http


def test_a_proxy_that_never_comes_up_is_a_cluster_start_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def dies(**_: Any) -> None:
        raise ray.exceptions.GetTimeoutError("proxy not ready\nlong Ray details")

    monkeypatch.setattr(serve, "start", dies)
    with pytest.raises(ClusterStartError, match="127.0.0.1:8123.*GetTimeoutError: proxy not "
                       "ready$"):
        start_http("127.0.0.1", 8123)


def test_a_private_instance_gives_the_proxy_a_minute_per_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, str | None] = {}

    def init(**_: Any) -> None:  # what Ray's processes would inherit, then no Ray at all
        seen.update({name: os.environ.get(name) for name in SERVE_PROXY_ENV})
        raise RuntimeError("no Ray in this test")

    for name in SERVE_PROXY_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ClusterStartError, match="no Ray in this test"):
        RayInstance(num_cpus=1).__enter__()
    assert seen == SERVE_PROXY_ENV
    # A value the user set is kept.
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "7")
    with pytest.raises(ClusterStartError):
        RayInstance(num_cpus=1).__enter__()
    assert seen["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "7"
