# posenc-serve images (README, "Deploy"). Targets:
#   cpu     the serving image: onnxruntime, grpcio, protobuf, numpy, prometheus-client, the service's
#           code and the model repository in /models. No torch, onnx, Locust or matplotlib.
#   locust  Locust and loadtest/ (docker compose's `loadtest` profile); no ONNX Runtime, no models.
#   gpu     NVIDIA CUDA runtime image: onnxruntime-gpu and torch (the KV store's CUDA arrays); needs
#           the NVIDIA container toolkit. Nothing for export.
# Build-only stages: `export` (torch's CPU wheel, onnx) exports the model repository from the shipped
# weights, which every serving image copies; `*-deps` install one role's dependencies (pyproject.toml's
# extras) into /opt/venv, which the final stages copy without pip's build leftovers.
# Base images and torch's indexes are build args: where the registries cannot be reached,
# deploy/smoke.sh builds stand-ins and offers them here.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04
# torch's CPU wheels for the export stage (the default index's Linux wheels carry CUDA).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# The GPU image's torch, built for the base image's CUDA 12.8.
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128

# ---- a venv with one role's dependencies, installed from pyproject.toml alone --------------------
FROM ${PYTHON_IMAGE} AS venv
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
# Without its packages (they are not copied yet) the project installs as its dependencies alone, so
# these layers are rebuilt only when pyproject.toml changes. README.md is pyproject's `readme`; an
# empty one keeps README edits from invalidating them. The code runs from /app (PYTHONPATH).
# hadolint's DL3013 (pin versions in pip) is ignored on `pip install '.[extra]'`: pyproject.toml
# pins every version.
COPY pyproject.toml ./
RUN touch README.md

# ---- export the model repository (torch, CPU) ----------------------------------------------------
FROM venv AS export
ARG TORCH_INDEX
# hadolint ignore=DL3013
RUN pip install --extra-index-url "${TORCH_INDEX}" '.[serve-cpu,export]'
WORKDIR /app
COPY contract contract
COPY models models
COPY export export
# --fp16: the gpu image copies this folder and serves the float16 graphs (a CPU server uses float32).
# Only each scheme's primary seed, the models `docker compose up` serves: the further training seeds'
# graphs (models/weights/seed<N>/, exported as <scheme>@seed<N>) took the cpu image from about 700 MB
# to 879 MB. `--build-arg EXTRA_SEEDS=1` exports them too (the comparison scores them).
ARG EXTRA_SEEDS=0
RUN if [ "${EXTRA_SEEDS}" = 1 ]; then python -m export --out /models --no-verify --fp16; \
    else python -m export --out /models --no-verify --fp16 --no-extra-seeds; fi

# ---- what the cpu and locust images share: the user, the environment, the service's code --------
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH PYTHONPATH=/app
RUN useradd --no-log-init --create-home --uid 10001 posenc
WORKDIR /app
# The serving layer imports only contract/ and itself (pyproject.toml's import contracts).
COPY contract contract
COPY service service
RUN python -m compileall -q contract service

# ---- cpu: the serving image ----------------------------------------------------------------------
FROM venv AS cpu-deps
# hadolint ignore=DL3013
RUN pip install '.[serve-cpu]'

FROM runtime AS cpu
COPY --from=cpu-deps /opt/venv /opt/venv
COPY --from=export /models /models
USER 10001
ENV POSENC_MODEL_REPOSITORY=/models POSENC_HOST=0.0.0.0 POSENC_METRICS_HOST=0.0.0.0 \
    POSENC_PORT=50051 POSENC_HTTP_PORT=8000 POSENC_METRICS_PORT=9464 POSENC_DEVICE=cpu
EXPOSE 50051 8000 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["python", "-m", "service.healthcheck"]
CMD ["python", "-m", "service"]

# ---- locust: load generation ---------------------------------------------------------------------
FROM venv AS locust-deps
# hadolint ignore=DL3013
RUN pip install '.[loadtest]'

FROM runtime AS locust
COPY --from=locust-deps /opt/venv /opt/venv
# loadtest/ may import anything: the Locust users take their prompts from models/ (corpus and tokenizer; code only).
COPY models/*.py models/
COPY loadtest loadtest
USER 10001
EXPOSE 8089
CMD ["locust", "-f", "loadtest/locustfile.py"]

# ---- gpu: the CUDA serving image -----------------------------------------------------------------
FROM ${CUDA_IMAGE} AS gpu
ARG TORCH_CUDA_INDEX
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# deadsnakes' Python 3.11 for Ubuntu 22.04; its package versions move, so they are not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
 && add-apt-repository -y ppa:deadsnakes/ppa \
 && apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv \
 && useradd --no-log-init --create-home --uid 10001 posenc
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/app
WORKDIR /src
COPY pyproject.toml ./
# hadolint ignore=DL3013
RUN touch README.md \
 && pip install --extra-index-url "${TORCH_CUDA_INDEX}" '.[serve-gpu]' \
 && rm -rf /src
WORKDIR /app
COPY contract contract
COPY models/*.py models/
COPY service service
RUN python -m compileall -q contract models service
COPY --from=export /models /models
USER 10001
ENV POSENC_MODEL_REPOSITORY=/models POSENC_HOST=0.0.0.0 POSENC_METRICS_HOST=0.0.0.0 \
    POSENC_PORT=50051 POSENC_HTTP_PORT=8000 POSENC_METRICS_PORT=9464 POSENC_DEVICE=auto
EXPOSE 50051 8000 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=90s --retries=3 CMD ["python", "-m", "service.healthcheck"]
CMD ["python", "-m", "service"]
