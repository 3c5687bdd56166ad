#!/usr/bin/env bash
# Builds the fuzz targets on the stable toolchain and replays the seed corpus
# through them: a fast CI check that the targets still compile against the
# current wire code and that no seed trips an assertion. This does not fuzz
# (no coverage instrumentation on stable); README.md says how to fuzz.
set -euo pipefail
cd "$(dirname "$0")"

# Resolve the same dependency versions as the workspace; cargo adds only the
# fuzz-only crates (libfuzzer-sys and its build dependencies).
cp ../Cargo.lock Cargo.lock

# The binaries are run from ./target below, whatever CARGO_TARGET_DIR says.
CARGO_TARGET_DIR=target cargo build --bins --quiet

for target in fuzz_targets/*.rs; do
    name=$(basename "$target" .rs)
    seeds=(seeds/"$name"/*)
    # Given files (not a directory), a libFuzzer binary runs each input once
    # and exits non-zero on the first failure.
    ./target/debug/"$name" "${seeds[@]}" 2>/dev/null || {
        echo "fuzz target $name fails on its seeds; rerun: fuzz/target/debug/$name fuzz/seeds/$name/*" >&2
        exit 1
    }
    echo "fuzz target $name: built, ${#seeds[@]} seeds replayed"
done
