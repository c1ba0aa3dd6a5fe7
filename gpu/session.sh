#!/usr/bin/env bash
# One step of a GPU session (gpu/README.md), from the repository root on the GPU host; each fits in 10 minutes:
#   bash gpu/session.sh A    setup + fixtures + plugin check + correctness (sharp model trio)   ~6 min
#   bash gpu/session.sh B1   TTFT by turn, 8b shape, P prefix caching on                         ~7 min
#   bash gpu/session.sh B2   TTFT by turn, P restarted without prefix caching                    ~7 min
#   bash gpu/session.sh C    NIXL link-rate variants (1b model, engine restarts per variant)     ~8 min
#   bash gpu/session.sh C2   more link-rate variants                                             ~8 min
#   bash gpu/session.sh X1   (setup,) turnkv doctor alone on the 8b pair, UCX on TCP                   ~5 min
#   bash gpu/session.sh X2   the same with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (CUDA IPC GET)          ~4 min
#   bash gpu/session.sh D1   setup, then TTFT at 16k with CUDA IPC GET on, P cache off            ~9 min
#   bash gpu/session.sh D2   the same at 4k, then 16k with P's cache on                            ~8 min
#   bash gpu/session.sh L4   (fresh host) setup, 64 conversations again: adaptive, then plain        ~9 min
#   bash gpu/session.sh D3   (fresh host) setup, correctness with CUDA IPC GET, 16k P cache on  ~9.5 min
#   bash gpu/session.sh L1   setup, 8b pair with CUDA IPC GET, load: 32 conversations x 4 turns x
#                            2 waves, P cache on; plain, adaptive, adaptive-pull, colocated         ~9.5 min
#   bash gpu/session.sh L2   the same with 64 conversations x 3 turns                               ~7-9.5 min
#   bash gpu/session.sh L3   P restarted without prefix caching, 32 x 4 turns; stops both           ~8 min
#   bash gpu/session.sh G1   setup, 8b pair, goodput sweep: 8, 16, 32 conversations x 3 turns,
#                            one wave each; plain, vllm-multiturn, adaptive, colocated (adaptive-pull if
#                            time is left)                                                              ~9.5 min
#   bash gpu/session.sh G2   the same engines, 64 conversations x 3 turns, those modes and adaptive-first;
#                            stops both                                                                 ~9 min
#   bash gpu/session.sh G3   setup, 8b pair, 8-64 conversations: adaptive told P and D share the GPU
#                            (shared_gpu), then plain P/D; stops both                                   ~9.5 min
#   bash gpu/session.sh G4   setup, 8b pair (the plugin on P too: shared_gpu auto finds the one GPU),
#                            8, 16, 32 conversations: adaptive, plain, colocated, in rounds (A B C A B C)
#                            until the time is up                                                       ~9.5 min
#   bash gpu/session.sh G5   the same engines: rounds of adaptive, plain, colocated, vllm-multiturn;
#                            stops both                                                                 ~9.5 min
#   bash gpu/session.sh G6   setup, 8b pair with D taking at most 2,048 tokens a step (prefills in
#                            chunks); 16, 32 conversations: plain, adaptive-first, colocated, adaptive, in
#                            rounds; stops both                                                         ~9.5 min
#   bash gpu/session.sh R1   setup, 8b pair (--max-model-len 40960, CUDA IPC GET, P cache off); TTFT of
#                            pull turns 2-5 at 2k, 16k, 32k: vllm-multiturn, always-pull, always-pull-beside
#                            in rounds (A B C A B C), 5 reps; engines kept up for R2                  ~9.5 min
#   bash gpu/session.sh R2   the same engines, 5 more rounds (seed 12); stops both                    ~9.5 min
#   bash gpu/session.sh W1   setup, 8b pair, 64 conversations x 3 turns x 2 waves, no session id: turnkv at its
#                            defaults, then plain P/D (the same gateway, conversation_from_history false)  ~8 min
#   bash gpu/session.sh W2   the same engines, 32 conversations x 5 turns x 2 waves; stops both         ~8 min
#   bash gpu/session.sh W3   single-turn vllm bench serve (random 8k in, 256 out, --ignore-eos, goodput
#                            ttft:2000 tpot:30), prefix caching off on both engines, through turnkv and
#                            plain P/D at 1-4 req/s (gpu/bench_serve.py; skipped without vllm); stops both  ~8 min
# (R1, R2: TURNKV_TTFT_ARGS adds flags to ttft.py's command line, e.g. smaller sizes on the simulator)
# (L1-L3, G1-G2: gpu/load.py; TURNKV_LOAD_ARGS adds flags to its command line, e.g. smaller sizes on the simulator)
# Every step has its own time limit so a part ends well inside 10 minutes and the
# results (and engine logs) are always packed into $OUT. Engines started here outlive the part
# (process sessions of their own) until a later part stops them or the machine goes back.
set -uo pipefail
cd "$(dirname "$0")/.."
part="${1:?part: A, B1, B2, C, C2, D1, D2, D3, L1, L2, L3, L4, G1-G6, R1, R2, P1, W1-W3, X1, X2}"
: "${OUT:=$PWD/results/gpu}"  # the repository's results/ (git ignores it), unless the caller names one
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - t0) )); }  # seconds until $1 seconds after the part's start
step() {  # name seconds command...: run with a time limit, log, and go on whatever happens
  local name=$1 secs=$2; shift 2
  [ "$secs" -gt 20 ] || { echo "== $name: skipped, no time left"; return 1; }
  echo "== $name (limit ${secs}s) $(date +%T)"
  timeout -k 10 "$secs" "$@"; local rc=$?
  echo "== $name: exit $rc, $(( $(date +%s) - t0 ))s into the part"
  return $rc
}
home="${TURNKV_GPU_HOME:-$([ "$(id -u)" = 0 ] && echo /root || echo "$HOME/.turnkv-gpu")}"
state="${TURNKV_GPU_STATE:-$home/gpu-state}"  # as gpu/devlib.py
pack() {  # engine logs and the gateways' configs, small enough to come back
  tar -czf "$OUT/logs_$part.tgz" -C "$state" logs $(cd "$state" && ls *.yaml 2>/dev/null) 2>/dev/null
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
}
{
case "$part" in
  A)
    if [ -z "${TURNKV_SKIP_SETUP:-}" ]; then step setup 180 bash gpu/setup.sh || { pack; exit 1; }; fi
    step fixtures "$(left 400)" python3 gpu/record_fixtures.py --group main
    step correctness "$(left 520)" python3 gpu/correctness.py
    step pull_failures "$(left 555)" python3 gpu/record_fixtures.py --group pull_failures --no-start
    python3 gpu/engines.py down
    ;;
  B1)
    step ttft_cache_on "$(left 560)" python3 gpu/ttft.py --label cache_on --p-cache on --time-budget-s 420
    ;;
  B2)
    step ttft_cache_off "$(left 560)" python3 gpu/ttft.py --label cache_off --p-cache off --time-budget-s 420
    python3 gpu/engines.py down
    ;;
  C)
    python3 gpu/engines.py down
    step link "$(left 560)" python3 gpu/link_rate.py --variants baseline,get_zcopy,get_zcopy_sm,cross_layers \
      --time-budget-s 420
    ;;
  X1|X2)  # turnkv doctor alone against the 8b pair, restarted with the variant's UCX settings
    if [ "$part" = X1 ] && [ -z "${TURNKV_SKIP_SETUP:-}" ]; then step setup 200 bash gpu/setup.sh || { pack; exit 1; }; fi
    variant=$([ "$part" = X1 ] && echo tcp || echo ipc)
    step "doctor_$variant" "$(left 575)" python3 gpu/doctor_pair.py --variants "$variant" --keep-running
    ;;
  C2)
    step link2 "$(left 560)" python3 gpu/link_rate.py --variants get_zcopy_no_emul,tcp_segments,block64,threads16 \
      --time-budget-s 420
    ;;
  D1)
    step setup 200 bash gpu/setup.sh || { pack; exit 1; }
    step ttft_ipc_off "$(left 570)" python3 gpu/ttft.py --label ipc_cache_off --p-cache off --histories 16384 \
      --modes never-pull,always-pull,adaptive-pull,adaptive,decode-local,plain,colocated \
      --ucx UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y --time-budget-s "$(left 480)"
    ;;
  D2)
    step ttft_ipc_off4k "$(left 300)" python3 gpu/ttft.py --label ipc_cache_off_4k --p-cache off --histories 4096 \
      --modes never-pull,always-pull,adaptive-pull,adaptive,decode-local,plain \
      --ucx UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y --time-budget-s 230
    step ttft_ipc_on "$(left 570)" python3 gpu/ttft.py --label ipc_cache_on --p-cache on --histories 16384 \
      --modes never-pull,always-pull,adaptive-pull,adaptive \
      --ucx UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y --time-budget-s "$(left 480)"
    python3 gpu/engines.py down
    ;;
  D3)  # setup (a fresh host), correctness with CUDA IPC GET on, then 16k TTFT with P's cache on
    step setup 200 bash gpu/setup.sh || { pack; exit 1; }
    export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
    step correctness_ipc "$(left 330)" python3 gpu/correctness.py --parts weights,planted,turnkv
    python3 gpu/engines.py down
    step ttft_ipc_on "$(left 575)" python3 gpu/ttft.py --label ipc_cache_on --p-cache on --histories 16384 \
      --modes never-pull,always-pull,adaptive-pull,adaptive --time-budget-s "$(left 500)"
    python3 gpu/engines.py down
    ;;
  P1)  # (fresh host) setup, then P alone: what return_token_ids and a salt of its own cost P's request
    if [ -z "${TURNKV_SKIP_SETUP:-}" ]; then step setup 200 bash gpu/setup.sh || { pack; exit 1; }; fi
    step p_ids "$(left 560)" python3 gpu/p_ids.py --ucx UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y \
      --time-budget-s "$(left 480)" ${TURNKV_P_IDS_ARGS:-}
    python3 gpu/engines.py down
    ;;
  R1|R2)  # render ahead: pull turns' TTFT against vLLM's multi-turn proxy, the check on P's ids or beside it
    ttft=(python3 gpu/ttft.py --p-cache off --histories 2048,16384,32768
          --modes vllm-multiturn,always-pull,always-pull-beside --turns 5 --user-tokens 200 --answer-tokens 64
          --reps 5 --order rounds --max-model-len 40960 --ucx UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y)
    case "$part" in
      R1) if [ -z "${TURNKV_SKIP_SETUP:-}" ]; then step setup 200 bash gpu/setup.sh || { pack; exit 1; }; fi
          ttft+=(--label ra_cache_off) ;;
      R2) ttft+=(--label ra_cache_off_2 --seed 12) ;;
    esac
    # the same engine flags in both parts: R2 reuses R1's engines (devlib compares the command lines)
    step "ttft_$part" "$(left 575)" "${ttft[@]}" --time-budget-s "$(left 500)" ${TURNKV_TTFT_ARGS:-}
    [ "$part" = R2 ] && python3 gpu/engines.py down
    ;;
  L4)  # (fresh host) setup, then 64 conversations again: adaptive first, then plain P/D, same engines
    step setup 200 bash gpu/setup.sh || { pack; exit 1; }
    step load_L4 "$(left 575)" python3 gpu/load.py --ucx UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y --label L4_64_cache_on \
      --conversations 64 --turns 3 --p-cache on --modes adaptive,plain --time-budget-s "$(left 525)" ${TURNKV_LOAD_ARGS:-}
    python3 gpu/engines.py down
    ;;
  L1|L2|L3)  # decode memory under load (gpu/load.py); both engines with CUDA IPC GET on, kept up from L1 to L3
    load=(python3 gpu/load.py --ucx UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y)
    case "$part" in
      L1) if [ -z "${TURNKV_SKIP_SETUP:-}" ]; then step setup 200 bash gpu/setup.sh || { pack; exit 1; }; fi
          load+=(--label L1_32_cache_on --conversations 32 --turns 4 --p-cache on) ;;
      L2) load+=(--label L2_64_cache_on --conversations 64 --turns 3 --p-cache on) ;;
      L3) load+=(--label L3_32_cache_off --conversations 32 --turns 4 --p-cache off) ;;
    esac
    # 5 turns do not fit one 10-minute step (gpu/README.md); the last mode runs only
    # where load.py's estimate says it fits (colocated does not involve P: L3 repeats L1's, or stands in)
    load+=(--modes plain,adaptive,adaptive-pull,colocated)
    # nothing in load.py runs past its budget but stopping a gateway (<= 40 s) and writing its JSON
    step "load_$part" "$(left 575)" "${load[@]}" --time-budget-s "$(left 525)" ${TURNKV_LOAD_ARGS:-}
    [ "$part" = L3 ] && python3 gpu/engines.py down
    ;;
  W1|W2)  # agents without a session id, as the write-back issue's table ran them: turnkv's defaults against plain
    load=(python3 gpu/load.py --ucx UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y --p-cache on --modes turnkv,plain)
    case "$part" in
      W1) if [ -z "${TURNKV_SKIP_SETUP:-}" ]; then step setup 200 bash gpu/setup.sh || { pack; exit 1; }; fi
          load+=(--label W1_64 --conversations 64 --turns 3) ;;
      W2) load+=(--label W2_32 --conversations 32 --turns 5) ;;
    esac
    step "load_$part" "$(left 575)" "${load[@]}" --time-budget-s "$(left 525)" ${TURNKV_LOAD_ARGS:-}
    [ "$part" = W2 ] && python3 gpu/engines.py down
    ;;
  W3)  # single-turn goodput with vLLM's own client, prefix caching off on every engine (the seed's command)
    python3 gpu/engines.py down  # the load parts' engines have prefix caching on
    step bench_serve "$(left 575)" python3 gpu/bench_serve.py --ucx UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y \
      --time-budget-s "$(left 500)" ${TURNKV_BENCH_SERVE_ARGS:-}
    python3 gpu/engines.py down
    ;;
  G4|G5|G6)  # goodput: shared_gpu found by the gateway (auto), and rounds of modes for this GPU's noise
    load=(python3 gpu/load.py --ucx UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y --p-cache on --turns 3 --waves 1)
    case "$part" in
      G4) if [ -z "${TURNKV_SKIP_SETUP:-}" ]; then step setup 200 bash gpu/setup.sh || { pack; exit 1; }; fi
          load+=(--label G4_8-32 --conversations 8,16,32 --modes adaptive,plain,colocated --rounds 3) ;;
      G5) load+=(--label G5_8-32 --conversations 8,16,32 --modes adaptive,plain,colocated,vllm-multiturn --rounds 2) ;;
      G6) if [ -z "${TURNKV_SKIP_SETUP:-}" ]; then step setup 200 bash gpu/setup.sh || { pack; exit 1; }; fi
          load+=(--label G6_chunked_D --conversations 16,32 --d-chunk 2048
                 --modes plain,adaptive-first,colocated,adaptive --rounds 2) ;;
    esac
    step "goodput_$part" "$(left 575)" "${load[@]}" --time-budget-s "$(left 525)" ${TURNKV_LOAD_ARGS:-}
    [ "$part" = G4 ] || python3 gpu/engines.py down
    ;;
  G1|G2|G3)  # goodput on the GPU: a sweep of conversations at once, one wave per count and mode
    # the modes run in order; one that load.py estimates will not fit the part's budget is skipped
    load=(python3 gpu/load.py --ucx UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y --p-cache on --turns 3 --waves 1)
    case "$part" in
      G1) if [ -z "${TURNKV_SKIP_SETUP:-}" ]; then step setup 200 bash gpu/setup.sh || { pack; exit 1; }; fi
          load+=(--label G1_8-32 --conversations 8,16,32 --modes plain,vllm-multiturn,adaptive,colocated,adaptive-pull) ;;
      G3) if [ -z "${TURNKV_SKIP_SETUP:-}" ]; then step setup 200 bash gpu/setup.sh || { pack; exit 1; }; fi
          load+=(--label G3_8-64 --conversations 8,16,32,64 --modes adaptive-shared,plain) ;;
      G2) load+=(--label G2_64 --conversations 64
                 --modes plain,vllm-multiturn,adaptive,colocated,adaptive-first,adaptive-pull) ;;
    esac
    step "goodput_$part" "$(left 575)" "${load[@]}" --time-budget-s "$(left 525)" ${TURNKV_LOAD_ARGS:-}
    [ "$part" = G1 ] || python3 gpu/engines.py down
    ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
pack
echo "== part $part done in $(( $(date +%s) - t0 ))s"
} 2>&1 | tee "$OUT/session_$part.log"
