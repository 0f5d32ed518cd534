# syntax=docker/dockerfile:1
# specd, CPU image (the default). The CUDA image is deploy/docker/Dockerfile.cuda.
#
#   docker build -t specd:cpu .
#   docker run --rm -p 8000:8000 specd:cpu          # `specd serve`: the demo pair on http://localhost:8000/v1
#   docker run --rm specd:cpu draft --help          # any `specd` subcommand
#
# docker-compose.yml runs the three services from this image, one container each.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# torch first, from the CPU index: `torch==2.13.0` from PyPI is the multi-GB CUDA build on x86-64.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# The gRPC stubs are generated (into /app/specd), never copied from the host.
COPY proto/ proto/
COPY scripts/gen_proto.py scripts/gen_proto.py
RUN pip install "grpcio-tools>=1.60" && python scripts/gen_proto.py

COPY pyproject.toml README.md ./
COPY services/ services/
COPY gateway/ gateway/
COPY benchmarks/ benchmarks/
RUN pip install . && rm -rf build *.egg-info

# The committed demo pair, and the probe used by compose healthchecks and Kubernetes exec probes.
COPY models/demo-target/ models/demo-target/
COPY models/demo-draft/ models/demo-draft/
COPY deploy/healthcheck.py deploy/healthcheck.py

# Import specd from /app (the installed copy is the same code): its defaults then find the demo
# models at /app/models, as in a checkout, so `specd serve` / `specd generate` work without --target.
ENV PYTHONPATH=/app

RUN useradd --create-home --uid 10001 specd && mkdir -p benchmarks/results && chown specd benchmarks/results
USER specd

# gateway HTTP, draft gRPC, target gRPC, draft metrics, target metrics
EXPOSE 8000 50051 50052 9101 9102
ENTRYPOINT ["specd"]
CMD ["serve", "--host", "0.0.0.0"]
