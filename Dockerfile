# Worker image: `docker build -t deadline-cleanup .`, or let docker-compose.yml build it.
# Configured only from the environment: TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_TASK_QUEUE and
# DATABASE_URL (see core/config.py). Run as many containers as you like on the same task queue.
FROM python:3.11.13-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 10001 cleanup \
    && useradd --system --uid 10001 --gid cleanup --no-create-home --home-dir /app \
       --shell /usr/sbin/nologin cleanup

WORKDIR /app

# Runtime dependencies first, read from pyproject.toml, so a code change reuses this layer.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# Then the project itself, without any extra (the embedded binaries are for development only) and
# without the development side (devstack, the demo, the harness, the benchmarks), which runs from a checkout.
COPY README.md worker.py starter.py ./
COPY core ./core
COPY budget ./budget
COPY cleanup ./cleanup
COPY ledger ./ledger
COPY outbox ./outbox
COPY workflows ./workflows
COPY activities ./activities
COPY deadline_cleanup ./deadline_cleanup
RUN pip install --no-deps . \
    && rm -rf build ./*.egg-info

# The code stays owned by root and read-only to the worker's user.
USER cleanup

# /healthz and /readyz (core/health.py): "healthy" = ready (database answers, polling its queue).
ENV HEALTH_PORT=8081
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/readyz' % os.environ['HEALTH_PORT'], timeout=4)"]

# Metrics are served on loopback unless told otherwise: in a container, the published port needs 0.0.0.0.
ENV METRICS_HOST=0.0.0.0
ENV HEALTH_HOST=0.0.0.0

CMD ["deadline-cleanup", "worker"]
