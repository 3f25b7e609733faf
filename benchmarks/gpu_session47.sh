#!/usr/bin/env bash
# H200, 2026-12-05 (fourth session that day). One part per device call.
#   before/  = 18a8a04 (before the step that queues the logprobs matrix, not a row each)
#   before2/ = 6d2d395 (before the powers-of-two start passes and the start passes planned ahead)
#   before3/ = af87102 (before grammar rows were masked together in the decode step)
#   each: mkdir DIR && git archive REV mlxcel benchmarks pyproject.toml | tar -x -C DIR && echo REV > DIR/.commit
# usage: bash benchmarks/gpu_session47.sh OUT PART
#   gram:  structured_output at 16 streams, 8B, before3/ and this tree alternating (two runs each); gram1: 1B once each
#   ab16:  8B at 16 streams, this tree and before/ alternating (each with its floor); executor_decode.py
#   eight: as gpu_session46.sh eight (8B: floor, this tree at 1/16/64 streams and the wave; before/ at 16,64)
#   one:   as gpu_session46.sh one (1B the same; before2/'s 8B wave)
set -uo pipefail
out=${1:-$OUT}; part=${2:-gram}
source benchmarks/gpu_common.sh
grammar() {  # TREE SHAPE
  cp benchmarks/structured_output.py $1/benchmarks/structured_output.py
  echo "== $2 $1 ($(cat $1/.commit 2>/dev/null || echo this tree))"
  (cd $1 && PYTHONPATH=$PWD timeout 150 python3 -m benchmarks.structured_output --model-path /root/models/$2 \
    --streams 16 --repeats 2 --tools 5 2>&1 | grep -A2 "^streams")
}
case $part in
gram)
  s=$SECONDS; model llama-3.1-8b; echo "== model ready in $((SECONDS - s)) s"
  for tree in before3 . before3 .; do grammar $tree llama-3.1-8b; done ;;
gram1)
  model llama-3.2-1b
  for tree in before3 .; do grammar $tree llama-3.2-1b; done ;;
ab16)  # this tree and before/ alternating at 16 streams, each against its own floor; then the executor alone
  for tree in . before . before; do
    echo "== 16 streams $tree"
    (cd $tree && PYTHONPATH=$PWD timeout 100 python3 -m benchmarks.decode_speed --model-path /root/models/llama-3.1-8b \
      --streams 16 --reply-tokens 128 --skip-wave --skip-conversations --floor-runs 1 --deadline-s 80 2>&1 | grep "^| 16")
  done
  timeout 150 python3 benchmarks/executor_decode.py --model-path /root/models/llama-3.1-8b --batches 1,16,64 --ragged on,off ;;
eight|one) bash benchmarks/gpu_session46.sh $out $part ;;
*) echo "unknown part $part"; exit 2 ;;
esac
