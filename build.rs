//! Adds an rpath to libtorch's `lib/` folder for this package's own binaries (tests, examples,
//! benches), so they run without `LD_LIBRARY_PATH`. Crates depending on kiln set their own
//! library path (see the README).
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=KILN_DEFAULT_PJRT_PLUGIN");
    if let Some(dir) = std::env::var_os("LIBTORCH") {
        let lib = PathBuf::from(dir).join("lib");
        // Resolve the checkout's `.deps/libtorch` link so the rpath survives moving `.deps`.
        let lib = lib.canonicalize().unwrap_or(lib);
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    }
}
