#!/bin/bash
# Issue 24's routing matrix on the real twin, on the 16-core GPU machine, in about 8 minutes:
# one bench/routing_bench.py process per engine cell (slots x KV room), the four side by side,
# two workload/load cells each, every target (cost-model, prefix-affinity, least-outstanding,
# round-robin, nginx least_conn), merged into one result.
#
#   bench/routing_matrix_device.sh OUTDIR [SECONDS]      (SECONDS per target visit, default 20)
#   CELLS='s8/room4/uniform/r1;s64/room4/unique/r2' bench/routing_matrix_device.sh OUTDIR 5
#       (other cells: one process per ';'-separated group; a group's cells share an engine cell)
#   TARGETS=prefix-affinity,least-outstanding,nginx bench/routing_matrix_device.sh OUTDIR
#       (fewer targets: a policy change against the baselines, in 3/5 of the time)
#   ROUNDS=2 bench/routing_matrix_device.sh OUTDIR 15
#       (every target visited twice per cell, in rotated order: the cell's verdict on the
#       medians, less at the mercy of one noisy visit; twice the time)
#
# Needs, carried from the CPU machine (both ignored by git, under .carry/):
#   .carry/payload     scripts/pack-gpu-payload .carry/payload   (tritonserver + wheels, ~30 MB)
#   .carry/relay-kit   ../shared/tools/relay-kit .carry/relay-kit (nginx for the nginx target, ~12 MB),
#                      or it packed: tar -C .carry/relay-kit -cJf .carry/rk.tar.xz . (3.6 MB; the payload,
#                      the tree and the directory passed the device's 64 MiB in November 2026)
# and python3 with aiohttp and psutil (the GPU image's /opt/torch/.venv has both).
#
# Writes OUTDIR/routing_bench-<stamp>.{json,png} (bench/routing_bench.py --merge of the four)
# and OUTDIR/routing_matrix.log (every process's output): three files, inside the device's
# limit on what comes back. The simulator's numbers for the same cells are left out here
# (--no-sim: a core-minute per cell); `python -m bench.routing_sim --cells ...` gives them.
#
# Timing (per process): start ~10 s, then 2 cells x 5 targets x (SECONDS + up to 10 s of
# drain + reload), ~5.5 min at 20 s; the four run at once on 16 cores (each: 2 tritonservers,
# the daemon and its data-plane worker, the load generator).
set -euo pipefail
out=${1:?usage: routing_matrix_device.sh OUTDIR [SECONDS]}
seconds=${2:-20}
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
mkdir -p "$out"
log="$out/routing_matrix.log"
work=$(mktemp -d /tmp/routing-matrix-XXXXXX)
trap 'rm -rf "$work"' EXIT

{
  echo "== $(date -u +%FT%TZ) $(nproc) cores, $($py --version 2>&1)"
  # (where nothing is carried, as on the CPU machine: the .triton and nginx already there)
  if [ -d .carry/payload ]; then "$py" scripts/unpack-gpu-payload .carry/payload --python "$py"; fi
} >>"$log" 2>&1
if [ -f .carry/rk.tar.xz ] && [ ! -d .carry/relay-kit ]; then
  mkdir -p .carry/relay-kit && tar -xJf .carry/rk.tar.xz -C .carry/relay-kit
fi
if [ -d .carry/relay-kit ]; then export PATH="$PWD/.carry/relay-kit/bin:$PATH"; fi
command -v nginx >>"$log"

# Per engine cell: one shared-prefix cell where a split of the tenants costs most, and one
# cell whose goal is only "no worse than least-outstanding / nginx".
groups=(
  "s8/room1.5/zipf/r1,s8/room1.5/chat/closed"
  "s8/room4/uniform/r1,s8/room4/mixed/closed"
  "s64/room1.5/zipf/r2,s64/room1.5/uniform/r1"
  "s64/room4/uniform/closed,s64/room4/unique/r2"
)
if [ -n "${CELLS:-}" ]; then IFS=';' read -r -a groups <<<"$CELLS"; fi
pids=()
for i in "${!groups[@]}"; do
  mkdir -p "$work/part$i"
  "$py" -m bench.routing_bench --cells "${groups[$i]}" --seconds "$seconds" --drain-s 10 --rounds "${ROUNDS:-1}" \
    ${TARGETS:+--targets "$TARGETS"} --no-sim --out "$work/part$i" >"$work/log$i" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || failed=1
  { echo "== process $i: ${groups[$i]}"; cat "$work/log$i"; } >>"$log"
done
parts=("$work"/part*/routing_bench-*.json)
if [ -e "${parts[0]}" ]; then
  "$py" -m bench.routing_bench --merge "${parts[@]}" --out "$out" >>"$log" 2>&1 || failed=1
fi
ls -l "$out" >>"$log"
exit $failed
