#!/usr/bin/env bash
# Checks the value checksum's NEON kernel (crates/offload-core/src/tier/value_sum/aarch64.rs)
# on an x86_64 Debian machine, where `cargo test` never compiles it: cross-compiles
# scripts/value_sum_aarch64_harness.rs, which includes the module's own files by #[path],
# for aarch64 and runs it under qemu-aarch64. The harness checks the known answers and the
# NEON kernel against the portable one (every length to 5000 bytes, every alignment, split
# points, a few MiB) and exits non-zero on any mismatch; this script exits with its status.
#
# The toolchain comes from Debian, not rustup (which cannot fetch an aarch64 std here):
# Debian 12's rustc 1.63 with its arm64 std (libstd-rust-dev:arm64), its clippy-driver as
# the compiler (so the build also lints the aarch64-only code, which `cargo clippy` on
# x86_64 never sees, with the workspace's lints from Cargo.toml and -D warnings), gcc's
# aarch64 cross linker and qemu-user. Installs them with apt-get when missing (adds the
# arm64 dpkg architecture; needs root or sudo). Debian's rustc is called by its full path,
# so rustup's toolchain stays the one cargo uses.
#
#     scripts/check_value_sum_aarch64.sh
#
# On an aarch64 machine this script is not needed: `cargo test -p offload-core value_sum`
# runs the NEON kernel natively (the unit tests compare every kernel the CPU runs).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

if [[ "$(uname -m)" != "x86_64" || ! -f /etc/debian_version ]]; then
    echo "check_value_sum_aarch64.sh: needs an x86_64 Debian (or derived) machine;" \
        "on aarch64 run: cargo test -p offload-core value_sum" >&2
    exit 2
fi

as_root() {
    if [[ "$(id -u)" == 0 ]]; then
        "$@"
    elif command -v sudo > /dev/null; then
        sudo "$@"
    else
        echo "check_value_sum_aarch64.sh: must install packages, but is neither root nor has sudo: $*" >&2
        exit 2
    fi
}

PACKAGES=(qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross rustc rust-clippy libstd-rust-dev:arm64)
start=$SECONDS
missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2> /dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done
if ((${#missing[@]})); then
    echo "installing: ${missing[*]}"
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
        as_root dpkg --add-architecture arm64
    fi
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi
echo "packages ready in $((SECONDS - start)) s"

# The workspace's lints as rustc flags, lowest priority first (as cargo orders them);
# unknown_lints allowed, so a lint newer than rustc 1.63 is skipped, not an error.
mapfile -t LINTS < <(python3 - << 'EOF'
import tomllib

with open("Cargo.toml", "rb") as f:
    lints = tomllib.load(f)["workspace"]["lints"]
flags = []
for tool, table in lints.items():
    for name, value in table.items():
        level, priority = (value, 0) if isinstance(value, str) else (value["level"], value.get("priority", 0))
        lint = name if tool == "rust" else f"{tool}::{name}"
        flags.append((priority, {"allow": "-A", "warn": "-W", "deny": "-D", "forbid": "-F"}[level], lint))
for _, flag, lint in sorted(flags, key=lambda f: f[0]):
    print(flag)
    print(lint)
EOF
)

BUILD="$(mktemp -d "${TMPDIR:-/tmp}/kvoffload-value-sum-aarch64.XXXXXX")"
trap 'rm -rf "$BUILD"' EXIT
start=$SECONDS
# clippy-driver is rustc plus clippy's lints: one compile both lints and builds. Debug
# assertions and overflow checks on, so an unwrapped overflow in the shared code fails too.
/usr/bin/clippy-driver --sysroot /usr --edition 2021 --target aarch64-unknown-linux-gnu \
    -C linker=aarch64-linux-gnu-gcc -C opt-level=3 -C debug-assertions=on -C overflow-checks=on \
    "${LINTS[@]}" -A unknown_lints -D warnings \
    scripts/value_sum_aarch64_harness.rs -o "$BUILD/harness"
echo "harness built (rustc $(/usr/bin/rustc --version | cut -d' ' -f2), aarch64) in $((SECONDS - start)) s"

start=$SECONDS
status=0
qemu-aarch64 -L /usr/aarch64-linux-gnu "$BUILD/harness" || status=$?
echo "harness ran under qemu-aarch64 in $((SECONDS - start)) s, exit status $status"
exit "$status"
