# Sourced (from the repository root) by the GPU benchmark scripts: the NCCL settings of the lent machines
# (no NVLink multicast), and the service's Python packages from the carried wheelhouse `.whl/`
# (../shared/gpu/wheelhouse.sh) where the GPU image lacks them, with PYTHONPATH on this checkout.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=0
if ! python3 -c "import optuna, sqlalchemy, ray, prometheus_client" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}

# NAME (the device's name) and GPU (the catalog entry that prices it)
gpu_type() {
  NAME=$(python3 -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')")
  case "$NAME" in *H200*) GPU=h200 ;; *) GPU=h100-sxm ;; esac
}

# pack_results RES OUT: RES packed into OUT/results.tgz every 30 s and when the script exits (a device call
# returns at most 8 files, and one cut off by its time limit keeps what was packed)
pack_results() {
  PACK_RES=$1 PACK_OUT=$2
  pack() { local tmp="$PACK_OUT/.results.$BASHPID.tgz"; tar czf "$tmp" -C "$PACK_RES" . 2>/dev/null && mv -f "$tmp" "$PACK_OUT/results.tgz"; }
  ( while sleep 30; do pack; done ) & PACKER=$!
  trap 'kill $PACKER 2>/dev/null; pack' EXIT
}

# phases LIST: the phases a script runs (its PHASES, else LIST); has PHASE: whether PHASE is one of them
phases() { PHASES=" ${PHASES:-$1} "; }
has() { case "$PHASES" in *" $1 "*) return 0 ;; esac; return 1; }
