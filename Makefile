# The two commands of the README. Both install what they need on a fresh machine
# (scripts/bootstrap.sh: libtorch and the PJRT CPU plugin from PyPI into a user cache).
# Everything builds in release mode: one build of the libtorch bindings serves tests,
# examples and benchmarks.

.PHONY: bench test bootstrap

bootstrap:
	@bash scripts/bootstrap.sh

# The main job.
bench: bootstrap
	cargo run --release --example linear

# The test suite.
test: bootstrap
	cargo test --release
