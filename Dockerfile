# One image for every kvlane service; the command picks the service.
#   docker build -t kvlane:sim .                              sim engine, CPU only (also the control plane)
#   docker build --build-arg ENGINE=vllm -t kvlane:vllm .     vLLM workers on NVIDIA GPUs
# ENGINE=vllm starts from vLLM's own CUDA image (VLLM_BASE: its vllm, torch
# and CUDA libraries) and adds kvlane with its `vllm-gpu` extra, whose vllm
# pin that image already satisfies, plus NIXL for prefill/decode KV transfer.
# k8s/ runs both: the control plane on kvlane:sim, GPU workers on kvlane:vllm.
ARG ENGINE=sim
ARG SIM_BASE=python:3.11-slim
ARG VLLM_BASE=vllm/vllm-openai:v0.32.0

FROM ${SIM_BASE} AS base-sim
ENV KVLANE_EXTRAS=""

FROM ${VLLM_BASE} AS base-vllm
# NIXL's CUDA 12 build, without dependencies (its own unpinned torch would
# replace the image's); skipped when the image already has NIXL.
ARG NIXL_PACKAGES="nixl==1.5.1 nixl-cu12==1.5.1"
ENV KVLANE_EXTRAS="[vllm-gpu]" \
    PIP_BREAK_SYSTEM_PACKAGES=1
RUN command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python \
    && (python3 -c "import nixl" 2>/dev/null || python3 -m pip install --no-cache-dir --no-deps ${NIXL_PACKAGES})
# vLLM's image starts its own server; kvlane's pods give the command.
ENTRYPOINT []

FROM base-${ENGINE}
# An unprivileged user (k8s/ runs every kvlane pod as 10001) with a writable
# home for the caches vLLM, Triton and Hugging Face keep there.
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/kvlane kvlane
WORKDIR /app
COPY pyproject.toml README.md ./
COPY contracts ./contracts
COPY shared ./shared
COPY services ./services
COPY launch ./launch
COPY kvlane ./kvlane
COPY loadtest ./loadtest
RUN python3 -m pip install --no-cache-dir ".${KVLANE_EXTRAS}"
USER 10001
ENV HOME=/home/kvlane \
    KVLANE__LOGGING__FORMAT='"json"'
CMD ["python", "-m", "services.ingress"]
