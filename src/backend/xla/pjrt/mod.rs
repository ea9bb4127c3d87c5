//! The PJRT C API: loading a plugin, compiling StableHLO, moving buffers, running executables.
//!
//! This module is the only place in kiln with `unsafe` code. Its private `sys` module holds hand-written
//! `#[repr(C)]` bindings for the parts of `pjrt_c_api.h` that kiln uses (layouts checked at
//! compile time against the 0.81 header); the rest are safe wrappers:
//!
//! - [`Api`]: a plugin loaded with `dlopen` + `GetPjrtApi`, version-checked and initialized
//!   once per process;
//! - [`Client`]: a runtime instance owning devices; compiles programs and uploads buffers;
//! - [`Buffer`]: an array on a device;
//! - [`LoadedExecutable`]: a compiled program; [`LoadedExecutable::execute`] runs it.
//!
//! Every PJRT call's `PJRT_Error*` becomes [`Error::Pjrt`](crate::error::Error::Pjrt) with the
//! call's name, the plugin's status code name and its message. Every PJRT object is freed in
//! `Drop`; buffers and executables keep their client (and so the plugin) alive.
//!
//! Compatibility: kiln binds the C API by `struct_size`. It needs major version 0 and every
//! function it calls present in the plugin's table, which holds for PJRT C API 0.81 and newer
//! (checked with 0.81 and 0.115); an older or foreign plugin is an
//! [`Error::Plugin`](crate::error::Error::Plugin), never a panic. The functions of the direct
//! host read of [`Buffer::to_host`] (external references, the device memory pointer, the
//! memory layout) are optional: without them reads go through `PJRT_Buffer_ToHostBuffer`.
//!
//! ```no_run
//! # use std::path::Path;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # use kiln::backend::xla::pjrt::{compile_options_bytes, Api, Client, ElementType};
//! let api = Api::load(Path::new(".deps/pjrt_cpu_plugin.so"))?;
//! let client = Client::new(&api)?;
//! let exe = client.compile(
//!     "func.func public @main(%a: tensor<2xf32>) -> tensor<2xf32> {
//!        %0 = stablehlo.add %a, %a : tensor<2xf32>
//!        return %0 : tensor<2xf32>
//!      }",
//!     &compile_options_bytes(),
//! )?;
//! let x: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|v| v.to_ne_bytes()).collect();
//! let a = client.buffer_from_host(&x, ElementType::F32, &[2], 0)?;
//! let out = exe.execute(&[&a])?;
//! let mut y = [0u8; 8];
//! out[0].to_host(&mut y)?;
//! # Ok(())
//! # }
//! ```

#![allow(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod api;
mod buffer;
mod client;
mod executable;
mod sys;

#[cfg(test)]
mod tests;

pub use api::Api;
pub use buffer::{Buffer, ElementType};
pub use client::Client;
pub use executable::LoadedExecutable;

/// Serialized `CompileOptionsProto` for a single-device compile, the options kiln passes to
/// [`Client::compile`].
///
/// Hand-encoded protobuf, decoded:
///
/// ```text
/// 1a 04        field 3 (executable_build_options), length-delimited, 4 bytes:
///   20 01        field 4 (num_replicas)   = 1  (varint)
///   28 01        field 5 (num_partitions) = 1  (varint)
/// ```
pub fn compile_options_bytes() -> Vec<u8> {
    vec![0x1a, 0x04, 0x20, 0x01, 0x28, 0x01]
}
