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
