#!/bin/bash
# Issue 22's data-plane bench on the 16-core GPU machine (no network, no nginx, wrk or package
# index there): bench/dataplane_bench.py with the product's targets (NGINX, the embedded workers
# with aiohttp's path and with the compiled front, the default) at 1, 2, 4, 8 and 12 workers,
# 32- and 256-event streams, tiny answers, TTFT. The designs measured beside them (split, the
# front's prototypes: dataplane_bench's TARGETS) are asked for by name (--targets), as each
# doubles the run: all of them at 1-4 workers ran past the device's 10 minutes a command.
#
#   bench/dataplane_device.sh OUTDIR [extra dataplane_bench arguments]
#   bench/dataplane_device.sh OUTDIR --workers 1,2,4,8,12,16 --source-procs 4
#       (a 64-core host, nvidia-h200-x4: 8 single-process sources cap NGINX at ~2M events/s
#       from 4 workers on; 4 processes per source lift that past 6M)
#
# Needs, carried from the CPU machine (ignored by git): .carry/dp, made here by
#   ../shared/tools/relay-kit .carry/dp/relay        (static nginx, wrk, bench/sse_source.c built)
#   cp <httptools, uvloop, py-spy, prometheus_client, orjson cp312 wheels> .carry/dp/wheels/
# and python3 with aiohttp and psutil (the GPU image's /opt/torch/.venv has both; PYTHON=...).
# The device tool brings back at most 8 files a call: write OUTDIR under $OUT and tar it there
# (`cd $OUT && tar czf r.tgz OUTDIR && rm -rf OUTDIR`), or all but 8 of its files are lost.
set -euo pipefail
out=${1:?usage: dataplane_device.sh OUTDIR [dataplane_bench args]}
shift
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
site=$(mktemp -d /tmp/dp-site-XXXXXX)
trap 'rm -rf "$site"' EXIT
# A wheel is a zip: unpacked beside the interpreter's own packages, no pip needed.
for whl in .carry/dp/wheels/*.whl; do "$py" -m zipfile -e "$whl" "$site"; done
chmod +x "$site"/py_spy-*.data/scripts/py-spy 2>/dev/null || true
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$PWD/.carry/dp/relay/bin:$(echo "$site"/py_spy-*.data/scripts):$PATH"
"$py" -c 'import uvloop, httptools, prometheus_client' # fail early, not after minutes
# The compiled modules (the front, the routing passes): a fresh machine has none built, and the
# workers would serve with aiohttp's path (dataplane_bench refuses to measure that as the front)
"$py" setup.py -q build_ext --inplace > "$site/build.log" 2>&1 || { tail -20 "$site/build.log"; exit 1; }
mkdir -p "$out"
# The lone stream's p50 (the +0.3 ms goal) sampled 8 s a target: at 2-4 s (12-25 streams) it
# moved by 0.05-0.09 ms between runs of the same code (bench/README.md, dataplane_bench)
"$py" -m bench.dataplane_bench --workers 1,2,4,8,12 --seconds 5 --ttft-seconds 8 --long-events 256 \
  --targets nginx,embedded,embedded-front --out "$out" "$@" 2>&1 | grep -v 'setrlimit(RLIMIT_NOFILE' | tee "$out/dataplane_device.log"
