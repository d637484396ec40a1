"""The typed client (:class:`batchline.transport.RedisClient`) names redis-py's commands as
redis-py spells them: every method and keyword of the protocols exists on the asyncio
clients batchline makes (single node, cluster) and on their pipelines, so a call that
type-checks is a call redis-py takes."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline

from batchline.transport import RedisClient, RedisPipeline, as_client, single_node


def _members(protocol: type) -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(protocol).items()
        if callable(value) and (not name.startswith("_") or name in ("__aenter__", "__aexit__"))
    }


def _mismatch(spec: Any, real: Any) -> list[str]:
    """The parameters of ``spec`` that ``real`` does not take by the same name and kind."""
    wanted = inspect.signature(spec).parameters
    have = inspect.signature(real).parameters
    kinds = {p.kind for p in have.values()}
    wrong = []
    for name, param in wanted.items():
        if name == "self" or param.kind is inspect.Parameter.POSITIONAL_ONLY:
            continue
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            if inspect.Parameter.VAR_POSITIONAL not in kinds:
                wrong.append(f"*{name}")
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            if inspect.Parameter.VAR_KEYWORD not in kinds:
                wrong.append(f"**{name}")
        elif name not in have and inspect.Parameter.VAR_KEYWORD not in kinds:
            wrong.append(name)
    return wrong


@pytest.mark.parametrize("real", [Redis, RedisCluster], ids=["Redis", "RedisCluster"])
@pytest.mark.parametrize("name", sorted(_members(RedisClient)))
def test_every_client_command_is_redis_pys(real: type, name: str) -> None:
    method = getattr(real, name, None)
    assert method is not None, f"{real.__name__} has no {name}"
    assert _mismatch(getattr(RedisClient, name), method) == []


@pytest.mark.parametrize("real", [Pipeline, ClusterPipeline], ids=["Pipeline", "ClusterPipeline"])
@pytest.mark.parametrize("name", sorted(_members(RedisPipeline)))
def test_every_pipeline_command_is_redis_pys(real: type, name: str) -> None:
    method = getattr(real, name, None)
    assert method is not None, f"{real.__name__} has no {name}"
    assert _mismatch(getattr(RedisPipeline, name), method) == []


def test_the_check_finds_a_misspelled_keyword() -> None:
    def xadd(self: Any, name: str, fieldz: dict[str, str]) -> None: ...

    assert _mismatch(xadd, Redis.xadd) == ["fieldz"]


def test_single_node_is_the_plain_client_only() -> None:
    plain = Redis()
    assert single_node(as_client(plain)) is plain
    cluster = RedisCluster.__new__(RedisCluster)  # no connection: its type is what counts
    assert single_node(as_client(cluster)) is None
