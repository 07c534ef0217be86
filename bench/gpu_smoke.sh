#!/usr/bin/env bash
# Runs bench/gpu_check.sh, the GPU check (its header says what it runs, its limits, its dry run), with these arguments.
exec bash "$(dirname "$0")/gpu_check.sh" "$@"
