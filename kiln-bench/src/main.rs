//! The benchmark harness's command line: `cargo run --release -p kiln-bench -- --help`.

fn main() -> std::process::ExitCode {
    kiln_bench::cli::main()
}
