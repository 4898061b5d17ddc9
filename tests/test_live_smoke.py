import httpx
import pytest

pytestmark = pytest.mark.live


def test_serve_answers_health_and_prints_the_worker_command(relay_server):
    response = httpx.get(relay_server.url + "/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["workers_connected"] == 0
    assert "python worker.py --proxy-url" in relay_server.log()
    assert f"--worker-secret {relay_server.secret}" in relay_server.log()
