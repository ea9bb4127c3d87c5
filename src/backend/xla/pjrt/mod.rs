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
//! - [`LoadedExecutable`]: a compiled program; [`LoadedExecutable::execute`] runs it;
//! - `ffi` (crate-internal): the PJRT FFI extension, through which kiln registers its own
//!   kernels (XLA FFI handlers) that executables call as `stablehlo.custom_call`s (see
//!   [`crate::backend::xla::kernels`]); its private `ffi_sys` module binds the XLA FFI C API.
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
pub(crate) mod ffi;
mod ffi_sys;
pub(crate) mod handoff;
mod sys;
pub(crate) mod throttle;

#[cfg(test)]
mod tests;

pub use api::Api;
pub use buffer::{live_buffers, Buffer, ElementType};
pub use client::{Client, NamedValue};
pub use executable::LoadedExecutable;
pub(crate) use executable::WeightInputs;

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

/// The value of one XLA debug option override (`OptionOverrideProto`).
#[derive(Clone, Debug, PartialEq)]
pub enum OptionValue {
    /// `string_field = 1`; the plugin parses it as the option's text form (also how enum and
    /// repeated-enum options such as `xla_cpu_experimental_xnn_fusion_type` are set).
    Str(String),
    /// `bool_field = 2`.
    Bool(bool),
    /// `int_field = 3`.
    Int(i64),
    /// `double_field = 4`.
    Double(f64),
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

fn len_delimited(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    varint(out, u64::from(field << 3 | 2));
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// Serialized `CompileOptionsProto` for a single-device compile with XLA `DebugOptions`
/// overrides, in the given order, as `env_option_overrides` (field 7,
/// `map<string, OptionOverrideProto>`). The plugin applies each override by the option's name
/// and rejects unknown names at compile time. With no overrides this is exactly
/// [`compile_options_bytes`].
pub fn compile_options_bytes_with(overrides: &[(String, OptionValue)]) -> Vec<u8> {
    compile_options_bytes_for(1, None, overrides)
}

/// Serialized `CompileOptionsProto` for a program run by `replicas` data-parallel replicas
/// (`executable_build_options.num_replicas`, one partition), with debug option overrides as in
/// [`compile_options_bytes_with`].
///
/// `devices` (when given, one global device id per replica) becomes the explicit
/// `device_assignment`: replica `r` runs on device `devices[r]`. Without it PJRT's default
/// assignment is used, which for a single-process client is the `r`-th addressable device.
/// With `replicas == 1`, no devices and no overrides this is exactly
/// [`compile_options_bytes`].
pub fn compile_options_bytes_for(
    replicas: usize,
    devices: Option<&[i64]>,
    overrides: &[(String, OptionValue)],
) -> Vec<u8> {
    // ExecutableBuildOptionsProto: num_replicas = 4, num_partitions = 5,
    // device_assignment = 9 (DeviceAssignmentProto: replica_count = 1, computation_count = 2,
    // computation_devices = 3 { replica_device_ids = 1 (repeated) }).
    let mut build = vec![4 << 3];
    varint(&mut build, replicas as u64);
    build.extend_from_slice(&[5 << 3, 1]);
    if let Some(ids) = devices {
        let mut computation = Vec::new();
        for &id in ids {
            computation.push(1 << 3);
            varint(&mut computation, id as u64);
        }
        let mut assignment = vec![1 << 3];
        varint(&mut assignment, replicas as u64);
        assignment.extend_from_slice(&[2 << 3, 1]);
        len_delimited(&mut assignment, 3, &computation);
        len_delimited(&mut build, 9, &assignment);
    }
    let mut out = Vec::new();
    len_delimited(&mut out, 3, &build);
    for (name, value) in overrides {
        let mut v = Vec::new();
        match value {
            OptionValue::Str(s) => len_delimited(&mut v, 1, s.as_bytes()),
            OptionValue::Bool(b) => {
                v.push(2 << 3);
                v.push(u8::from(*b));
            }
            OptionValue::Int(i) => {
                v.push(3 << 3);
                varint(&mut v, *i as u64);
            }
            OptionValue::Double(d) => {
                v.push(4 << 3 | 1);
                v.extend_from_slice(&d.to_le_bytes());
            }
        }
        let mut entry = Vec::new();
        len_delimited(&mut entry, 1, name.as_bytes());
        len_delimited(&mut entry, 2, &v);
        len_delimited(&mut out, 7, &entry);
    }
    out
}
