#!/usr/bin/env bash
# One call on the GPU machine for the decode step's launch shapes: the router's per-row kernel beyond 128 rows,
# the decode attention split kernel's tile (block, pipeline stages, warps), the FP8 experts' swap_ab tiles with
# the activations quantized once; then the captured decode step with the best of each against the defaults.
# Files under $OUT: run.log, ks.json/.log, fp8_sweep.json/.log, best.env, step_{default,best}_{none,fp8}.json/.log
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
exec > >(tee "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${SWEEP_S:-200} python3 bench/kernel_sweep.py --only router attention --router-rows 128 160 192 256 384 512 \
  --attention-batches 128 192 --attention-tiles --json "$OUT/ks.json" > "$OUT/ks.log" 2>&1
grep -E "BEST|default \(" "$OUT/ks.log"
variants=("swap prequant" "swap m64" "swap m16 n128")  # the variants the sweep of ee0e3e8 did not time, and its best
timeout ${FP8_S:-150} python3 bench/fp8_fidelity.py --sweep --batches 128 192 --variants "${variants[@]}" --json "$OUT/fp8_sweep.json" > "$OUT/fp8_sweep.log" 2>&1
grep -E "^batch" "$OUT/fp8_sweep.log"
# the best of each sweep, as decode_step's arguments (best.env)
python3 - "$OUT" <<'PY'
import json, re, sys
out = sys.argv[1]
res = json.load(open(f"{out}/ks.json"))["results"]
us = {(r["kernel"], r["config"]): r["us"] for r in res if "config" in r}
row_max = 128
for n in (160, 192, 256, 384, 512):
    row = min(v for (k, c), v in us.items() if k == f"router n={n}" and c.startswith("row"))
    dot = min(v for (k, c), v in us.items() if k == f"router n={n}" and c.startswith("dot"))
    print(f"router n={n}: row {row:.2f} us, tile {dot:.2f} us")
    if row < dot:
        row_max = n
tiles: dict[str, float] = {}
for (k, c), v in us.items():
    if k.startswith("attention") and "block=" in c and c.startswith(f"splits=2 "):
        t = c.split(" ", 1)[1]
        tiles[t] = tiles.get(t, 0.0) + v
default = sum(v for (k, c), v in us.items() if k.startswith("attention") and c.startswith("default"))
best = min(tiles, key=tiles.get)
print(f"attention, 4 configs summed: default {default:.1f} us, best {best} {tiles[best]:.1f} us")
b, st, w = (int(x) for x in re.findall(r"=(\d+)", best))
fp8 = json.load(open(f"{out}/fp8_sweep.json"))["sweep"]
tot: dict[str, float] = {}
for r in fp8:
    for name, t in r["fp8_us"].items():
        tot[name] = tot.get(name, 0.0) + t
fbest = min(tot, key=tot.get)
print(f"fp8 at 128+192: default {sum(r['default_us'] for r in fp8):.1f} us, best {fbest} {tot[fbest]:.1f} us")
open(f"{out}/best.env", "w").write(f'ROUTER={row_max}\nATT="{b} {st} {w}"\nFP8TILE="{fbest}"\n')
PY
source "$OUT/best.env"; cat "$OUT/best.env"
for q in ${DTYPES:-fp8 none}; do
  for v in default best; do
    args=(); tile=""
    [ $v = best ] && { args=(--router-row-max $ROUTER --attention-tile $ATT); [ $q = fp8 ] && tile="$FP8TILE"; }
    ZONOS_FP8_TILE="$tile" timeout ${STEP_S:-110} python3 bench/decode_step.py --batches ${BATCHES:-128 192} \
      --batch-invariant off --quantization $q "${args[@]}" --json "$OUT/step_${v}_$q.json" > "$OUT/step_${v}_$q.log" 2>&1
    echo "$q $v:"; grep -A3 "^batch" "$OUT/step_${v}_$q.log"
  done
done
