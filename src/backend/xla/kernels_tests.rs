//! Tests of the libtorch FFI kernels against XLA's own lowering and a float64 libtorch
//! reference.

use super::*;
use crate::backend::xla::{XlaBackend, XlaOptions};
use std::sync::OnceLock;

fn backend() -> &'static XlaBackend {
    static B: OnceLock<XlaBackend> = OnceLock::new();
    B.get_or_init(|| XlaBackend::new().expect("XLA backend"))
}

#[test]
fn self_test_passes_on_the_cpu_plugin() {
    let b = backend();
    assert_eq!(b.ffi_status(), Ok(()));
    assert_eq!(
        b.with_options(XlaOptions::default().ffi(FfiMode::All))
            .effective_ffi(),
        FfiMode::All
    );
}
