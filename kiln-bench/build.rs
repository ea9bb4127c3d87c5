//! Adds an rpath to libtorch's `lib/` folder for this package's binaries (the CLI, tests), so
//! they run without `LD_LIBRARY_PATH`, as kiln's own build script does for kiln's.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Some(dir) = std::env::var_os("LIBTORCH") {
        let lib = PathBuf::from(dir).join("lib");
        // Resolve the checkout's `.deps/libtorch` link so the rpath survives moving `.deps`.
        let lib = lib.canonicalize().unwrap_or(lib);
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    }
}
