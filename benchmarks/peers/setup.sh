#!/usr/bin/env bash
# Builds one virtualenv per peer of bench_peers.py, with the versions it was measured with:
#   bash benchmarks/peers/setup.sh [PEER...]     # default: torch fedjax pfl flower
# PEERS_DIR (default /tmp/peers) holds them; PYTHON (default python3, 3.11 here) makes them.
# TORCH_PIP_ARGS is passed to the installs that bring torch: on a machine without a local
# CPU wheel, "--extra-index-url https://download.pytorch.org/whl/cpu" avoids PyPI's CUDA build.
set -euo pipefail

PEERS_DIR=${PEERS_DIR:-/tmp/peers}
PYTHON=${PYTHON:-python3}
TORCH_PIP_ARGS=${TORCH_PIP_ARGS:-}
TORCH="torch==2.13.0"

# FedJAX 0.0.17 (its last release) calls jax.tree_map, removed in jax 0.6: it needs the
# jax 0.4 line, with the haiku, optax and chex of that time.
declare -A REQUIREMENTS=(
  [torch]="$TORCH numpy==2.4.6"
  [fedjax]="fedjax==0.0.17 jax==0.4.30 jaxlib==0.4.30 dm-haiku==0.0.12 optax==0.2.3 chex==0.1.86 numpy==1.26.4 scipy==1.13.1"
  [pfl]="pfl[pytorch]==0.6.0 $TORCH numpy==2.4.6 scipy==1.17.1"
  [flower]="flwr[simulation]==1.42.0 ray==2.55.1 $TORCH numpy==2.4.6"
)
# The peers whose installs bring torch.
declare -A WITH_TORCH=([torch]=1 [pfl]=1 [flower]=1)

peers=("$@")
if [ ${#peers[@]} -eq 0 ]; then
  peers=(torch fedjax pfl flower)
fi
for peer in "${peers[@]}"; do
  if [ -z "${REQUIREMENTS[$peer]+x}" ]; then
    echo "unknown peer '$peer'; use some of: torch fedjax pfl flower" >&2
    exit 2
  fi
done

mkdir -p "$PEERS_DIR"
for peer in "${peers[@]}"; do
  echo "== $peer: $PEERS_DIR/$peer"
  "$PYTHON" -m venv "$PEERS_DIR/$peer"
  extra=""
  if [ -n "${WITH_TORCH[$peer]+x}" ]; then
    extra=$TORCH_PIP_ARGS
  fi
  # shellcheck disable=SC2086  # the requirement lists are meant to split
  "$PEERS_DIR/$peer/bin/python" -m pip install --quiet $extra ${REQUIREMENTS[$peer]}
  "$PEERS_DIR/$peer/bin/python" -m pip freeze > "$PEERS_DIR/$peer.freeze.txt"
done
echo "done; run: .venv/bin/python benchmarks/bench_peers.py" \
  "$(for p in "${peers[@]}"; do printf -- '--%s-python %s ' "$p" "$PEERS_DIR/$p/bin/python"; done)"
