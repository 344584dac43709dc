#!/usr/bin/env bash
# `make demo`: start a gpuport server on 127.0.0.1 with a throwaway state dir, log in to it as a
# user would (pinning its certificate), look at its GPUs and status, make a token for a teammate,
# then the main job: train a Keras model remotely with live logs, bring the model back and score
# it here; serve it over KServe v2 and ask it for predictions; then a session keeping data and a
# model on the server; then a quota making a job wait in the queue. Nothing outside a temporary folder is touched.
# GPUPORT_FAKE_GPUS=2x16GiB make demo   shows what it looks like on a machine with GPUs.
set -euo pipefail

work=$(mktemp -d -t gpuport-demo.XXXXXX)
export GPUPORT_CONFIG_DIR="$work/config"      # the demo's login must not replace yours
server_pid=""
cleanup() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" && wait "$server_pid" || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; }

step "gpuport server --host 127.0.0.1 --port 0 --http-port 0 --state-dir $work/state &"
PYTHONUNBUFFERED=1 gpuport server --host 127.0.0.1 --port 0 --http-port 0 --state-dir "$work/state" \
  >"$work/server.out" 2>"$work/server.err" &
server_pid=$!
for _ in $(seq 600); do
  grep -qx ready "$work/server.out" 2>/dev/null && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.out" "$work/server.err"; exit 1; }
  sleep 0.1
done
grep -qx ready "$work/server.out" || { echo "the server did not start in 60s"; cat "$work/server.err"; exit 1; }
cat "$work/server.out"

url=$(awk '$1 == "gRPC" {print $2}' "$work/server.out")
fingerprint=$(awk '$1 == "fingerprint" {print $2}' "$work/server.out")
token=$(awk '$1 == "admin" && $2 == "token" {print $3}' "$work/server.out")

step "gpuport login $url --token gp_... --fingerprint ${fingerprint:0:20}..."
gpuport login "$url" --token "$token" --fingerprint "$fingerprint"

step "gpuport gpus"
gpuport gpus

step "gpuport status"
gpuport status

step "gpuport token create alice       # a token for a teammate"
# A server that cannot isolate jobs (no bubblewrap) makes admin tokens only: then alice's part is skipped.
if alice=$(gpuport token create alice 2>"$work/token.err"); then
  echo "${alice:0:12}... (shown once)"

  step "GPUPORT_TOKEN=<alice's> gpuport status --json   # alice sees the server, as a user"
  GPUPORT_TOKEN="$alice" gpuport status --json | python3 -c 'import json,sys; s=json.load(sys.stdin); print({k: s[k] for k in ("user","admin","hostname","inventory")})'

  step "GPUPORT_TOKEN=<alice's> gpuport token list      # but may not manage tokens"
  GPUPORT_TOKEN="$alice" gpuport token list 2>&1 || true
else
  cat "$work/token.err"
  alice=""
fi

step "cd examples/keras_digits && gpuport run --output model/ -- python train.py --epochs 15"
(cd "$(dirname "$0")/keras_digits" &&
  gpuport run --output model/ --output-dir "$work/outputs" -- python train.py --epochs 15)

step "python evaluate.py gpuport-outputs/<job>/model/digits.keras   # the trained model, back here"
(cd "$(dirname "$0")/keras_digits" && python evaluate.py "$work/outputs/model/digits.keras" 2>/dev/null)

step "gpuport deploy digits gpuport-outputs/<job>/model/digits.keras   # served over KServe v2 and TF Serving"
gpuport deploy digits "$work/outputs/model/digits.keras" --max-batch-size 64
http=$(awk '$1 == "HTTP" {print $2}' "$work/server.out")

step "python examples/serving/predict.py $http \$TOKEN cert.pem   # a KServe v2 REST request"
(cd "$(dirname "$0")/serving" && python predict.py "$http" "$token" "$work/state/tls/cert.pem" 2>&1 | grep -v -e "^WARNING" -e "^I0000" -e "cpu_feature_guard" -e "rebuild TensorFlow" -e "^To enable")

step "gpuport models"
gpuport models

step "gpuport undeploy digits"
gpuport undeploy digits

step "python examples/sessions/keras_session.py   # a session: data put once, the model kept remote"
(cd "$(dirname "$0")/sessions" && python keras_session.py 2>/dev/null)

if [ -n "$alice" ]; then
  step "gpuport quota set alice --jobs 1; alice runs two jobs at once; gpuport queue"
  gpuport quota set alice --jobs 1
  mkdir -p "$work/empty"
  first=$(GPUPORT_TOKEN="$alice" gpuport run -d -w "$work/empty" -- sleep 2 2>/dev/null)
  second=$(GPUPORT_TOKEN="$alice" gpuport run -d -w "$work/empty" -- echo second 2>/dev/null)
  gpuport queue
  GPUPORT_TOKEN="$alice" gpuport wait "$second"
fi

step "gpuport jobs --all   # everyone's, for an admin"
gpuport jobs --all

step "kill -TERM <server>"
kill -TERM "$server_pid"
wait "$server_pid"
server_pid=""
tail -n 2 "$work/server.out"
