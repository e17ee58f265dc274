# vramsched extender image: `docker build -t <registry>/vramsched:0.1.0 .`
#
# Two stages: the first installs the package and its wheels into a venv, the
# second copies only that venv onto a clean slim base (no pip cache, no build
# tree, no compiler). The base is pinned to an exact Python patch release and
# Debian suite; for reproducible builds also pin its digest, e.g.
#   docker buildx imagetools inspect python:3.11.13-slim-bookworm
# and build with --build-arg PYTHON_IMAGE=python:3.11.13-slim-bookworm@sha256:<digest>.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Only what `pip install .` needs (pyproject reads README.md as the long description).
COPY pyproject.toml README.md ./
COPY extender ./extender
RUN pip install . \
 && python -m compileall -q /opt/venv/lib

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="vramsched" \
      org.opencontainers.image.description="VRAM-aware GPU scheduler extender for Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
# Bytecode was compiled in the build stage; the root filesystem is read-only
# at run time. HOME points at the writable /tmp emptyDir of the Deployment.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
COPY --from=build /opt/venv /opt/venv
# Numeric non-root UID/GID (65532, "nonroot" in distroless images, also used by
# the kube-scheduler container) so runAsNonRoot can verify it.
USER 65532:65532
# Loopback only by default: kube-scheduler reaches it from the same pod.
EXPOSE 8888
ENTRYPOINT ["vramsched", "serve"]
