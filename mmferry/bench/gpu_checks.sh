#!/usr/bin/env bash
# Every GPU check in one run, for a session lent a CUDA machine: the CUDA tests (they skip on
# the CPU), the GPU sections of the benchmarks, the full-size vision towers (eager vs CUDA
# graphs, beside transformers, with model FLOPs utilisation) and the proxy's CPU cost on the
# host's own cores. Uses that machine's own python3 and torch; mmferry runs from the checkout,
# uninstalled. The log also lands in $OUT when it is set. Record what it prints in
# BENCHMARKS.md ("GPU").
#
# Each step has its own time limit (together under 8 minutes). A step that fails or runs out of
# time does not stop the others, but it is named at the end and the script exits non-zero:
# no check fails silently.
#
#   bash mmferry/bench/gpu_checks.sh [--dry-run] [--only STEP[,STEP]]
#   (--dry-run: list the steps, run nothing; --only: run just the steps named)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="${OUT:-.}/gpu_checks.log"
dry=0
only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --only)
            [ $# -ge 2 ] || { echo "gpu_checks.sh: --only needs step names" >&2; exit 2; }
            only=",$2,"
            shift
            ;;
        *) echo "gpu_checks.sh: unknown argument '$1' (--dry-run, --only)" >&2; exit 2 ;;
    esac
    shift
done

failed=()
total=0

# step NAME SECONDS COMMAND...: run COMMAND under a time limit; remember a failure by name.
step() {
    local name=$1 limit=$2
    shift 2
    if [ -n "$only" ] && [[ "$only" != *",$name,"* ]]; then
        return 0
    fi
    total=$((total + limit))
    echo "== $name (limit ${limit}s): $*"
    [ "$dry" = 1 ] && return 0
    local start=$SECONDS rc=0 why
    timeout --kill-after=10 "$limit" "$@" || rc=$?
    if [ "$rc" -ne 0 ]; then
        [ "$rc" -eq 124 ] && why="timed out after ${limit}s" || why="exit $rc"
        failed+=("$name: $why")
        echo "!! $name FAILED ($why)"
    fi
    echo "== $name: $((SECONDS - start))s"
}

checks() {
    step device 20 nvidia-smi -L
    step versions 30 python3 -c "import torch, transformers; print('torch', torch.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())"
    step cuda-tests 140 python3 -m pytest -q -p no:cacheprovider -rs --timeout 120 \
        tests/feed tests/transport tests/embed tests/models \
        tests/encoder/test_model.py tests/encoder/test_attention.py tests/encoder/test_compact.py \
        tests/encoder/test_graphs.py tests/encoder/test_budgets.py tests/encoder/test_batched.py
    step bench-materialize 30 python3 -m mmferry.bench.materialize --quick
    step bench-encoder-quick 60 python3 -m mmferry.bench.encoder --quick
    step bench-encoder-full 150 python3 -m mmferry.bench.encoder --full --rounds 10 \
        --json "${OUT:-.}/encoder_full.json"
    step proxy-cpu 30 python3 examples/proxy_cpu.py --requests 50 --warmup 10
    echo "== steps' limits: ${total}s"
    if [ "$dry" = 1 ]; then
        echo "== dry run: nothing ran"
        return 0
    fi
    if [ "$total" -eq 0 ]; then
        echo "!! no step ran: --only named none of them"
        return 1
    fi
    if [ "${#failed[@]}" -ne 0 ]; then
        echo "!! ${#failed[@]} step(s) FAILED:"
        printf '!!   %s\n' "${failed[@]}"
        return 1
    fi
    echo "== every step passed"
}

checks 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
