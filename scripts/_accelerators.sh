# Sourced by scripts/test.sh after _venv.sh; defines
#   jaxpar_accelerators VENV   install into VENV/accel the compilers for the platforms this
#                              machine lacks, of VENV's jax release, for the tests that compile
#                              for TPU and lower for CUDA (tests/test_accelerator_compile.py).
# They go outside the venv's packages, so nothing else imports them:
#   VENV/accel/tpu   libtpu of jax's own release, loaded through TPU_LIBRARY_PATH by
#                    jaxpar.inspect.tpu_devices. Installed as a package instead, every CPU-only
#                    `import jax` (demo.sh included) tries to start a TPU and prints the failure.
#   VENV/accel/cuda  the CUDA PJRT plugin and cuDNN (lowering cuDNN attention reads its
#                    version); only the CUDA-lowering subprocess has it on its path.
# Re-installed when the venv's jax changes.
jaxpar_accelerators() {
  local venv="$1" jax_version libtpu
  jax_version="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("jax"))')"
  local accel="$venv/accel"
  if [ -f "$accel/.jax-$jax_version" ]; then
    return
  fi
  rm -rf "$accel"
  # jax's own pin of libtpu for its "tpu" extra, e.g. 'libtpu==0.0.42.*; extra == "tpu"'.
  libtpu="$("$venv/bin/python" -c '
import importlib.metadata as m
print(next(r.split(";")[0].strip() for r in m.requires("jax") if r.startswith("libtpu")))')"
  "$venv/bin/python" -m pip install --quiet --no-deps --target "$accel/tpu" "$libtpu"
  "$venv/bin/python" -m pip install --quiet --no-deps --target "$accel/cuda" \
    "jax-cuda12-plugin==$jax_version" "jax-cuda12-pjrt==$jax_version" "nvidia-cudnn-cu12>=9.8,<10"
  touch "$accel/.jax-$jax_version"
}
