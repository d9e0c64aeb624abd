# syntax=docker/dockerfile:1
# finetune for cloud GPUs. Build and run (one machine, all its GPUs):
#   docker build -t finetune .
#   docker run --gpus all --ipc=host -v hf-cache:/data/hf -v "$PWD/runs:/workspace/runs" \
#       finetune recipes/llama3_8b_qlora.yaml [key=value ...]
# Arguments go to the recipe, not to accelerate: for a launcher config use
#   docker run ... --entrypoint accelerate finetune launch --config_file configs/fsdp.yaml -m finetune RECIPE
# or put it at /data/hf/accelerate/default_config.yaml (accelerate's default path under HF_HOME).
# --ipc=host (or a large --shm-size): NCCL and the data loader need more than Docker's 64 MB /dev/shm.

# CUDA 13.0 because torch 2.13.0 on PyPI is built for it (cu13): the wheel pins its own CUDA 13.0.3
# libraries, cuDNN 9.20 and NCCL 2.29.7 as pip packages, so the plain runtime image is enough and
# the -cudnn- variant would only add a second, unused cuDNN. Hosts need a CUDA 13 capable driver.
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Python 3.12: Ubuntu 24.04's own (the minor version is pinned by the package name). Exact apt
# versions are not pinned because the Ubuntu archive keeps only the newest patch release of a
# package: a pin would break the build at the next security update. Reproducibility comes from the
# pinned base image tag and from constraints.txt for every Python package.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --shell /bin/bash --uid 10001 --user-group finetune \
    && mkdir -p /data/hf /workspace/runs /opt/venv /opt/finetune \
    && chown -R 10001:10001 /data/hf /workspace /opt/venv /opt/finetune

# Not root: numeric so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
RUN python3.12 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    HF_HOME=/data/hf
WORKDIR /opt/finetune

# Same versions as CI: every install below goes through constraints.txt. torch comes first, by exact
# version and in its own layer (several GB with its CUDA libraries), so code changes do not refetch it.
COPY --chown=10001:10001 constraints.txt pyproject.toml ./
RUN pip install -c constraints.txt torch==2.13.0 packaging==26.3 psutil==7.2.2 \
        wheel==0.45.1 ninja==1.13.2 einops==0.8.2

# flash-attn: PyPI has only a source package. `pip install flash-attn==X --no-build-isolation` runs
# its setup.py against the torch above, which downloads the project's prebuilt wheel for this
# (CUDA major, torch minor, Python, C++ ABI) from its GitHub release, and compiles only when there is
# none, which fails here (a runtime image has no nvcc) instead of compiling for an hour. The import
# check catches a wheel built for another CUDA major (it cannot find its libcudart) at build time.
# No prebuilt wheel for this torch: build with --build-arg FLASH_ATTN= (recipes asking for
# flash_attention_2 then run on sdpa and say so), or give FLASH_ATTN a wheel URL you have vetted.
ARG FLASH_ATTN=flash-attn==2.8.3.post2
RUN if [ -n "$FLASH_ATTN" ]; then \
        pip install -c constraints.txt --no-build-isolation "$FLASH_ATTN" \
        && python -c "import flash_attn, flash_attn_2_cuda; print('flash-attn', flash_attn.__version__)"; \
    fi

COPY --chown=10001:10001 finetune ./finetune
COPY --chown=10001:10001 recipes ./recipes
COPY --chown=10001:10001 configs ./configs
RUN pip install -c constraints.txt . && pip check

# Model weights and datasets (the HF cache) live outside the image: mount a volume here so they
# download once and survive the container.
VOLUME ["/data/hf"]
WORKDIR /workspace
ENTRYPOINT ["accelerate", "launch", "-m", "finetune"]
CMD ["/opt/finetune/recipes/tiny_cpu.yaml"]
