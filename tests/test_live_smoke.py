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
    # WORKER_SECRET comes from the environment: the banner names it, never shows it whole.
    assert "is set by WORKER_SECRET in the server's environment" in relay_server.log()
    assert relay_server.secret not in relay_server.log()
