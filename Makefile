# The two commands of the README. Both install what they need on a fresh machine
# (scripts/bootstrap.sh: libtorch and the PJRT CPU plugin from PyPI into a user cache).
# Everything builds in release mode: one build of the libtorch bindings serves tests,
# examples and benchmarks.

.PHONY: bench test bootstrap

bootstrap:
	@bash scripts/bootstrap.sh

# The main job: the benchmark harness on the zoo's default subset, inference then training
# (the seeds' tables; CSV copies under target/). `--all` runs the whole zoo; see
# `cargo run --release --example bench -- --help`.
bench: bootstrap
	cargo run --release --example bench -- --csv target/bench-inference.csv
	cargo run --release --example bench -- --training --csv target/bench-training.csv

# The test suite.
test: bootstrap
	cargo test --release
