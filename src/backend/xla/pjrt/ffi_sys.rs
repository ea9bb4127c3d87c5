//! Hand-written `#[repr(C)]` bindings for the PJRT FFI extension (`pjrt_c_api_ffi_extension.h`)
//! and the parts of the XLA FFI C API (`xla/ffi/api/c_api.h`) that kiln's handlers use.
//!
//! Layouts follow the XLA FFI C API 0.1 header (openxla/xla); the CPU plugin kiln ships with
//! (xla-cpu-pjrt 0.0.1, PJRT C API 0.81) implements XLA FFI API 0.2, which only appended to
//! what is declared here. Offsets are checked at compile time (the `layout` block at the end)
//! against numbers printed by gcc for the header's structs; the recipe was verified end to end
//! with a C probe on this plugin (`shared/research/pjrt_ffi_probe.c`).
//!
//! The registration args are the *current* upstream layout, without the `int api_version`
//! field that an early header had before `handler`: passing that older layout to the 0.81
//! plugin crashes it (`std::bad_alloc`).

#![allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    missing_docs
)]

use std::ffi::{c_char, c_int, c_void};

use super::sys::{PJRT_Error, PJRT_Extension_Base, PJRT_Extension_Type};

/// `PJRT_Extension_Type_FFI` (the 6th entry of `PJRT_Extension_Type`).
pub const PJRT_Extension_Type_FFI: PJRT_Extension_Type = 5;

/// `PJRT_FFI_Register_Handler_Args`.
#[repr(C)]
pub struct PJRT_FFI_Register_Handler_Args {
    pub struct_size: usize,
    pub target_name: *const c_char,
    pub target_name_size: usize,
    pub handler: *mut c_void,
    pub platform_name: *const c_char,
    pub platform_name_size: usize,
    pub traits: u32,
}

/// `PJRT_FFI_Register_Handler_Args_STRUCT_SIZE`: up to and including `traits`.
pub const PJRT_FFI_Register_Handler_Args_STRUCT_SIZE: usize =
    core::mem::offset_of!(PJRT_FFI_Register_Handler_Args, traits) + 4;

pub type PJRT_FFI_Register_Handler =
    unsafe extern "C" fn(args: *mut PJRT_FFI_Register_Handler_Args) -> *mut PJRT_Error;

/// `PJRT_FFI_Extension`: `{base, type_id_register, user_data_add, register_handler}`.
#[repr(C)]
pub struct PJRT_FFI_Extension {
    pub base: PJRT_Extension_Base,
    pub type_id_register: *mut c_void,
    pub user_data_add: *mut c_void,
    pub register_handler: Option<PJRT_FFI_Register_Handler>,
}

// ------------------------------------------------------------------------------------------
// XLA FFI C API.
// ------------------------------------------------------------------------------------------

/// `XLA_FFI_Extension_Type_Metadata`.
pub const XLA_FFI_Extension_Metadata: u32 = 1;

/// `XLA_FFI_Extension_Base`.
#[repr(C)]
pub struct XLA_FFI_Extension_Base {
    pub struct_size: usize,
    pub type_: u32,
    pub next: *mut XLA_FFI_Extension_Base,
}

/// `XLA_FFI_Api_Version`.
#[repr(C)]
pub struct XLA_FFI_Api_Version {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub major_version: c_int,
    pub minor_version: c_int,
}

pub const XLA_FFI_Api_Version_STRUCT_SIZE: usize = 24;

/// Opaque `XLA_FFI_Error`.
#[repr(C)]
pub struct XLA_FFI_Error {
    _private: [u8; 0],
}

/// `XLA_FFI_Error_Code` values used by kiln.
pub const XLA_FFI_Error_Code_INVALID_ARGUMENT: u32 = 3;
pub const XLA_FFI_Error_Code_INTERNAL: u32 = 13;

/// `XLA_FFI_Error_Create_Args`.
#[repr(C)]
pub struct XLA_FFI_Error_Create_Args {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub message: *const c_char,
    pub errc: u32,
}

pub const XLA_FFI_Error_Create_Args_STRUCT_SIZE: usize =
    core::mem::offset_of!(XLA_FFI_Error_Create_Args, errc) + 4;

pub type XLA_FFI_Error_Create =
    unsafe extern "C" fn(args: *mut XLA_FFI_Error_Create_Args) -> *mut XLA_FFI_Error;

/// `XLA_FFI_DataType` values kiln's handlers accept.
pub const XLA_FFI_DataType_F32: u32 = 11;
pub const XLA_FFI_DataType_F64: u32 = 12;

/// The size in bytes of one element of an `XLA_FFI_DataType` (XLA's `PrimitiveType`), for
/// the types kiln's graphs hold.
pub fn xla_ffi_data_type_bytes(t: u32) -> Option<usize> {
    match t {
        1 | 2 | 6 => Some(1),       // PRED, S8, U8
        3 | 7 | 10 | 16 => Some(2), // S16, U16, F16, BF16
        4 | 8 | 11 => Some(4),      // S32, U32, F32
        5 | 9 | 12 | 15 => Some(8), // S64, U64, F64, C64
        18 => Some(16),             // C128
        _ => None,
    }
}

/// `XLA_FFI_Buffer`: a dense row-major array (data allocated by XLA).
#[repr(C)]
pub struct XLA_FFI_Buffer {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub dtype: u32,
    pub data: *mut c_void,
    pub rank: i64,
    pub dims: *mut i64,
}

/// `XLA_FFI_ArgType_BUFFER` / `XLA_FFI_RetType_BUFFER`.
pub const XLA_FFI_ArgType_BUFFER: u32 = 1;
pub const XLA_FFI_RetType_BUFFER: u32 = 1;

/// `XLA_FFI_AttrType`.
pub const XLA_FFI_AttrType_ARRAY: u32 = 1;
pub const XLA_FFI_AttrType_DICTIONARY: u32 = 2;
pub const XLA_FFI_AttrType_SCALAR: u32 = 3;
pub const XLA_FFI_AttrType_STRING: u32 = 4;

/// `XLA_FFI_DataType` of 64-bit signed integers (scalar and array attributes).
pub const XLA_FFI_DataType_S64: u32 = 5;
/// `XLA_FFI_DataType` of 32-bit signed integers.
pub const XLA_FFI_DataType_S32: u32 = 4;

/// `XLA_FFI_ByteSpan`.
#[repr(C)]
pub struct XLA_FFI_ByteSpan {
    pub ptr: *const c_char,
    pub len: usize,
}

/// `XLA_FFI_Scalar`.
#[repr(C)]
pub struct XLA_FFI_Scalar {
    pub dtype: u32,
    pub value: *mut c_void,
}

/// `XLA_FFI_Array`.
#[repr(C)]
pub struct XLA_FFI_Array {
    pub dtype: u32,
    pub size: usize,
    pub data: *mut c_void,
}

/// `XLA_FFI_Args`.
#[repr(C)]
pub struct XLA_FFI_Args {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub size: i64,
    pub types: *mut u32,
    pub args: *mut *mut c_void,
}

/// `XLA_FFI_Rets`.
#[repr(C)]
pub struct XLA_FFI_Rets {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub size: i64,
    pub types: *mut u32,
    pub rets: *mut *mut c_void,
}

/// `XLA_FFI_Attrs` (sorted by name).
#[repr(C)]
pub struct XLA_FFI_Attrs {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub size: i64,
    pub types: *mut u32,
    pub names: *mut *mut XLA_FFI_ByteSpan,
    pub attrs: *mut *mut c_void,
}

/// `XLA_FFI_ExecutionStage_EXECUTE`.
pub const XLA_FFI_ExecutionStage_EXECUTE: u32 = 3;

/// The head of `XLA_FFI_Api`: the version and the first function kiln calls.
#[repr(C)]
pub struct XLA_FFI_Api {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub api_version: XLA_FFI_Api_Version,
    pub internal_api: *mut c_void,
    pub XLA_FFI_Error_Create: Option<XLA_FFI_Error_Create>,
}

/// `XLA_FFI_CallFrame` (fields up to `attrs`, its `STRUCT_SIZE`; `future` follows).
#[repr(C)]
pub struct XLA_FFI_CallFrame {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub api: *const XLA_FFI_Api,
    pub ctx: *mut c_void,
    pub stage: u32,
    pub args: XLA_FFI_Args,
    pub rets: XLA_FFI_Rets,
    pub attrs: XLA_FFI_Attrs,
}

pub const XLA_FFI_CallFrame_STRUCT_SIZE: usize = core::mem::size_of::<XLA_FFI_CallFrame>();

/// `XLA_FFI_Handler`.
pub type XLA_FFI_Handler =
    unsafe extern "C" fn(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error;

/// `XLA_FFI_Metadata`: what a handler reports about itself when XLA probes it at registration.
#[repr(C)]
pub struct XLA_FFI_Metadata {
    pub struct_size: usize,
    pub api_version: XLA_FFI_Api_Version,
    pub traits: u32,
}

/// `XLA_FFI_Metadata_Extension`: passed in `extension_start` of the registration probe.
#[repr(C)]
pub struct XLA_FFI_Metadata_Extension {
    pub extension_base: XLA_FFI_Extension_Base,
    pub metadata: *mut XLA_FFI_Metadata,
}

// ------------------------------------------------------------------------------------------
// Layout checks: offsets and `*_STRUCT_SIZE` printed by gcc (x86-64 Linux) for the structs of
// `xla/ffi/api/c_api.h` and `pjrt_c_api_ffi_extension.h`.
// ------------------------------------------------------------------------------------------

#[cfg(all(target_pointer_width = "64", not(windows)))]
mod layout {
    use super::*;
    use core::mem::{offset_of, size_of};

    const _: () = assert!(offset_of!(PJRT_FFI_Register_Handler_Args, target_name) == 8);
    const _: () = assert!(offset_of!(PJRT_FFI_Register_Handler_Args, target_name_size) == 16);
    const _: () = assert!(offset_of!(PJRT_FFI_Register_Handler_Args, handler) == 24);
    const _: () = assert!(offset_of!(PJRT_FFI_Register_Handler_Args, platform_name) == 32);
    const _: () = assert!(offset_of!(PJRT_FFI_Register_Handler_Args, platform_name_size) == 40);
    const _: () = assert!(offset_of!(PJRT_FFI_Register_Handler_Args, traits) == 48);
    const _: () = assert!(PJRT_FFI_Register_Handler_Args_STRUCT_SIZE == 52);
    const _: () = assert!(offset_of!(PJRT_FFI_Extension, register_handler) == 40);
    const _: () = assert!(size_of::<PJRT_FFI_Extension>() == 48);

    const _: () = assert!(offset_of!(XLA_FFI_Extension_Base, next) == 16);
    const _: () = assert!(offset_of!(XLA_FFI_Api_Version, minor_version) == 20);
    const _: () = assert!(offset_of!(XLA_FFI_Error_Create_Args, errc) == 24);
    const _: () = assert!(XLA_FFI_Error_Create_Args_STRUCT_SIZE == 28);
    const _: () = assert!(offset_of!(XLA_FFI_Buffer, dtype) == 16);
    const _: () = assert!(offset_of!(XLA_FFI_Buffer, data) == 24);
    const _: () = assert!(offset_of!(XLA_FFI_Buffer, rank) == 32);
    const _: () = assert!(offset_of!(XLA_FFI_Buffer, dims) == 40);
    const _: () = assert!(size_of::<XLA_FFI_Scalar>() == 16);
    const _: () = assert!(offset_of!(XLA_FFI_Array, data) == 16);
    const _: () = assert!(size_of::<XLA_FFI_Args>() == 40);
    const _: () = assert!(size_of::<XLA_FFI_Attrs>() == 48);
    const _: () = assert!(offset_of!(XLA_FFI_Api, internal_api) == 40);
    const _: () = assert!(offset_of!(XLA_FFI_Api, XLA_FFI_Error_Create) == 48);
    const _: () = assert!(offset_of!(XLA_FFI_CallFrame, stage) == 32);
    const _: () = assert!(offset_of!(XLA_FFI_CallFrame, args) == 40);
    const _: () = assert!(offset_of!(XLA_FFI_CallFrame, rets) == 80);
    const _: () = assert!(offset_of!(XLA_FFI_CallFrame, attrs) == 120);
    const _: () = assert!(XLA_FFI_CallFrame_STRUCT_SIZE == 168);
    const _: () = assert!(offset_of!(XLA_FFI_Metadata, api_version) == 8);
    const _: () = assert!(offset_of!(XLA_FFI_Metadata, traits) == 32);
    const _: () = assert!(offset_of!(XLA_FFI_Metadata_Extension, metadata) == 24);
}
