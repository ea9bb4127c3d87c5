# The two commands of the README. Both install what they need on a fresh machine
# (scripts/bootstrap.sh: libtorch and the PJRT CPU plugin from PyPI into a user cache).
# Everything builds in release mode: one build of the libtorch bindings serves tests,
# examples and benchmarks.

.PHONY: bench test bootstrap

bootstrap:
	@bash scripts/bootstrap.sh

# The main job: the benchmark harness (the workspace's kiln-bench crate) on the zoo's default
# subset, inference then training (torchbench.py's tables; CSV copies under target/). `--all` runs
# the whole zoo; see `cargo run --release -p kiln-bench -- --help`.
bench: bootstrap
	cargo run --release -p kiln-bench -- --csv target/bench-inference.csv
	cargo run --release -p kiln-bench -- --training --csv target/bench-training.csv

# The test suite: kiln and the harness.
test: bootstrap
	cargo test --release --workspace
