#!/usr/bin/env bash
# Vendor upstream FasterDecoding Medusa (PyPI medusa-llm, pinned and hash-checked) into third_party/Medusa
# and apply our patches from patches/, in order. third_party/Medusa is git-ignored and never committed.
#
#   bash apply_patches.sh            vendor (if needed) and apply every patch; idempotent
#   bash apply_patches.sh --check    report which patches are applied; non-zero unless all are
#   bash apply_patches.sh --revert   restore the pristine upstream copy
#
# Offline: MEDUSA_WHEEL=/path/to/medusa_llm-0.1-py3-none-any.whl bash apply_patches.sh
set -euo pipefail

ROOT=$(cd "$(dirname "$0")" && pwd)
VERSION=0.1
WHEEL=medusa_llm-${VERSION}-py3-none-any.whl
SHA256=e4a0f04dcc1cac018a103d32891dccf7055c92147e87ae051f92c34030da1ab3
DEST=$ROOT/third_party/Medusa
CACHE=$ROOT/third_party/.cache
APPLIED=$DEST/.applied-patches
PATCHES=("$ROOT"/patches/[0-9][0-9][0-9][0-9]-*.patch)
PYTHON=${PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}

die() { echo "apply_patches: error: $*" >&2; exit 1; }
command -v patch >/dev/null || die "the 'patch' program is missing (apt-get install patch)"

wheel_path() {
    local wheel=${MEDUSA_WHEEL:-$CACHE/$WHEEL}
    if [ ! -f "$wheel" ]; then
        [ -z "${MEDUSA_WHEEL:-}" ] || die "MEDUSA_WHEEL=$MEDUSA_WHEEL does not exist"
        mkdir -p "$CACHE"
        echo "Downloading medusa-llm==$VERSION from PyPI ..." >&2
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$CACHE" "medusa-llm==$VERSION" \
            || die "could not download medusa-llm==$VERSION; offline, set MEDUSA_WHEEL to a local copy of $WHEEL"
    fi
    local actual
    actual=$(sha256sum "$wheel" | cut -d' ' -f1)
    [ "$actual" = "$SHA256" ] || die "$wheel has sha256 $actual, expected $SHA256 (pinned medusa-llm==$VERSION)"
    echo "$wheel"
}

vendor() {
    local wheel
    wheel=$(wheel_path)
    rm -rf "$DEST"
    mkdir -p "$DEST"
    "$PYTHON" -m zipfile -e "$wheel" "$DEST"
    echo "Vendored pristine medusa-llm==$VERSION into third_party/Medusa" >&2
}

record() { echo "$(sha256sum "$1" | cut -d' ' -f1)  $(basename "$1")"; }

state() {  # applied (recorded with this exact content) | pending (applies cleanly) | conflict
    if grep -qxF "$(record "$1")" "$APPLIED" 2>/dev/null; then echo applied
    elif patch -p1 -F0 -s -f --dry-run -d "$DEST" <"$1" >/dev/null 2>&1; then echo pending
    else echo conflict; fi
}

verify() {
    (cd "$DEST" && sha256sum --quiet -c "$ROOT/patches/SHA256SUMS") \
        || die "third_party/Medusa does not match patches/SHA256SUMS: run 'bash apply_patches.sh --revert' then 'bash apply_patches.sh'"
}

case "${1:-}" in
--revert)
    vendor
    exit 0
    ;;
--check)
    [ -d "$DEST/medusa" ] || { echo "third_party/Medusa is not vendored: run bash apply_patches.sh"; exit 1; }
    missing=0
    for p in "${PATCHES[@]}"; do
        s=$(state "$p")
        printf '%-10s %s\n' "$s" "$(basename "$p")"
        [ "$s" = applied ] || missing=1
    done
    [ $missing = 0 ] || exit 1
    verify
    echo "all ${#PATCHES[@]} patches applied; files match patches/SHA256SUMS"
    exit 0
    ;;
"") ;;
*) die "unknown option $1 (use --check or --revert)" ;;
esac

[ -d "$DEST/medusa" ] || vendor
applied=0
for p in "${PATCHES[@]}"; do
    case $(state "$p") in
    applied) echo "already applied: $(basename "$p")" ;;
    pending)
        patch -p1 -F0 -s -f --no-backup-if-mismatch -d "$DEST" <"$p" || die "$(basename "$p") failed to apply"
        record "$p" >>"$APPLIED"
        echo "applied: $(basename "$p")"
        applied=$((applied + 1))
        ;;
    *)
        echo "apply_patches: error: $(basename "$p") does not apply to third_party/Medusa" \
            "(if it changed since it was applied: bash apply_patches.sh --revert, then rerun):" >&2
        patch -p1 -F0 -f --dry-run -d "$DEST" <"$p" >&2 || true
        exit 1
        ;;
    esac
done
verify
if [ $applied = 0 ]; then echo "Everything is already applied; nothing changed."; else echo "Applied $applied patch(es)."; fi
