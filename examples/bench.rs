//! The benchmark harness: eager (libtorch) against compiled (trace once / trace every call) on
//! the model zoo or on a model in your own file, with the seeds' method and table.
//!
//! `cargo run --release --example bench -- --help`
//!
//! The logic lives in `kiln::bench` (so your own binary can call it: `kiln::bench::run_benchmark`
//! or `kiln::bench::cli::main_with(registry)` with backends of your own).

fn main() -> std::process::ExitCode {
    kiln::bench::cli::main()
}
