# gpuwarden container image: a wheel built in one stage, installed into a slim runtime with no build tools.
# NVML comes from the host through the NVIDIA container runtime (libnvidia-ml.so.1 and /dev/nvidia*): no
# privileged mode, no SYS_ADMIN. tests/test_image.py builds this with buildah and runs it as the DaemonSet does.
# PYTHON_IMAGE: another Python base (3.11+, with pip) where Docker Hub is not reachable.
ARG PYTHON_IMAGE=python:3.12-slim
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY exporter ./exporter
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="gpuwarden" \
      org.opencontainers.image.description="NVIDIA GPU exporter for Prometheus: tiered NVML collection, health, alerts" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/gpuwarden/gpuwarden"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index /wheels/*.whl \
    && rm -rf /wheels \
    && pip uninstall -y pip setuptools wheel \
    && useradd --system --uid 10045 --no-create-home --shell /usr/sbin/nologin gpuwarden
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10045:10045
EXPOSE 10045
ENTRYPOINT ["gpuwarden"]
