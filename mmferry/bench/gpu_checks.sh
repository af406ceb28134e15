#!/usr/bin/env bash
# Every GPU check in one run, for a session lent a CUDA machine: the CUDA tests (they skip on
# the CPU) and the GPU sections of the benchmarks. Uses that machine's own python3 and torch;
# mmferry runs from the checkout, uninstalled. The log also lands in $OUT when it is set.
# Record what it prints in BENCHMARKS.md ("GPU").
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="${OUT:-.}/gpu_checks.log"
{
    nvidia-smi -L
    python3 -c "import torch, transformers; print('torch', torch.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())"
    python3 -m pytest -q -p no:cacheprovider -rs --timeout 300 \
        tests/feed tests/transport tests/embed tests/models \
        tests/encoder/test_model.py tests/encoder/test_attention.py tests/encoder/test_compact.py
    python3 -m mmferry.bench.materialize --quick
    python3 -m mmferry.bench.encoder --quick
} 2>&1 | tee "$log"
