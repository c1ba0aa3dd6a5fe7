#!/bin/bash
cd /work/main
for r in a b; do
  for e in E0 E1; do
    echo "$e$r start $(date +%T) $(cat /proc/loadavg)"
    flock /work/notes/bench.lock env PYTHONPATH=/tmp/exp/$e/src .venv/bin/turnkv bench scenarios --suite render-ahead \
      --only 32k-nvlink --only 16k-nvlink --out /tmp/ra-B/$e$r > /tmp/ra-B/$e$r.log 2>&1
    echo "$e$r end $(date +%T) rc=$? $(cat /proc/loadavg)"
  done
done
