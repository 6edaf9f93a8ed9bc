#!/usr/bin/env bash
# Set up crossalign on a fresh machine: a virtual environment in .venv with the embedded CPU
# backends (MindSpore 2.10 CPU, torch 2.13.0 CPU, fla-core, megatron-core). With --dev, also the
# test tools, the OpenSSH server that the SSH runner's tests start on loopback, PostgreSQL for
# the tests and benchmark of a Prefect server on PostgreSQL, and headless Chromium for the test
# that opens a run's artifacts and report in a browser.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="local"
if [[ "${1:-}" == "--dev" ]]; then
    extras="local,dev"
    packages=()
    if ! command -v sshd >/dev/null 2>&1 && [[ ! -x /usr/sbin/sshd ]]; then
        packages+=(openssh-server openssh-client)
    fi
    if ! command -v pg_config >/dev/null 2>&1 && ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
        packages+=(postgresql)
    fi
    if ! command -v chromium >/dev/null 2>&1; then
        packages+=(chromium)
    fi
    if (( ${#packages[@]} )); then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null) \
            || echo "warning: could not install ${packages[*]}; the tests that need them will be skipped" >&2
    fi
fi

if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
fi
# torch==2.13.0 resolves to the CPU build that pip finds on this machine (see README).
.venv/bin/pip install -q --disable-pip-version-check -e ".[${extras}]"

if [[ "$extras" == *dev* ]]; then
    # The MindFormers releases whose own code the tests run (tests/helpers/mindformers_upstream.py): wheels only,
    # without their dependencies (MindFormers pins other MindSpore versions; the project's MindSpore runs them).
    wheels=.cache/mindformers-wheels
    mkdir -p "$wheels"
    for version in 1.9.0 2.0.0 2.1.0; do
        if [[ ! -f "$wheels/mindformers-$version-py3-none-any.whl" ]]; then
            .venv/bin/pip download -q --disable-pip-version-check --no-deps -d "$wheels" "mindformers==$version" \
                || echo "warning: could not download mindformers $version; the tests of its code will be skipped" >&2
        fi
    done
    # The fla-core releases whose own chunk_bwd_dqkwg guard and TileLang route the GPU environment check is held
    # against (tests/helpers/fla_wheels.py): wheels only, never installed.
    wheels=.cache/fla-wheels
    mkdir -p "$wheels"
    for version in 0.4.0 0.4.1 0.4.2 0.5.0 0.5.1 0.5.2 0.6.0; do
        if [[ ! -f "$wheels/fla_core-$version-py3-none-any.whl" ]]; then
            .venv/bin/pip download -q --disable-pip-version-check --no-deps -d "$wheels" "fla-core==$version" \
                || echo "warning: could not download fla-core $version; the tests of its code will be skipped" >&2
        fi
    done
    # megatron-core 0.17.0, the second version whose own dist_checkpointing loads and saves the torch_dist checkpoints
    # crossalign writes (tests/test_torch_dist.py runs it with this folder first on PYTHONPATH). PyPI's cp311 wheel
    # says Requires-Python >=3.12 but imports and runs on 3.11; its dependencies are the venv's own.
    core017=.cache/megatron-core-0.17.0
    if [[ ! -d "$core017/megatron" ]]; then
        .venv/bin/pip install -q --disable-pip-version-check --no-deps --ignore-requires-python --target "$core017" \
            "megatron-core==0.17.0" \
            || echo "warning: could not install megatron-core 0.17.0; the tests that run it will be skipped" >&2
    fi
fi
