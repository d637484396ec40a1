"""The FastAPI backend under the producer ACL user (batchline.acl), a worker under the worker
user: embedding, polled jobs (pending before any worker runs, by the note the admission
turns into its job key), the health check. Redis >= 7 (else skipped)."""

from __future__ import annotations

from collections.abc import Callable

import redis
from pydantic import SecretStr

from batchline.acl import ROLES
from batchline.config import ProducerSettings
from batchline.contrib.fastapi import create_app
from batchline.keys import QueueKeys

from .test_fastapi import MODEL, Serve, poll_job, serve, submit_job
from tests.support.scale_security import _acl_users
from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, stop_all
from tests.support.web_models import vector

__all__ = ["serve"]  # the fixture, used here


def test_the_web_backend_as_the_producer_user(
    redis_url: str,
    keys: QueueKeys,
    serve: Serve,  # noqa: F811 (the fixture imported above)
    start_worker: Callable[..., WorkerThread],
) -> None:
    admin = redis.Redis.from_url(redis_url)
    tag = keys.queue[-8:]
    users = _acl_users(admin, redis_url, keys, tag)
    started: list[WorkerThread] = []
    try:
        app = create_app(
            ProducerSettings(redis_url=SecretStr(users["producer"][0]), queue=keys.queue),
            timeout_s=RESULT_TIMEOUT_S,
        )
        client = serve(app)
        # No worker yet (a queue scaled to zero): the job is pending by its note on the job
        # list, which the producer user may look for but not take; a worker's admission
        # makes its key, which expires with the results.
        early = submit_job(client, {"text": "before any worker"})
        response = client.get(early)
        assert (response.status_code, response.json()["status"]) == (202, "pending")
        assert admin.keys(keys.job("*")) == []
        started.append(start_worker(MODEL, redis_url=users["worker"][0]))
        response = poll_job(client, early)
        assert response.status_code == 200, response.text
        assert 0 < admin.ttl(keys.job(early.rsplit("/", 1)[1])) <= 3600
        response = client.post("/embed", json={"text": "hello"})
        assert response.status_code == 200, response.text
        assert response.json()["embedding"] == vector("hello")
        response = poll_job(client, submit_job(client, {"text": "a job"}))
        assert response.status_code == 200, response.text
        assert response.json()["embedding"] == vector("a job")
        assert client.get("/healthz").status_code == 200
        assert client.get("/jobs/never-submitted").status_code == 404
    finally:
        stop_all(started)  # before its user goes
        for role in ROLES:
            admin.execute_command("ACL", "DELUSER", f"blq-{role}-{tag}")
        admin.close()
