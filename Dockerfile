# syntax=docker/dockerfile:1
#
# nopoll: one image for the API and the worker, which differ only in the command.
#
#   docker build -t nopoll:0.1.0 .
#   docker run --rm --read-only --tmpfs /tmp -v nopoll-data:/data -p 8000:8000 \
#     -v "$PWD/nopoll.yaml:/etc/nopoll/nopoll.yaml:ro" -e REDIS_URL=redis://redis:6379/0 \
#     nopoll:0.1.0 api --config /etc/nopoll/nopoll.yaml --host 0.0.0.0 --port 8000
#
# The builder stage installs nopoll (with the postgres and otel extras, without dev or test
# tools) into a virtualenv, every dependency at the version constraints.txt pins; the
# runtime stage copies only that virtualenv into a clean slim image. ./scripts/image builds
# it without a registry (PYTHON_IMAGE: a base made from Debian packages).
# It runs as UID/GID 10001 and writes only to /data (data_dir, the working directory) and
# /tmp (HOME), so it runs with a read-only root filesystem.

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY nopoll ./nopoll
COPY receiver ./receiver
COPY sinks ./sinks
# constraints.txt pins every dependency (./scripts/lock): a later build installs the same.
RUN /opt/venv/bin/pip install -c constraints.txt ".[postgres,otel]"

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="nopoll" \
      org.opencontainers.image.description="Webhook receiver and result sink for asynchronous LLM inference" \
      org.opencontainers.image.licenses="MIT"
RUN groupadd --system --gid 10001 nopoll \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin nopoll \
    && install -d -o 10001 -g 10001 -m 0750 /data
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    TMPDIR=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Without a config file nopoll's data_dir is ./nopoll-data, so under the /data volume; a
# config file's relative paths are its own folder's: give it data_dir: /data.
WORKDIR /data
USER 10001:10001
EXPOSE 8000
# No HEALTHCHECK: the API and the worker answer on different ports. Kubernetes probes the
# API's GET /healthz and /readyz and each worker's own /healthz (--health-port; helm/nopoll).
ENTRYPOINT ["nopoll"]
CMD ["api", "--host", "0.0.0.0", "--port", "8000"]
