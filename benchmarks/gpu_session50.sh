#!/usr/bin/env bash
# GPU, 2026-12-06: issue 28 with the HTTP edge and the output processing in processes of its own. The plan of
# gpu_session49.sh (its parts: check, eight, one) with 256-token replies, the length issue 28 measures; stops 48 and
# 49 used 128, which weighs the aggregate rate down with the admission ramp.
# usage: bash benchmarks/gpu_session50.sh OUT PART
REPLY_TOKENS=256 exec bash "$(dirname "$0")/gpu_session49.sh" "$@"
