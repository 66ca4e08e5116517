# An Aurora node on NVIDIA GPUs: upstream vLLM's own image (vLLM with the CUDA torch it was built
# for) and Aurora on top. Aurora's pinned CPU torch is not installed here: vLLM's stays.
# Build from the repository root:   docker build -f docker/cuda.Dockerfile -t aurora:cuda .
# Run one node as for docker/cpu.Dockerfile, with `--gpus all` (or the engine's GPU request).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    AURORA_CACHE=/var/lib/aurora/cache

WORKDIR /opt/aurora
COPY pyproject.toml README.md ./
COPY aurora ./aurora
COPY actors ./actors
COPY transport ./transport

# Aurora's dependencies but torch, constrained to what the image already has (vLLM's pins win: an
# unsatisfiable pair fails the build here, not at run time), then Aurora itself without them; the
# build ends by checking the environment and importing vLLM and Aurora's engine.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python3 -m pip list --format=freeze > /tmp/constraints.txt \
    && python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(r for r in p['dependencies'] + p['optional-dependencies']['webrtc'] if not r.startswith('torch')))" \
        > /tmp/requirements.txt \
    && python3 -m pip install -c /tmp/constraints.txt -r /tmp/requirements.txt \
    && python3 -m pip install --no-deps . \
    && python3 -m pip check \
    && rm /tmp/constraints.txt /tmp/requirements.txt \
    && python3 -c "import vllm, aurora.rl.engines.vllm_engine" \
    && python3 -m aurora --version

VOLUME ["/var/lib/aurora/store", "/var/lib/aurora/model"]

# vLLM's image starts its API server; an Aurora node is started by the engine's command instead.
ENTRYPOINT []
# As root, for the reason given in docker/cpu.Dockerfile.
CMD ["python3", "-m", "aurora", "node", "--help"]
