"""``redis+sentinel://`` URLs: what they say, what is refused (naming what is wrong), and no
password in a message or a repr."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from batchline.config import ProducerSettings, WorkerSettings, redact_url
from batchline.redis_url import is_sentinel_url, parse_sentinel_url


def test_a_url_names_the_sentinels_the_service_and_the_database() -> None:
    spec = parse_sentinel_url("redis+sentinel://h1:26380,h2/mymaster/2")
    assert spec.sentinels == [("h1", 26380), ("h2", 26379)]
    assert spec.service == "mymaster"
    assert spec.redis_kwargs["db"] == 2
    assert "db" not in spec.sentinel_kwargs
    assert spec.where() == "service 'mymaster' at sentinels h1:26380,h2:26379"


def test_credentials_and_tls_go_where_they_belong() -> None:
    spec = parse_sentinel_url(
        "rediss+sentinel://user:pw@h1,h2/svc?sentinel_password=sp&ssl_ca_certs=/ca.pem"
        "&socket_timeout=5"
    )
    assert (spec.redis_kwargs["username"], spec.redis_kwargs["password"]) == ("user", "pw")
    assert spec.sentinel_kwargs["password"] == "sp"
    assert "username" not in spec.sentinel_kwargs
    for kwargs in (spec.redis_kwargs, spec.sentinel_kwargs):
        assert kwargs["ssl"] is True
        assert kwargs["ssl_ca_certs"] == "/ca.pem"
        assert kwargs["socket_timeout"] == 5.0
    assert "pw" not in repr(spec)
    assert "sp" not in repr(spec)


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redis+sentinel://h1/", "path is /<service>"),
        ("redis+sentinel:///svc", "at least one sentinel"),
        ("redis+sentinel://h1:port/svc", r"host\[:port\]"),
        ("redis+sentinel://h1/svc/zero", "database is a number"),
        ("redis+sentinel://h1/svc/0/extra", "path is /<service>"),
    ],
)
def test_a_malformed_url_is_refused_naming_what_is_wrong(url: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_sentinel_url(url)
    with pytest.raises(ValidationError, match=words):
        WorkerSettings(redis_url=url)


def test_settings_refuse_sentinels_on_a_cluster_and_show_no_password() -> None:
    url = "redis+sentinel://:hunter2@h1/svc?sentinel_password=s3cret"
    assert is_sentinel_url(url)
    with pytest.raises(ValidationError, match="fails over by itself") as caught:
        ProducerSettings(redis_url=url, redis_cluster=True)
    assert "hunter2" not in str(caught.value)
    with pytest.raises(ValidationError) as caught:
        ProducerSettings(redis_url="redis+sentinel://:hunter2@h1/")
    assert "hunter2" not in str(caught.value)
    shown = ProducerSettings(redis_url=url).describe()["redis_url"]
    assert "hunter2" not in shown
    assert "s3cret" not in shown
    assert redact_url(url) == "redis+sentinel://:***@h1/svc?sentinel_password=***"
