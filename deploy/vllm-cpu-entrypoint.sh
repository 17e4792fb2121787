#!/bin/sh
# vLLM-CPU backend of a tiny model (image target `vllm-cpu`): build the variant from the
# alpaca_eval data the image carries (cached in $LANEWAY_HOME), then serve it.
# Env: VARIANT (small | large | small-alt ...), SERVED_MODEL_NAME, MAX_MODEL_LEN.
set -eu
VARIANT="${VARIANT:-small}"
MODEL_DIR="$(python -c "from pathlib import Path; from bench.models.tiny_models import ensure_model; print(ensure_model('${VARIANT}', Path('/opt/laneway-dev/datasets')))")"
exec python -m vllm.entrypoints.openai.api_server \
    --model "${MODEL_DIR}" --served-model-name "${SERVED_MODEL_NAME:-tiny-llama}" \
    --host 0.0.0.0 --port 8000 --dtype bfloat16 --enforce-eager \
    --max-model-len "${MAX_MODEL_LEN:-1024}" --distributed-executor-backend uni \
    --disable-uvicorn-access-log "$@"
