# syntax=docker/dockerfile:1
# ModelRelay images (docs/DEPLOY.md, "Docker").
#
#   docker build -t modelrelay .                                # the relay server (last stage)
#   docker build --target worker -t modelrelay-worker .         # the worker alone, no Django
#
# Server: `manage.py serve` (migrate, bootstrap the default provider, daphne on LISTEN_ADDR).
# It drains on SIGTERM within SHUTDOWN_GRACE_SECS, so stop it with a longer timeout
# (`docker stop -t 45`, compose `stop_grace_period`) and run it with an init (`--init`,
# compose `init: true`) so signals reach it while it is still migrating.

ARG PYTHON_IMAGE=python:3.11-slim

# --- dependencies, built once per requirements file ------------------------------------------
FROM ${PYTHON_IMAGE} AS server-deps
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
COPY requirements.txt /tmp/requirements.txt
RUN /opt/venv/bin/pip install -r /tmp/requirements.txt

FROM ${PYTHON_IMAGE} AS worker-deps
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
COPY requirements-worker.txt /tmp/requirements-worker.txt
RUN /opt/venv/bin/pip install -r /tmp/requirements-worker.txt

# --- worker: `docker build --target worker` ----------------------------------------------------
# Only worker.py and the Django-free relay modules it imports (tests/test_deploy_files.py checks
# that this list covers them). Configure it with PROXY_URL, WORKER_SECRET, BACKEND_URL, MODELS...
# (deploy/worker.env.example). It has no port; SIGTERM drains within REQUEST_TIMEOUT_SECS.
FROM ${PYTHON_IMAGE} AS worker
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    WORKER_STATE_DIR=/state
RUN useradd --system --user-group --uid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin modelrelay \
    && install -d -o modelrelay -g modelrelay -m 0700 /state
COPY --from=worker-deps /opt/venv /opt/venv
WORKDIR /app
COPY requirements-worker.txt worker.py ./
COPY relay/__init__.py ./relay/
COPY relay/wire ./relay/wire
COPY relay/worker ./relay/worker
# A worker that joined with a token (JOIN_TOKEN) keeps its credential here: keep the volume.
VOLUME ["/state"]
USER modelrelay:modelrelay
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "worker.py"]

# --- server: the default target ------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS server
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    DATA_DIR=/data LISTEN_ADDR=0.0.0.0:8080
RUN useradd --system --user-group --uid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin modelrelay \
    && install -d -o modelrelay -g modelrelay -m 0700 /data
COPY --from=server-deps /opt/venv /opt/venv
WORKDIR /app
# The code stays owned by root: the server process can write only to /data.
COPY . .
# Generated secrets (secret_key, pepper, worker_secret) and the SQLite database when
# DATABASE_URL is unset. Back this volume up.
VOLUME ["/data"]
EXPOSE 8080
# slim has no curl: ask /health with Python. Any answer other than 2xx (503 while
# draining) or no answer marks the container unhealthy.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('LISTEN_ADDR', '0.0.0.0:8080').rpartition(':')[2]; urllib.request.urlopen('http://127.0.0.1:' + port + '/health', timeout=4)"]
USER modelrelay:modelrelay
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "manage.py", "serve"]
