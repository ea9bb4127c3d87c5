//! Hand-written `#[repr(C)]` bindings for the parts of the PJRT C API (`pjrt_c_api.h`) that
//! kiln uses.
//!
//! Layouts are taken from the header of PJRT C API 0.81 (the `xla-cpu-pjrt` 0.0.1 plugin).
//! Every args struct and every typed `PJRT_Api` slot has its offset and its `*_STRUCT_SIZE`
//! checked at compile time against numbers printed by a C program compiled with gcc against
//! that header (see the `layout` block at the end of this file). One typed slot is not
//! called: `PJRT_Buffer_UnsafePointer` (the direct read uses `OpaqueDeviceMemoryDataPointer`,
//! whose validity the header ties to the external reference count). `PJRT_Event_IsReady` and
//! `PJRT_Event_OnReady` serve only the waits that run handed-over kernels (`handoff`); the
//! await that follows still yields the event's error.
//!
//! Only the `PJRT_Api` slots up to the last one kiln may call
//! (`PJRT_Buffer_OpaqueDeviceMemoryDataPointer`) are declared; the plugin's table may be longer
//! or shorter. The loader reads a slot only if it lies within the plugin's `struct_size`: the
//! slots up to `PJRT_Buffer_ReadyEvent` are required ([`API_NEEDED_SIZE`]), the later ones
//! (the direct host read of `Buffer::to_host`) are optional.
//!
//! Conventions of the C API that the safe layer relies on:
//! - every args struct begins with `struct_size` (set to `*_STRUCT_SIZE`, i.e. the offset of
//!   the last field plus its size, *not* `sizeof` with tail padding) and `extension_start`;
//! - every call returns a `PJRT_Error*` that is null on success and otherwise owned by the
//!   caller (freed with `PJRT_Error_Destroy`);
//! - C enums are `int`-sized; they are declared here as `u32` type aliases with constants so
//!   that an unknown value written by a newer plugin is never undefined behaviour in Rust.

#![allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    missing_docs
)]

use std::ffi::{c_char, c_int, c_void};

// ------------------------------------------------------------------------------------------
// Opaque handle types.
// ------------------------------------------------------------------------------------------

macro_rules! opaque {
    ($($name:ident),* $(,)?) => {
        $(
            /// Opaque PJRT handle type; only ever used behind a pointer.
            #[repr(C)]
            pub struct $name {
                _private: [u8; 0],
                _not_send_sync: core::marker::PhantomData<(*mut u8, core::marker::PhantomPinned)>,
            }
        )*
    };
}

opaque!(
    PJRT_Error,
    PJRT_Event,
    PJRT_Client,
    PJRT_Device,
    PJRT_DeviceDescription,
    PJRT_Memory,
    PJRT_Executable,
    PJRT_LoadedExecutable,
    PJRT_Buffer,
    PJRT_SerializedExecutable,
    PJRT_SendCallbackInfo,
    PJRT_RecvCallbackInfo,
    PJRT_ExecuteContext,
);

/// `PJRT_Extension_Base`: head of a linked list of extensions.
#[repr(C)]
pub struct PJRT_Extension_Base {
    pub struct_size: usize,
    pub type_: PJRT_Extension_Type,
    pub next: *mut PJRT_Extension_Base,
}

pub type PJRT_Extension_Type = u32;

// ------------------------------------------------------------------------------------------
// Enums (C `int`-sized).
// ------------------------------------------------------------------------------------------

/// `PJRT_Error_Code` (absl status codes).
pub type PJRT_Error_Code = u32;

/// Names of the `PJRT_Error_Code` values, indexed by code.
pub const ERROR_CODE_NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// `PJRT_Buffer_Type`.
pub type PJRT_Buffer_Type = u32;
pub const PJRT_Buffer_Type_INVALID: PJRT_Buffer_Type = 0;
pub const PJRT_Buffer_Type_PRED: PJRT_Buffer_Type = 1;
pub const PJRT_Buffer_Type_S8: PJRT_Buffer_Type = 2;
pub const PJRT_Buffer_Type_S16: PJRT_Buffer_Type = 3;
pub const PJRT_Buffer_Type_S32: PJRT_Buffer_Type = 4;
pub const PJRT_Buffer_Type_S64: PJRT_Buffer_Type = 5;
pub const PJRT_Buffer_Type_U8: PJRT_Buffer_Type = 6;
pub const PJRT_Buffer_Type_U16: PJRT_Buffer_Type = 7;
pub const PJRT_Buffer_Type_U32: PJRT_Buffer_Type = 8;
pub const PJRT_Buffer_Type_U64: PJRT_Buffer_Type = 9;
pub const PJRT_Buffer_Type_F16: PJRT_Buffer_Type = 10;
pub const PJRT_Buffer_Type_F32: PJRT_Buffer_Type = 11;
pub const PJRT_Buffer_Type_F64: PJRT_Buffer_Type = 12;
pub const PJRT_Buffer_Type_BF16: PJRT_Buffer_Type = 13;
pub const PJRT_Buffer_Type_C64: PJRT_Buffer_Type = 14;
pub const PJRT_Buffer_Type_C128: PJRT_Buffer_Type = 15;

/// `PJRT_HostBufferSemantics`.
pub type PJRT_HostBufferSemantics = u32;
pub const PJRT_HostBufferSemantics_kImmutableOnlyDuringCall: PJRT_HostBufferSemantics = 0;
pub const PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes: PJRT_HostBufferSemantics = 1;
pub const PJRT_HostBufferSemantics_kImmutableZeroCopy: PJRT_HostBufferSemantics = 2;
pub const PJRT_HostBufferSemantics_kMutableZeroCopy: PJRT_HostBufferSemantics = 3;

/// `PJRT_Buffer_MemoryLayout_Type`.
pub type PJRT_Buffer_MemoryLayout_Type = u32;
pub const PJRT_Buffer_MemoryLayout_Type_Tiled: PJRT_Buffer_MemoryLayout_Type = 0;
pub const PJRT_Buffer_MemoryLayout_Type_Strides: PJRT_Buffer_MemoryLayout_Type = 1;

// ------------------------------------------------------------------------------------------
// Args structs.
// ------------------------------------------------------------------------------------------

/// Implemented by every args struct: its `*_STRUCT_SIZE` and an all-zero value with
/// `struct_size` filled in.
pub trait Args: Sized {
    /// `offsetof(last field) + sizeof(last field)`, as `PJRT_DEFINE_STRUCT_TRAITS` computes it.
    const STRUCT_SIZE: usize;
    /// All fields zero / null, `struct_size` set to [`Args::STRUCT_SIZE`].
    fn new() -> Self;
}

/// Declares a `#[repr(C)]` args struct whose first field is `struct_size`, and implements
/// [`Args`] for it.
macro_rules! pjrt_struct {
    ($(#[$meta:meta])* pub struct $name:ident { $(pub $field:ident : $ty:ty,)* }) => {
        $(#[$meta])*
        #[repr(C)]
        pub struct $name {
            pub struct_size: usize,
            $(pub $field: $ty,)*
        }

        impl Args for $name {
            const STRUCT_SIZE: usize = {
                let ends = [
                    core::mem::offset_of!($name, struct_size) + core::mem::size_of::<usize>(),
                    $(core::mem::offset_of!($name, $field) + core::mem::size_of::<$ty>(),)*
                ];
                let mut max = 0;
                let mut i = 0;
                while i < ends.len() {
                    if ends[i] > max {
                        max = ends[i];
                    }
                    i += 1;
                }
                max
            };

            fn new() -> Self {
                // SAFETY: every field of this struct is an integer, a float, a `bool`, a raw
                // pointer, an `Option` of a function pointer, or a struct or union made only of
                // those (`PJRT_Buffer_MemoryLayout`, `PJRT_NamedValue_Union`), for all of which
                // the all-zero bit pattern is a valid value (0, false, null, None).
                let mut v: Self = unsafe { core::mem::zeroed() };
                v.struct_size = <Self as Args>::STRUCT_SIZE;
                v
            }
        }
    };
}

pjrt_struct! {
    /// `PJRT_Api_Version` (embedded in `PJRT_Api`).
    pub struct PJRT_Api_Version {
        pub extension_start: *mut PJRT_Extension_Base,
        pub major_version: c_int,
        pub minor_version: c_int,
    }
}

pjrt_struct! {
    pub struct PJRT_Error_Destroy_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub error: *mut PJRT_Error,
    }
}

pjrt_struct! {
    pub struct PJRT_Error_Message_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub error: *const PJRT_Error,
        pub message: *const c_char,
        pub message_size: usize,
    }
}

pjrt_struct! {
    pub struct PJRT_Error_GetCode_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub error: *const PJRT_Error,
        pub code: PJRT_Error_Code,
    }
}

pjrt_struct! {
    pub struct PJRT_Plugin_Initialize_Args {
        pub extension_start: *mut PJRT_Extension_Base,
    }
}

pjrt_struct! {
    pub struct PJRT_Event_Destroy_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub event: *mut PJRT_Event,
    }
}

pjrt_struct! {
    pub struct PJRT_Event_Await_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub event: *mut PJRT_Event,
    }
}

pjrt_struct! {
    pub struct PJRT_Event_IsReady_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub event: *mut PJRT_Event,
        pub is_ready: bool,
    }
}

pjrt_struct! {
    pub struct PJRT_Event_OnReady_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub event: *mut PJRT_Event,
        pub callback: Option<PJRT_Event_OnReadyCallback>,
        pub user_arg: *mut c_void,
    }
}

pjrt_struct! {
    /// `PJRT_Buffer_MemoryLayout_Tiled`: minor-to-major dimension order plus optional tiles.
    #[derive(Clone, Copy)]
    pub struct PJRT_Buffer_MemoryLayout_Tiled {
        pub extension_start: *mut PJRT_Extension_Base,
        pub minor_to_major: *const i64,
        pub minor_to_major_size: usize,
        pub tile_dims: *const i64,
        pub tile_dim_sizes: *const usize,
        pub num_tiles: usize,
    }
}

pjrt_struct! {
    /// `PJRT_Buffer_MemoryLayout_Strides`: byte strides per dimension.
    #[derive(Clone, Copy)]
    pub struct PJRT_Buffer_MemoryLayout_Strides {
        pub extension_start: *mut PJRT_Extension_Base,
        pub byte_strides: *const i64,
        pub num_byte_strides: usize,
    }
}

/// The anonymous union inside `PJRT_Buffer_MemoryLayout`; `type_` says which member is live.
#[repr(C)]
#[derive(Clone, Copy)]
pub union PJRT_Buffer_MemoryLayout_Union {
    pub tiled: PJRT_Buffer_MemoryLayout_Tiled,
    pub strides: PJRT_Buffer_MemoryLayout_Strides,
}

pjrt_struct! {
    /// `PJRT_Buffer_MemoryLayout`. In C the union is anonymous (`layout.tiled`); here it is
    /// the field `u` (`layout.u.tiled`), at the same offset.
    pub struct PJRT_Buffer_MemoryLayout {
        pub extension_start: *mut PJRT_Extension_Base,
        pub u: PJRT_Buffer_MemoryLayout_Union,
        pub type_: PJRT_Buffer_MemoryLayout_Type,
    }
}

/// `PJRT_NamedValue_Type`.
pub type PJRT_NamedValue_Type = u32;
pub const PJRT_NamedValue_kString: PJRT_NamedValue_Type = 0;
pub const PJRT_NamedValue_kInt64: PJRT_NamedValue_Type = 1;
pub const PJRT_NamedValue_kInt64List: PJRT_NamedValue_Type = 2;
pub const PJRT_NamedValue_kFloat: PJRT_NamedValue_Type = 3;
pub const PJRT_NamedValue_kBool: PJRT_NamedValue_Type = 4;

/// The anonymous value union of `PJRT_NamedValue`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union PJRT_NamedValue_Union {
    pub string_value: *const c_char,
    pub int64_value: i64,
    pub int64_array_value: *const i64,
    pub float_value: f32,
    pub bool_value: bool,
}

pjrt_struct! {
    /// `PJRT_NamedValue`: one named option (`PJRT_Client_Create`'s `create_options`). In C the
    /// union is anonymous; here it is the field `u`, at the same offset.
    pub struct PJRT_NamedValue {
        pub extension_start: *mut PJRT_Extension_Base,
        pub name: *const c_char,
        pub name_size: usize,
        pub type_: PJRT_NamedValue_Type,
        pub u: PJRT_NamedValue_Union,
        pub value_size: usize,
    }
}

pjrt_struct! {
    pub struct PJRT_Client_Create_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub create_options: *const PJRT_NamedValue,
        pub num_options: usize,
        // Key-value store callbacks (function pointers); kiln passes none.
        pub kv_get_callback: *mut c_void,
        pub kv_get_user_arg: *mut c_void,
        pub kv_put_callback: *mut c_void,
        pub kv_put_user_arg: *mut c_void,
        pub client: *mut PJRT_Client,
        pub kv_try_get_callback: *mut c_void,
        pub kv_try_get_user_arg: *mut c_void,
    }
}

pjrt_struct! {
    pub struct PJRT_Client_Destroy_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
    }
}

pjrt_struct! {
    pub struct PJRT_Client_PlatformName_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub platform_name: *const c_char,
        pub platform_name_size: usize,
    }
}

pjrt_struct! {
    pub struct PJRT_Client_PlatformVersion_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub platform_version: *const c_char,
        pub platform_version_size: usize,
    }
}

pjrt_struct! {
    pub struct PJRT_Device_GetDescription_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub device: *mut PJRT_Device,
        pub device_description: *mut PJRT_DeviceDescription,
    }
}

pjrt_struct! {
    pub struct PJRT_DeviceDescription_Id_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub device_description: *mut PJRT_DeviceDescription,
        pub id: c_int,
    }
}

pjrt_struct! {
    pub struct PJRT_Client_AddressableDevices_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub addressable_devices: *const *mut PJRT_Device,
        pub num_addressable_devices: usize,
    }
}

pjrt_struct! {
    pub struct PJRT_Program {
        pub extension_start: *mut PJRT_Extension_Base,
        pub code: *mut c_char,
        pub code_size: usize,
        pub format: *const c_char,
        pub format_size: usize,
    }
}

pjrt_struct! {
    pub struct PJRT_Client_Compile_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub program: *const PJRT_Program,
        pub compile_options: *const c_char,
        pub compile_options_size: usize,
        pub executable: *mut PJRT_LoadedExecutable,
    }
}

pjrt_struct! {
    pub struct PJRT_Client_BufferFromHostBuffer_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub data: *const c_void,
        pub type_: PJRT_Buffer_Type,
        pub dims: *const i64,
        pub num_dims: usize,
        pub byte_strides: *const i64,
        pub num_byte_strides: usize,
        pub host_buffer_semantics: PJRT_HostBufferSemantics,
        pub device: *mut PJRT_Device,
        pub memory: *mut PJRT_Memory,
        pub device_layout: *mut PJRT_Buffer_MemoryLayout,
        pub done_with_host_buffer: *mut PJRT_Event,
        pub buffer: *mut PJRT_Buffer,
    }
}

pjrt_struct! {
    pub struct PJRT_Executable_Destroy_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub executable: *mut PJRT_Executable,
    }
}

pjrt_struct! {
    pub struct PJRT_LoadedExecutable_Destroy_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub executable: *mut PJRT_LoadedExecutable,
    }
}

pjrt_struct! {
    pub struct PJRT_LoadedExecutable_GetExecutable_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub loaded_executable: *mut PJRT_LoadedExecutable,
        pub executable: *mut PJRT_Executable,
    }
}

pjrt_struct! {
    pub struct PJRT_Executable_NumOutputs_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub executable: *mut PJRT_Executable,
        pub num_outputs: usize,
    }
}

pjrt_struct! {
    pub struct PJRT_Executable_OptimizedProgram_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub executable: *mut PJRT_Executable,
        pub program: *mut PJRT_Program,
    }
}

/// `void (*)(PJRT_SerializedExecutable*)`, frees the bytes returned by `PJRT_Executable_Serialize`.
pub type PJRT_SerializedExecutableDeleter =
    unsafe extern "C" fn(exec: *mut PJRT_SerializedExecutable);

pjrt_struct! {
    pub struct PJRT_Executable_Serialize_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub executable: *const PJRT_Executable,
        pub serialized_bytes: *const c_char,
        pub serialized_bytes_size: usize,
        pub serialized_executable: *mut PJRT_SerializedExecutable,
        pub serialized_executable_deleter: Option<PJRT_SerializedExecutableDeleter>,
    }
}

pjrt_struct! {
    pub struct PJRT_Executable_DeserializeAndLoad_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub serialized_executable: *const c_char,
        pub serialized_executable_size: usize,
        pub loaded_executable: *mut PJRT_LoadedExecutable,
        pub overridden_serialized_compile_options: *const c_char,
        pub overridden_serialized_compile_options_size: usize,
    }
}

pjrt_struct! {
    pub struct PJRT_ExecuteOptions {
        pub extension_start: *mut PJRT_Extension_Base,
        pub send_callbacks: *mut *mut PJRT_SendCallbackInfo,
        pub recv_callbacks: *mut *mut PJRT_RecvCallbackInfo,
        pub num_send_ops: usize,
        pub num_recv_ops: usize,
        pub launch_id: c_int,
        pub non_donatable_input_indices: *const i64,
        pub num_non_donatable_input_indices: usize,
        pub context: *mut PJRT_ExecuteContext,
        pub call_location: *const c_char,
        pub num_tasks: usize,
        pub task_ids: *mut c_int,
        pub incarnation_ids: *mut i64,
    }
}

pjrt_struct! {
    pub struct PJRT_LoadedExecutable_Execute_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub executable: *mut PJRT_LoadedExecutable,
        pub options: *mut PJRT_ExecuteOptions,
        pub argument_lists: *const *const *mut PJRT_Buffer,
        pub num_devices: usize,
        pub num_args: usize,
        pub output_lists: *const *mut *mut PJRT_Buffer,
        pub device_complete_events: *mut *mut PJRT_Event,
        pub execute_device: *mut PJRT_Device,
    }
}

pjrt_struct! {
    pub struct PJRT_Buffer_Destroy_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
    }
}

pjrt_struct! {
    pub struct PJRT_Buffer_ElementType_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub type_: PJRT_Buffer_Type,
    }
}

pjrt_struct! {
    pub struct PJRT_Buffer_Dimensions_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub dims: *const i64,
        pub num_dims: usize,
    }
}

pjrt_struct! {
    pub struct PJRT_Buffer_GetMemoryLayout_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        // Out; its pointers are owned by `buffer` and live as long as it does.
        pub layout: PJRT_Buffer_MemoryLayout,
    }
}

pjrt_struct! {
    pub struct PJRT_Buffer_ToHostBuffer_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub src: *mut PJRT_Buffer,
        pub host_layout: *mut PJRT_Buffer_MemoryLayout,
        pub dst: *mut c_void,
        pub dst_size: usize,
        pub event: *mut PJRT_Event,
    }
}

pjrt_struct! {
    pub struct PJRT_Buffer_OnDeviceSizeInBytes_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub on_device_size_in_bytes: usize,
    }
}

pjrt_struct! {
    pub struct PJRT_Buffer_IsDeleted_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub is_deleted: bool,
    }
}

pjrt_struct! {
    pub struct PJRT_Buffer_ReadyEvent_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub event: *mut PJRT_Event,
    }
}

pjrt_struct! {
    pub struct PJRT_Buffer_UnsafePointer_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        // `uintptr_t`, out.
        pub buffer_pointer: usize,
    }
}

pjrt_struct! {
    pub struct PJRT_Buffer_IncreaseExternalReferenceCount_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
    }
}

pjrt_struct! {
    pub struct PJRT_Buffer_DecreaseExternalReferenceCount_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
    }
}

pjrt_struct! {
    pub struct PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args {
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub device_memory_ptr: *mut c_void,
    }
}

// ------------------------------------------------------------------------------------------
// Function pointer types.
// ------------------------------------------------------------------------------------------

/// A `PJRT_Api` slot that kiln does not call (kept only so that later offsets are right).
pub type Unused = Option<unsafe extern "C" fn()>;

/// `PJRT_Error* f(Args*)`, the shape of almost every PJRT C API function.
pub type Fn<A> = unsafe extern "C" fn(args: *mut A) -> *mut PJRT_Error;

pub type PJRT_Error_Destroy = unsafe extern "C" fn(args: *mut PJRT_Error_Destroy_Args);
pub type PJRT_Error_Message = unsafe extern "C" fn(args: *mut PJRT_Error_Message_Args);
pub type PJRT_Error_GetCode = Fn<PJRT_Error_GetCode_Args>;
pub type PJRT_Plugin_Initialize = Fn<PJRT_Plugin_Initialize_Args>;
pub type PJRT_Event_Destroy = Fn<PJRT_Event_Destroy_Args>;
pub type PJRT_Event_IsReady = Fn<PJRT_Event_IsReady_Args>;
pub type PJRT_Event_Await = Fn<PJRT_Event_Await_Args>;
/// Called once the event is ready, with its error (owned by the callback, which must destroy
/// it) and the `user_arg` given to `PJRT_Event_OnReady`.
pub type PJRT_Event_OnReadyCallback =
    unsafe extern "C" fn(error: *mut PJRT_Error, user_arg: *mut c_void);
pub type PJRT_Event_OnReady = Fn<PJRT_Event_OnReady_Args>;
pub type PJRT_Client_Create = Fn<PJRT_Client_Create_Args>;
pub type PJRT_Client_Destroy = Fn<PJRT_Client_Destroy_Args>;
pub type PJRT_Client_PlatformName = Fn<PJRT_Client_PlatformName_Args>;
pub type PJRT_Client_PlatformVersion = Fn<PJRT_Client_PlatformVersion_Args>;
pub type PJRT_Client_AddressableDevices = Fn<PJRT_Client_AddressableDevices_Args>;
pub type PJRT_Device_GetDescription = Fn<PJRT_Device_GetDescription_Args>;
pub type PJRT_DeviceDescription_Id = Fn<PJRT_DeviceDescription_Id_Args>;
pub type PJRT_Client_Compile = Fn<PJRT_Client_Compile_Args>;
pub type PJRT_Client_BufferFromHostBuffer = Fn<PJRT_Client_BufferFromHostBuffer_Args>;
pub type PJRT_Executable_Destroy = Fn<PJRT_Executable_Destroy_Args>;
pub type PJRT_Executable_NumOutputs = Fn<PJRT_Executable_NumOutputs_Args>;
pub type PJRT_Executable_OptimizedProgram = Fn<PJRT_Executable_OptimizedProgram_Args>;
pub type PJRT_Executable_Serialize = Fn<PJRT_Executable_Serialize_Args>;
pub type PJRT_LoadedExecutable_Destroy = Fn<PJRT_LoadedExecutable_Destroy_Args>;
pub type PJRT_LoadedExecutable_GetExecutable = Fn<PJRT_LoadedExecutable_GetExecutable_Args>;
pub type PJRT_LoadedExecutable_Execute = Fn<PJRT_LoadedExecutable_Execute_Args>;
pub type PJRT_Executable_DeserializeAndLoad = Fn<PJRT_Executable_DeserializeAndLoad_Args>;
pub type PJRT_Buffer_Destroy = Fn<PJRT_Buffer_Destroy_Args>;
pub type PJRT_Buffer_ElementType = Fn<PJRT_Buffer_ElementType_Args>;
pub type PJRT_Buffer_Dimensions = Fn<PJRT_Buffer_Dimensions_Args>;
pub type PJRT_Buffer_OnDeviceSizeInBytes = Fn<PJRT_Buffer_OnDeviceSizeInBytes_Args>;
pub type PJRT_Buffer_IsDeleted = Fn<PJRT_Buffer_IsDeleted_Args>;
pub type PJRT_Buffer_ToHostBuffer = Fn<PJRT_Buffer_ToHostBuffer_Args>;
pub type PJRT_Buffer_ReadyEvent = Fn<PJRT_Buffer_ReadyEvent_Args>;
pub type PJRT_Buffer_GetMemoryLayout = Fn<PJRT_Buffer_GetMemoryLayout_Args>;
pub type PJRT_Buffer_UnsafePointer = Fn<PJRT_Buffer_UnsafePointer_Args>;
pub type PJRT_Buffer_IncreaseExternalReferenceCount =
    Fn<PJRT_Buffer_IncreaseExternalReferenceCount_Args>;
pub type PJRT_Buffer_DecreaseExternalReferenceCount =
    Fn<PJRT_Buffer_DecreaseExternalReferenceCount_Args>;
pub type PJRT_Buffer_OpaqueDeviceMemoryDataPointer =
    Fn<PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args>;

/// `const PJRT_Api* GetPjrtApi(void)`, the plugin's one exported symbol.
pub type GetPjrtApi = unsafe extern "C" fn() -> *const PJRT_Api;

/// The exported symbol name, NUL-terminated for `dlsym`.
pub const GET_PJRT_API_SYMBOL: &[u8] = b"GetPjrtApi\0";

// ------------------------------------------------------------------------------------------
// The function table, in header order, up to the last slot kiln may call.
// ------------------------------------------------------------------------------------------

/// `PJRT_Api`, truncated after `PJRT_Buffer_OpaqueDeviceMemoryDataPointer` (the plugin's table
/// is usually longer; its real length is `struct_size`, and only slots within it may be read).
#[repr(C)]
pub struct PJRT_Api {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub pjrt_api_version: PJRT_Api_Version,
    pub PJRT_Error_Destroy: Option<PJRT_Error_Destroy>,
    pub PJRT_Error_Message: Option<PJRT_Error_Message>,
    pub PJRT_Error_GetCode: Option<PJRT_Error_GetCode>,
    pub PJRT_Plugin_Initialize: Option<PJRT_Plugin_Initialize>,
    pub PJRT_Plugin_Attributes: Unused,
    pub PJRT_Event_Destroy: Option<PJRT_Event_Destroy>,
    pub PJRT_Event_IsReady: Option<PJRT_Event_IsReady>,
    pub PJRT_Event_Error: Unused,
    pub PJRT_Event_Await: Option<PJRT_Event_Await>,
    pub PJRT_Event_OnReady: Option<PJRT_Event_OnReady>,
    pub PJRT_Client_Create: Option<PJRT_Client_Create>,
    pub PJRT_Client_Destroy: Option<PJRT_Client_Destroy>,
    pub PJRT_Client_PlatformName: Option<PJRT_Client_PlatformName>,
    pub PJRT_Client_ProcessIndex: Unused,
    pub PJRT_Client_PlatformVersion: Option<PJRT_Client_PlatformVersion>,
    pub PJRT_Client_Devices: Unused,
    pub PJRT_Client_AddressableDevices: Option<PJRT_Client_AddressableDevices>,
    pub PJRT_Client_LookupDevice: Unused,
    pub PJRT_Client_LookupAddressableDevice: Unused,
    pub PJRT_Client_AddressableMemories: Unused,
    pub PJRT_Client_Compile: Option<PJRT_Client_Compile>,
    pub PJRT_Client_DefaultDeviceAssignment: Unused,
    pub PJRT_Client_BufferFromHostBuffer: Option<PJRT_Client_BufferFromHostBuffer>,
    pub PJRT_DeviceDescription_Id: Option<PJRT_DeviceDescription_Id>,
    pub PJRT_DeviceDescription_ProcessIndex: Unused,
    pub PJRT_DeviceDescription_Attributes: Unused,
    pub PJRT_DeviceDescription_Kind: Unused,
    pub PJRT_DeviceDescription_DebugString: Unused,
    pub PJRT_DeviceDescription_ToString: Unused,
    pub PJRT_Device_GetDescription: Option<PJRT_Device_GetDescription>,
    pub PJRT_Device_IsAddressable: Unused,
    pub PJRT_Device_LocalHardwareId: Unused,
    pub PJRT_Device_AddressableMemories: Unused,
    pub PJRT_Device_DefaultMemory: Unused,
    pub PJRT_Device_MemoryStats: Unused,
    pub PJRT_Memory_Id: Unused,
    pub PJRT_Memory_Kind: Unused,
    pub PJRT_Memory_DebugString: Unused,
    pub PJRT_Memory_ToString: Unused,
    pub PJRT_Memory_AddressableByDevices: Unused,
    pub PJRT_Executable_Destroy: Option<PJRT_Executable_Destroy>,
    pub PJRT_Executable_Name: Unused,
    pub PJRT_Executable_NumReplicas: Unused,
    pub PJRT_Executable_NumPartitions: Unused,
    pub PJRT_Executable_NumOutputs: Option<PJRT_Executable_NumOutputs>,
    pub PJRT_Executable_SizeOfGeneratedCodeInBytes: Unused,
    pub PJRT_Executable_GetCostAnalysis: Unused,
    pub PJRT_Executable_OutputMemoryKinds: Unused,
    pub PJRT_Executable_OptimizedProgram: Option<PJRT_Executable_OptimizedProgram>,
    pub PJRT_Executable_Serialize: Option<PJRT_Executable_Serialize>,
    pub PJRT_LoadedExecutable_Destroy: Option<PJRT_LoadedExecutable_Destroy>,
    pub PJRT_LoadedExecutable_GetExecutable: Option<PJRT_LoadedExecutable_GetExecutable>,
    pub PJRT_LoadedExecutable_AddressableDevices: Unused,
    pub PJRT_LoadedExecutable_Delete: Unused,
    pub PJRT_LoadedExecutable_IsDeleted: Unused,
    pub PJRT_LoadedExecutable_Execute: Option<PJRT_LoadedExecutable_Execute>,
    pub PJRT_Executable_DeserializeAndLoad: Option<PJRT_Executable_DeserializeAndLoad>,
    pub PJRT_LoadedExecutable_Fingerprint: Unused,
    pub PJRT_Buffer_Destroy: Option<PJRT_Buffer_Destroy>,
    pub PJRT_Buffer_ElementType: Option<PJRT_Buffer_ElementType>,
    pub PJRT_Buffer_Dimensions: Option<PJRT_Buffer_Dimensions>,
    pub PJRT_Buffer_UnpaddedDimensions: Unused,
    pub PJRT_Buffer_DynamicDimensionIndices: Unused,
    pub PJRT_Buffer_GetMemoryLayout: Option<PJRT_Buffer_GetMemoryLayout>,
    pub PJRT_Buffer_OnDeviceSizeInBytes: Option<PJRT_Buffer_OnDeviceSizeInBytes>,
    pub PJRT_Buffer_Device: Unused,
    pub PJRT_Buffer_Memory: Unused,
    pub PJRT_Buffer_Delete: Unused,
    pub PJRT_Buffer_IsDeleted: Option<PJRT_Buffer_IsDeleted>,
    pub PJRT_Buffer_CopyToDevice: Unused,
    pub PJRT_Buffer_ToHostBuffer: Option<PJRT_Buffer_ToHostBuffer>,
    pub PJRT_Buffer_IsOnCpu: Unused,
    pub PJRT_Buffer_ReadyEvent: Option<PJRT_Buffer_ReadyEvent>,
    pub PJRT_Buffer_UnsafePointer: Option<PJRT_Buffer_UnsafePointer>,
    pub PJRT_Buffer_IncreaseExternalReferenceCount:
        Option<PJRT_Buffer_IncreaseExternalReferenceCount>,
    pub PJRT_Buffer_DecreaseExternalReferenceCount:
        Option<PJRT_Buffer_DecreaseExternalReferenceCount>,
    pub PJRT_Buffer_OpaqueDeviceMemoryDataPointer:
        Option<PJRT_Buffer_OpaqueDeviceMemoryDataPointer>,
}

/// Bytes of `PJRT_Api` that must be present to read the version: `struct_size`,
/// `extension_start` and `pjrt_api_version`.
pub const API_VERSION_END: usize =
    core::mem::offset_of!(PJRT_Api, pjrt_api_version) + core::mem::size_of::<PJRT_Api_Version>();

/// `PJRT_Api_STRUCT_SIZE` of the 0.81 header (the full table; kiln declares only a prefix).
pub const PJRT_API_STRUCT_SIZE_0_81: usize = 984;

/// Bytes of `PJRT_Api` that a plugin must provide: up to the end of `PJRT_Buffer_ReadyEvent`,
/// the last slot kiln cannot do without. Slots after it are optional (read only when they lie
/// within the plugin's `struct_size`).
pub const API_NEEDED_SIZE: usize = core::mem::offset_of!(PJRT_Api, PJRT_Buffer_ReadyEvent)
    + core::mem::size_of::<Option<PJRT_Buffer_ReadyEvent>>();

/// Bytes of `PJRT_Api` declared here: up to the end of
/// `PJRT_Buffer_OpaqueDeviceMemoryDataPointer`.
pub const API_DECLARED_SIZE: usize = core::mem::size_of::<PJRT_Api>();

// ------------------------------------------------------------------------------------------
// Layout checks.
//
// The numbers below were printed by a C program compiled with gcc (x86-64 Linux) against
// `pjrt_c_api.h` of PJRT C API 0.81: for each struct, `<name>_STRUCT_SIZE` and `offsetof` of
// every field declared here; for `PJRT_Api`, `offsetof` of every slot kiln calls. The program
// is generated from this file's declarations (one `printf` of `offsetof(S, f)` per field) and
// can be re-run against a newer header to check that nothing moved (the C API only appends).
// ------------------------------------------------------------------------------------------

macro_rules! layout {
    ($name:ident, $size:expr; $($field:ident $off:expr)*) => {
        const _: () = assert!(<$name as Args>::STRUCT_SIZE == $size);
        $(const _: () = assert!(core::mem::offset_of!($name, $field) == $off);)*
    };
}

macro_rules! api_layout {
    ($size:expr; $($field:ident $off:expr)*) => {
        const _: () = assert!(PJRT_API_STRUCT_SIZE_0_81 == $size);
        $(const _: () = assert!(core::mem::offset_of!(PJRT_Api, $field) == $off);)*
    };
}

#[cfg(all(target_pointer_width = "64", not(windows)))]
mod layout {
    use super::*;

    layout!(PJRT_Api_Version, 24; struct_size 0 extension_start 8 major_version 16 minor_version 20);
    layout!(PJRT_Error_Destroy_Args, 24; struct_size 0 extension_start 8 error 16);
    layout!(PJRT_Error_Message_Args, 40; struct_size 0 extension_start 8 error 16 message 24 message_size 32);
    layout!(PJRT_Error_GetCode_Args, 28; struct_size 0 extension_start 8 error 16 code 24);
    layout!(PJRT_Plugin_Initialize_Args, 16; struct_size 0 extension_start 8);
    layout!(PJRT_Event_Destroy_Args, 24; struct_size 0 extension_start 8 event 16);
    layout!(PJRT_Event_Await_Args, 24; struct_size 0 extension_start 8 event 16);
    layout!(PJRT_Event_IsReady_Args, 25; struct_size 0 extension_start 8 event 16 is_ready 24);
    layout!(PJRT_Event_OnReady_Args, 40; struct_size 0 extension_start 8 event 16 callback 24 user_arg 32);
    layout!(PJRT_Buffer_MemoryLayout_Tiled, 56; struct_size 0 extension_start 8 minor_to_major 16 minor_to_major_size 24 tile_dims 32 tile_dim_sizes 40 num_tiles 48);
    layout!(PJRT_Buffer_MemoryLayout_Strides, 32; struct_size 0 extension_start 8 byte_strides 16 num_byte_strides 24);
    layout!(PJRT_Buffer_MemoryLayout, 76; struct_size 0 extension_start 8 u 16 type_ 72);
    layout!(PJRT_NamedValue, 56; struct_size 0 extension_start 8 name 16 name_size 24 type_ 32 u 40 value_size 48);
    layout!(PJRT_Client_Create_Args, 88; struct_size 0 extension_start 8 create_options 16 num_options 24 kv_get_callback 32 kv_get_user_arg 40 kv_put_callback 48 kv_put_user_arg 56 client 64 kv_try_get_callback 72 kv_try_get_user_arg 80);
    layout!(PJRT_Client_Destroy_Args, 24; struct_size 0 extension_start 8 client 16);
    layout!(PJRT_Client_PlatformName_Args, 40; struct_size 0 extension_start 8 client 16 platform_name 24 platform_name_size 32);
    layout!(PJRT_Client_PlatformVersion_Args, 40; struct_size 0 extension_start 8 client 16 platform_version 24 platform_version_size 32);
    layout!(PJRT_Device_GetDescription_Args, 32; struct_size 0 extension_start 8 device 16 device_description 24);
    layout!(PJRT_DeviceDescription_Id_Args, 28; struct_size 0 extension_start 8 device_description 16 id 24);
    layout!(PJRT_Client_AddressableDevices_Args, 40; struct_size 0 extension_start 8 client 16 addressable_devices 24 num_addressable_devices 32);
    layout!(PJRT_Program, 48; struct_size 0 extension_start 8 code 16 code_size 24 format 32 format_size 40);
    layout!(PJRT_Client_Compile_Args, 56; struct_size 0 extension_start 8 client 16 program 24 compile_options 32 compile_options_size 40 executable 48);
    layout!(PJRT_Client_BufferFromHostBuffer_Args, 120; struct_size 0 extension_start 8 client 16 data 24 type_ 32 dims 40 num_dims 48 byte_strides 56 num_byte_strides 64 host_buffer_semantics 72 device 80 memory 88 device_layout 96 done_with_host_buffer 104 buffer 112);
    layout!(PJRT_Executable_Destroy_Args, 24; struct_size 0 extension_start 8 executable 16);
    layout!(PJRT_LoadedExecutable_Destroy_Args, 24; struct_size 0 extension_start 8 executable 16);
    layout!(PJRT_LoadedExecutable_GetExecutable_Args, 32; struct_size 0 extension_start 8 loaded_executable 16 executable 24);
    layout!(PJRT_Executable_NumOutputs_Args, 32; struct_size 0 extension_start 8 executable 16 num_outputs 24);
    layout!(PJRT_Executable_OptimizedProgram_Args, 32; struct_size 0 extension_start 8 executable 16 program 24);
    layout!(PJRT_Executable_Serialize_Args, 56; struct_size 0 extension_start 8 executable 16 serialized_bytes 24 serialized_bytes_size 32 serialized_executable 40 serialized_executable_deleter 48);
    layout!(PJRT_Executable_DeserializeAndLoad_Args, 64; struct_size 0 extension_start 8 client 16 serialized_executable 24 serialized_executable_size 32 loaded_executable 40 overridden_serialized_compile_options 48 overridden_serialized_compile_options_size 56);
    layout!(PJRT_ExecuteOptions, 112; struct_size 0 extension_start 8 send_callbacks 16 recv_callbacks 24 num_send_ops 32 num_recv_ops 40 launch_id 48 non_donatable_input_indices 56 num_non_donatable_input_indices 64 context 72 call_location 80 num_tasks 88 task_ids 96 incarnation_ids 104);
    layout!(PJRT_LoadedExecutable_Execute_Args, 80; struct_size 0 extension_start 8 executable 16 options 24 argument_lists 32 num_devices 40 num_args 48 output_lists 56 device_complete_events 64 execute_device 72);
    layout!(PJRT_Buffer_Destroy_Args, 24; struct_size 0 extension_start 8 buffer 16);
    layout!(PJRT_Buffer_ElementType_Args, 28; struct_size 0 extension_start 8 buffer 16 type_ 24);
    layout!(PJRT_Buffer_Dimensions_Args, 40; struct_size 0 extension_start 8 buffer 16 dims 24 num_dims 32);
    layout!(PJRT_Buffer_GetMemoryLayout_Args, 104; struct_size 0 extension_start 8 buffer 16 layout 24);
    layout!(PJRT_Buffer_ToHostBuffer_Args, 56; struct_size 0 extension_start 8 src 16 host_layout 24 dst 32 dst_size 40 event 48);
    layout!(PJRT_Buffer_OnDeviceSizeInBytes_Args, 32; struct_size 0 extension_start 8 buffer 16 on_device_size_in_bytes 24);
    layout!(PJRT_Buffer_IsDeleted_Args, 25; struct_size 0 extension_start 8 buffer 16 is_deleted 24);
    layout!(PJRT_Buffer_ReadyEvent_Args, 32; struct_size 0 extension_start 8 buffer 16 event 24);
    layout!(PJRT_Buffer_UnsafePointer_Args, 32; struct_size 0 extension_start 8 buffer 16 buffer_pointer 24);
    layout!(PJRT_Buffer_IncreaseExternalReferenceCount_Args, 24; struct_size 0 extension_start 8 buffer 16);
    layout!(PJRT_Buffer_DecreaseExternalReferenceCount_Args, 24; struct_size 0 extension_start 8 buffer 16);
    layout!(PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args, 32; struct_size 0 extension_start 8 buffer 16 device_memory_ptr 24);
    api_layout!(984; pjrt_api_version 16 PJRT_Error_Destroy 40 PJRT_Error_Message 48 PJRT_Error_GetCode 56 PJRT_Plugin_Initialize 64 PJRT_Event_Destroy 80 PJRT_Event_IsReady 88 PJRT_Event_Await 104 PJRT_Event_OnReady 112 PJRT_Client_Create 120 PJRT_Client_Destroy 128 PJRT_Client_PlatformName 136 PJRT_Client_PlatformVersion 152 PJRT_Client_AddressableDevices 168 PJRT_Client_Compile 200 PJRT_Client_BufferFromHostBuffer 216 PJRT_DeviceDescription_Id 224 PJRT_Device_GetDescription 272 PJRT_Executable_Destroy 360 PJRT_Executable_NumOutputs 392 PJRT_Executable_OptimizedProgram 424 PJRT_Executable_Serialize 432 PJRT_LoadedExecutable_Destroy 440 PJRT_LoadedExecutable_GetExecutable 448 PJRT_LoadedExecutable_Execute 480 PJRT_Executable_DeserializeAndLoad 488 PJRT_Buffer_Destroy 504 PJRT_Buffer_ElementType 512 PJRT_Buffer_Dimensions 520 PJRT_Buffer_GetMemoryLayout 544 PJRT_Buffer_OnDeviceSizeInBytes 552 PJRT_Buffer_IsDeleted 584 PJRT_Buffer_ToHostBuffer 600 PJRT_Buffer_ReadyEvent 616 PJRT_Buffer_UnsafePointer 624 PJRT_Buffer_IncreaseExternalReferenceCount 632 PJRT_Buffer_DecreaseExternalReferenceCount 640 PJRT_Buffer_OpaqueDeviceMemoryDataPointer 648);
    // End of `PJRT_Buffer_ReadyEvent`, the last required slot, and of
    // `PJRT_Buffer_OpaqueDeviceMemoryDataPointer`, the last slot declared here.
    const _: () = assert!(API_NEEDED_SIZE == 624);
    const _: () = assert!(API_DECLARED_SIZE == 656);
}
