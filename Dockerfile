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

# specd installed like any package: `pip install .` builds the wheel (its build generates the gRPC
# stubs from proto/; the demo pair is package data) straight from the build context, bind-mounted
# read-write for the build and discarded after it, so no source copy stays in the image and nothing
# needs PYTHONPATH.
RUN --mount=type=bind,target=/src,rw pip install /src

# The probe used by compose healthchecks and Kubernetes exec probes.
COPY deploy/healthcheck.py deploy/healthcheck.py

RUN useradd --create-home --uid 10001 specd && mkdir -p benchmarks/results && chown specd benchmarks/results
USER specd

# gateway HTTP, draft gRPC, target gRPC, draft metrics, target metrics
EXPOSE 8000 50051 50052 9101 9102
ENTRYPOINT ["specd"]
CMD ["serve", "--host", "0.0.0.0"]
