# syntax=docker/dockerfile:1
# Limelight sidecar image: multi-stage, non-root, read-only-root-FS friendly, offline build.
#
# The build never reaches a package index: every third-party wheel comes from a wheelhouse that
# scripts/build_wheelhouse.sh fills on the host (build/wheelhouse/, inside the build context).
#
#   scripts/build_wheelhouse.sh                      # CPU wheelhouse (torch 2.13.0 CPU build)
#   docker build -t limelight:0.1.0 .                # or: buildah bud -t limelight:0.1.0 .
#
# GPU variant (CUDA torch + onnxruntime-gpu): `VARIANT=gpu scripts/build_wheelhouse.sh`, then
# `docker build --build-arg VARIANT=gpu --build-arg BASE_IMAGE=<a CUDA 12 runtime image with
# Python 3.11> -t limelight:0.1.0-gpu .` -- needs the CUDA wheels from PyPI, so it cannot be
# built on an air-gapped machine that only has the CPU torch wheel. See docs/deploy.md.

ARG BASE_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------------------
# base: Python 3.11 with venv support and the runtime user. Both later stages start here so the
# virtual environment built in `builder` finds the same interpreter path in `runtime`.
FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A bare Debian root FS (the offline test's base) has no Python; python:3.11-slim has it.
RUN set -eux; \
    if ! command -v python3 >/dev/null 2>&1 || ! python3 -c 'import ensurepip, venv' 2>/dev/null; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version'
RUN set -eux; \
    (getent group limelight || groupadd --system --gid 10001 limelight); \
    (getent passwd limelight || useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /var/lib/limelight --shell /usr/sbin/nologin limelight)

# ---------------------------------------------------------------------------------------------
# deps: a virtual environment with every third-party dependency, from the wheelhouse only. Its
# layers are reused (also by `runtime`) until the wheelhouse changes.
FROM base AS deps
ARG VARIANT=cpu
COPY build/wheelhouse/ /wheelhouse/
# GPU: onnxruntime and onnxruntime-gpu both ship the `onnxruntime` module; keep only the GPU one.
RUN set -eux; \
    case "${VARIANT}" in cpu|gpu) ;; *) echo "VARIANT must be cpu or gpu" >&2; exit 2 ;; esac; \
    python3 -m venv /opt/limelight; \
    /opt/limelight/bin/pip install --no-index --find-links /wheelhouse \
        -r /wheelhouse/requirements.lock; \
    if [ "${VARIANT}" = gpu ]; then \
        /opt/limelight/bin/pip uninstall -y onnxruntime onnxruntime-gpu; \
        /opt/limelight/bin/pip install --no-index --find-links /wheelhouse --no-deps \
            --constraint /wheelhouse/requirements.lock onnxruntime-gpu; \
    fi; \
    find /opt/limelight -name '__pycache__' -type d -prune -exec rm -rf {} +

# ---------------------------------------------------------------------------------------------
# builder: wheels of the project and its SDK, checked to install with dependencies resolved
# from the wheelhouse alone.
FROM deps AS builder
WORKDIR /src
COPY client/ client/
COPY server/ server/
COPY pyproject.toml README.md* ./
RUN set -eux; \
    /opt/limelight/bin/pip wheel --no-index --find-links /wheelhouse --no-deps \
        --wheel-dir /dist ./client .; \
    /opt/limelight/bin/pip install --no-index --find-links /wheelhouse --find-links /dist \
        --constraint /wheelhouse/requirements.lock limelight==0.1.0

# ---------------------------------------------------------------------------------------------
# runtime: the dependency environment plus the two project wheels; nothing else of the build.
FROM base AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="limelight" \
      org.opencontainers.image.description="gRPC explanation sidecar for transformer text classifiers" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.limelight.variant="${VARIANT}"
COPY --from=deps /opt/limelight /opt/limelight
COPY --from=builder /dist/ /opt/limelight-dist/
# Dependencies were resolved in `builder`; here only the project wheels go in (a small layer).
RUN set -eux; \
    /opt/limelight/bin/python -m pip install --no-index --no-deps /opt/limelight-dist/*.whl; \
    rm -rf /opt/limelight-dist; \
    /opt/limelight/bin/python -m pip uninstall -y pip; \
    find /opt/limelight -name '__pycache__' -type d -prune -exec rm -rf {} +; \
    /opt/limelight/bin/python -c 'import limelight.cli.main, limelight_client, torch, onnxruntime'
# Writable state lives only under /var/lib/limelight (an emptyDir or volume in Kubernetes), so the
# root file system can be mounted read-only. The model is mounted read-only at /models/classifier.
RUN set -eux; \
    mkdir -p /var/lib/limelight/cache /models/classifier; \
    chown -R 10001:10001 /var/lib/limelight; \
    chmod 0750 /var/lib/limelight
ENV PATH=/opt/limelight/bin:${PATH} \
    HOME=/var/lib/limelight \
    TMPDIR=/tmp \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HOME=/var/lib/limelight/cache/huggingface \
    MPLCONFIGDIR=/var/lib/limelight/cache/matplotlib \
    LIMELIGHT_MODEL_DIR=/models/classifier \
    LIMELIGHT_HOST=0.0.0.0 \
    LIMELIGHT_PORT=50051 \
    LIMELIGHT_METRICS_PORT=9464 \
    LIMELIGHT_CACHE_DIR=/var/lib/limelight/cache \
    LIMELIGHT_JOBS=sqlite \
    LIMELIGHT_JOBS_DB=/var/lib/limelight/jobs.sqlite3
USER 10001:10001
WORKDIR /var/lib/limelight
EXPOSE 50051 9464
ENTRYPOINT ["limelight"]
CMD ["serve"]
