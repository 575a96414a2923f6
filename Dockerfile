# syntax=docker/dockerfile:1
# posenc-serve images. Targets:
#   cpu  slim Python image, onnxruntime (CPU)
#   gpu  NVIDIA CUDA runtime image, onnxruntime-gpu (needs the NVIDIA container toolkit)
# Both carry the model repository, exported at build time from the shipped weights.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04
# torch is only needed to export; its CPU wheels keep every image free of CUDA torch.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_INDEX
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY contract contract
COPY models models
COPY export export
COPY service service
COPY loadtest loadtest
COPY proto proto
RUN pip install --extra-index-url "${TORCH_INDEX}" '.[cpu]' \
 && python -m export --out /models --no-verify \
 && useradd --create-home --uid 10001 posenc
USER posenc
ENV POSENC_MODEL_REPOSITORY=/models POSENC_HOST=0.0.0.0 POSENC_METRICS_HOST=0.0.0.0 \
    POSENC_PORT=50051 POSENC_METRICS_PORT=9464 POSENC_DEVICE=cpu
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["python", "-m", "service.healthcheck"]
CMD ["python", "-m", "service"]

FROM ${CUDA_IMAGE} AS gpu
ARG TORCH_INDEX
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
 && add-apt-repository -y ppa:deadsnakes/ppa \
 && apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY pyproject.toml README.md ./
COPY contract contract
COPY models models
COPY export export
COPY service service
COPY loadtest loadtest
COPY proto proto
RUN pip install --extra-index-url "${TORCH_INDEX}" '.[gpu]' \
 && useradd --create-home --uid 10001 posenc
COPY --from=cpu /models /models
USER posenc
ENV POSENC_MODEL_REPOSITORY=/models POSENC_HOST=0.0.0.0 POSENC_METRICS_HOST=0.0.0.0 \
    POSENC_PORT=50051 POSENC_METRICS_PORT=9464 POSENC_DEVICE=auto
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=90s --retries=3 CMD ["python", "-m", "service.healthcheck"]
CMD ["python", "-m", "service"]
