# The environment of an ad-hoc device command, sourced from the repository root (`python -m bench run` sets up its
# runs the same way itself): the wheels the GPU image lacks (liger-kernel, gguf; datasets, dill and multiprocess for
# recipes/train.py; diffusers; pytest-random-order), carried in .whl/, installed into /tmp/site, the source tree on
# PYTHONPATH, and the GPU named in the log. .whl/ is ignored by git: make it on the development machine with
#   pip download -q --no-deps --only-binary :all: --python-version 3.12 -d .whl liger-kernel==0.8.5 gguf datasets \
#       dill multiprocess diffusers importlib-metadata pytest-random-order==1.2.0
# (about 8 MB) and name it in the device call's carry list.
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # absolute: tests run the recipe from other folders
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
