#!/usr/bin/env bash
# The Responses API with curl alone: four turns chained by previous_response_id, no conversation id.
# Prints turnkv's decision per turn from the response headers. Needs $TURNKV_URL (examples/run.py sets it).
set -euo pipefail
url="${TURNKV_URL:-http://127.0.0.1:8000}/v1/responses"
model="${TURNKV_MODEL:-sim-model}"
headers=$(mktemp)
trap 'rm -f "$headers"' EXIT
previous=""
calls=0
for task in "Plan two days in Lyon for me." "What about the evening of day one?" \
            "Is the museum open on Monday?" "Summarise the plan in three lines."; do
  echo "user: $task"
  prev_field=""
  if [ -n "$previous" ]; then prev_field="\"previous_response_id\": \"$previous\","; fi
  body="{\"model\": \"$model\", $prev_field \"instructions\": \"You are a travel planning agent. Keep answers short.\",
         \"input\": \"$task\", \"max_output_tokens\": 120}"
  answer=$(curl -sS --fail-with-body -D "$headers" -H "content-type: application/json" -H "authorization: Bearer ${OPENAI_API_KEY:-turnkv-example}" -d "$body" "$url")
  calls=$((calls + 1))
  decision=$(grep -i '^x-turnkv-\(outcome\|reason\|conversation\)' "$headers" | tr -d '\r' | sed 's/^x-turnkv-//I' | tr '\n' ' ')
  echo "  [turnkv] call $calls: $decision"
  previous=$(printf '%s' "$answer" | python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])')
  printf '%s' "$answer" | python3 -c 'import json, sys; r = json.load(sys.stdin); t = "".join(c["text"] for o in r["output"] if o["type"] == "message" for c in o["content"]); print("agent:", t[:80] + "...")'
done
echo "turnkv-example-calls: $calls"
