//! The PJRT FFI extension: kiln's own kernels (XLA FFI handlers) inside XLA executables.
//!
//! A plugin that exports the FFI extension lets a process register *handlers*: C functions
//! that XLA calls for `stablehlo.custom_call @name(...) {api_version = 4 : i32, ...}` ops.
//! kiln registers its handlers (see [`FfiKernel`]) under the platform `"Host"`; XLA then calls
//! them from its own worker threads with the call's operand and result buffers (dense,
//! row-major, result buffers already allocated) and the custom call's `backend_config`
//! attributes.
//!
//! The recipe (verified on PJRT C API 0.81 / XLA FFI API 0.2 and newer plugins):
//! 1. find the extension of type `PJRT_Extension_Type_FFI` in `PJRT_Api.extension_start`;
//! 2. call its `register_handler` with the current args layout (no `api_version` field);
//! 3. during registration XLA calls the handler once with an `XLA_FFI_Metadata_Extension`:
//!    the handler answers the XLA FFI API version it was written against (major 0, minor at
//!    most the runtime's) and returns. A higher minor than the runtime's makes registration
//!    *look* successful while nothing is registered; compiles then fail with "No FFI handler
//!    registered" — which is why [`super::super::XlaBackend`] compiles a self-test graph once.
//!
//! Registration is process-wide and permanent: the handler must stay callable until the
//! process exits (it is a `'static` function) and the plugin is never unloaded (see
//! [`Api`]). Each kernel is registered at most once per plugin.

#![allow(non_upper_case_globals)]

use std::cell::Cell;
use std::ffi::{c_void, CString};
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use super::api::Api;
use super::ffi_sys::*;
use super::sys::PJRT_Extension_Base;
use crate::backend::host::Element;
use crate::error::{Error, Result};
use crate::ir::DType;

/// The XLA FFI API minor version kiln's handlers are written against (the header's
/// `XLA_FFI_API_MINOR`). A handler answers `min(this, runtime's minor)` at registration.
const FFI_MINOR: i32 = 1;

/// A kernel that XLA can call through a custom call named [`FfiKernel::TARGET`].
///
/// [`FfiKernel::run`] receives the call's buffers and attributes as a [`Call`]; it must
/// write every result buffer and must not keep any view of a buffer past its return. XLA may
/// call it from several threads at once.
pub(crate) trait FfiKernel: 'static {
    /// The custom call target name (`stablehlo.custom_call @TARGET`).
    const TARGET: &'static str;
    /// Runs one call.
    fn run(call: &Call<'_>) -> Result<()>;
}

/// The PJRT FFI extension of a plugin, if it has one.
fn ffi_extension(api: &Api) -> Option<&'static PJRT_FFI_Extension> {
    let table = api.inner().table();
    // SAFETY: `table` is the plugin's static `PJRT_Api`, whose first two fields
    // (`struct_size`, `extension_start`) exist in every version of the C API; the plugin stays
    // loaded for the process, so its extension structs are `'static`.
    let mut ext: *const PJRT_Extension_Base =
        unsafe { ptr::addr_of!((*table).extension_start).read() };
    while !ext.is_null() {
        // SAFETY: `ext` is a non-null node of the plugin's extension list, each of which
        // begins with a `PJRT_Extension_Base`.
        let base = unsafe { &*ext };
        if base.type_ == PJRT_Extension_Type_FFI {
            if base.struct_size < std::mem::size_of::<PJRT_FFI_Extension>() {
                return None;
            }
            // SAFETY: an extension of type FFI is a `PJRT_FFI_Extension`, and its
            // `struct_size` says it holds at least the fields declared here.
            return Some(unsafe { &*ext.cast::<PJRT_FFI_Extension>() });
        }
        ext = base.next;
    }
    None
}

impl Api {
    /// Does the plugin export the PJRT FFI extension with a `register_handler` function?
    pub fn has_ffi_extension(&self) -> bool {
        ffi_extension(self).is_some_and(|e| e.register_handler.is_some())
    }

    /// Registers `K`'s handler with the plugin for the platform `"Host"` (CPU plugins), once
    /// per plugin and kernel; later calls return the first call's result.
    ///
    /// # Errors
    /// [`Error::Unsupported`] if the plugin has no FFI extension; [`Error::Pjrt`] if
    /// registration fails.
    pub(crate) fn register_ffi_kernel<K: FfiKernel>(&self) -> Result<()> {
        let mut done = self.inner().ffi_registered.lock();
        if let Some((_, r)) = done.iter().find(|(n, _)| *n == K::TARGET) {
            return r.clone().map_err(|m| Error::Unsupported {
                backend: "xla".into(),
                what: m,
            });
        }
        let r = self.register_handler(K::TARGET, handler::<K>);
        if r.is_ok() {
            // Waits for results now run the kernels XLA's workers hand over.
            super::handoff::enable();
        }
        done.push((K::TARGET, r.as_ref().map(|_| ()).map_err(|e| e.to_string())));
        r
    }

    fn register_handler(&self, target: &'static str, handler: XLA_FFI_Handler) -> Result<()> {
        let ext = ffi_extension(self).ok_or_else(|| Error::Unsupported {
            backend: "xla".into(),
            what: format!(
                "PJRT plugin {} has no FFI extension (cannot register custom call {target})",
                self.path().display()
            ),
        })?;
        let register = ext.register_handler.ok_or_else(|| Error::Unsupported {
            backend: "xla".into(),
            what: "the plugin's FFI extension has no register_handler".into(),
        })?;
        const PLATFORM: &str = "Host";
        let mut args = PJRT_FFI_Register_Handler_Args {
            struct_size: PJRT_FFI_Register_Handler_Args_STRUCT_SIZE,
            target_name: target.as_ptr().cast(),
            target_name_size: target.len(),
            handler: handler as *mut c_void,
            platform_name: PLATFORM.as_ptr().cast(),
            platform_name_size: PLATFORM.len(),
            traits: 0,
        };
        // SAFETY: `args` is fully initialized in the layout the plugin expects (checked in
        // `ffi_sys`); the names are `'static` strings passed with their lengths (XLA copies
        // them); `handler` is a `'static` `extern "C"` function with the `XLA_FFI_Handler`
        // signature that answers the registration probe.
        let err = unsafe { register(&mut args) };
        self.inner().check("PJRT_FFI_Register_Handler", err)
    }
}

/// The `extern "C"` entry point XLA calls for kernel `K`.
///
/// Answers the registration probe, ignores every stage but EXECUTE, and turns an `Err` (or a
/// panic) of [`FfiKernel::run`] into an `XLA_FFI_Error` carrying the message, which XLA
/// returns from the execution as a PJRT error.
unsafe extern "C" fn handler<K: FfiKernel>(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    if frame.is_null() {
        return ptr::null_mut();
    }
    // SAFETY: XLA passes a valid call frame that lives for the duration of this call.
    let f = unsafe { &*frame };
    // Registration probe: report the API version and no traits.
    let mut ext = f.extension_start;
    while !ext.is_null() {
        // SAFETY: `ext` is a non-null node of the frame's extension list.
        let base = unsafe { &*ext };
        if base.type_ == XLA_FFI_Extension_Metadata {
            // SAFETY: an extension of type Metadata is an `XLA_FFI_Metadata_Extension`.
            let md = unsafe { (*ext.cast::<XLA_FFI_Metadata_Extension>()).metadata };
            if !md.is_null() {
                let runtime_minor = runtime_minor(f);
                // SAFETY: `md` points to XLA's metadata struct, valid for this call; only
                // its version and traits are written.
                unsafe {
                    (*md).api_version.major_version = 0;
                    (*md).api_version.minor_version = FFI_MINOR.min(runtime_minor);
                    (*md).traits = 0;
                }
            }
            return ptr::null_mut();
        }
        ext = base.next;
    }
    if f.struct_size < XLA_FFI_CallFrame_STRUCT_SIZE {
        return error(f, "kiln: XLA FFI call frame too small".into());
    }
    if f.stage != XLA_FFI_ExecutionStage_EXECUTE {
        return ptr::null_mut();
    }
    let call = Call {
        frame: f,
        taken: Cell::new(0),
        _p: PhantomData,
    };
    match catch_unwind(AssertUnwindSafe(|| K::run(&call))) {
        Ok(Ok(())) => ptr::null_mut(),
        Ok(Err(e)) => error(f, format!("kiln custom call {}: {e}", K::TARGET)),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("panic");
            error(f, format!("kiln custom call {} panicked: {msg}", K::TARGET))
        }
    }
}

/// The runtime's XLA FFI minor version (0 if the frame has no API table).
fn runtime_minor(f: &XLA_FFI_CallFrame) -> i32 {
    if f.api.is_null() {
        return 0;
    }
    // SAFETY: `f.api` is XLA's static API table; its `struct_size` and `api_version` head
    // exist in every version.
    unsafe { (*f.api).api_version.minor_version }
}

/// Creates an `XLA_FFI_Error` with `message` (null if the runtime offers no way to).
fn error(f: &XLA_FFI_CallFrame, message: String) -> *mut XLA_FFI_Error {
    if f.api.is_null() {
        return ptr::null_mut();
    }
    // SAFETY: as in `runtime_minor`; `XLA_FFI_Error_Create` is read only if the table is long
    // enough to hold it.
    let create = unsafe {
        let api = &*f.api;
        if api.struct_size < std::mem::offset_of!(XLA_FFI_Api, XLA_FFI_Error_Create) + 8 {
            return ptr::null_mut();
        }
        api.XLA_FFI_Error_Create
    };
    let Some(create) = create else {
        return ptr::null_mut();
    };
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let mut args = XLA_FFI_Error_Create_Args {
        struct_size: XLA_FFI_Error_Create_Args_STRUCT_SIZE,
        extension_start: ptr::null_mut(),
        message: message.as_ptr(),
        errc: XLA_FFI_Error_Code_INTERNAL,
    };
    // SAFETY: `args` is initialized; XLA copies the message into the error it returns, whose
    // ownership passes to XLA when the handler returns it.
    unsafe { create(&mut args) }
}

/// One call of a kernel: its operand and result buffers and its attributes.
pub(crate) struct Call<'a> {
    frame: &'a XLA_FFI_CallFrame,
    /// Bit `i`: result `i` has been handed out as a mutable slice ([`Call::ret_slice_mut`]).
    taken: Cell<u64>,
    _p: PhantomData<&'a ()>,
}

/// An attribute value of a custom call's `backend_config`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Attr<'a> {
    /// An integer scalar (`7 : i64`, `7 : i32`).
    Int(i64),
    /// A float scalar (`0.5 : f64`, `0.5 : f32`).
    Float(f64),
    /// A dense `i64` array (`array<i64: 1, 2>`).
    Ints(&'a [i64]),
    /// A string.
    Str(&'a str),
    /// Any other kind (kiln's kernels do not use it).
    Other,
}

/// One operand or result buffer of a [`Call`].
pub(crate) struct BufferRef<'a> {
    /// Element type (f32 or f64; other types are rejected when the buffer is read).
    pub dtype: DType,
    /// Dimensions, row-major.
    pub dims: &'a [i64],
    data: *mut c_void,
}

impl Call<'_> {
    /// Number of operand buffers.
    pub fn num_args(&self) -> usize {
        self.frame.args.size.max(0) as usize
    }

    /// Number of result buffers.
    pub fn num_rets(&self) -> usize {
        self.frame.rets.size.max(0) as usize
    }

    /// `Err` unless the call has exactly `args` operands and `rets` results.
    pub fn expect_arity(&self, args: usize, rets: usize) -> Result<()> {
        if self.num_args() != args || self.num_rets() != rets {
            return Err(Error::Invalid(format!(
                "expected {args} operands and {rets} result(s), got {} and {}",
                self.num_args(),
                self.num_rets()
            )));
        }
        Ok(())
    }

    /// Operand `i`'s `XLA_FFI_Buffer` (possibly null), checked to be in range and a buffer.
    fn arg_entry(&self, i: usize) -> Result<*const XLA_FFI_Buffer> {
        let a = &self.frame.args;
        // SAFETY: `types` and `args` hold `size` entries (XLA FFI contract).
        unsafe {
            buffer_entry(
                a.types,
                a.args,
                a.size,
                i,
                XLA_FFI_ArgType_BUFFER,
                "operand",
            )
        }
    }

    /// Result `i`'s `XLA_FFI_Buffer` (possibly null), checked to be in range and a buffer.
    fn ret_entry(&self, i: usize) -> Result<*const XLA_FFI_Buffer> {
        let r = &self.frame.rets;
        // SAFETY: `types` and `rets` hold `size` entries (XLA FFI contract).
        unsafe { buffer_entry(r.types, r.rets, r.size, i, XLA_FFI_RetType_BUFFER, "result") }
    }

    /// Operand `i`.
    pub fn arg(&self, i: usize) -> Result<BufferRef<'_>> {
        // SAFETY: an argument of type BUFFER is an `XLA_FFI_Buffer` valid for this call.
        unsafe { buffer_ref(self.arg_entry(i)?, "operand", i) }
    }

    /// Makes result `r` hold operand `a`'s value (the same type and shape, any element type):
    /// nothing to do when XLA gave the two one buffer (the call declares
    /// `output_operand_aliases`), else a byte copy.
    pub fn forward_operand(&self, a: usize, r: usize) -> Result<()> {
        let (src, dst) = (self.arg_entry(a)?, self.ret_entry(r)?);
        if src.is_null() || dst.is_null() {
            return Err(Error::Invalid(format!("operand {a} or result {r} is null")));
        }
        // SAFETY: non-null BUFFER entries are `XLA_FFI_Buffer`s valid for this call.
        let (src, dst) = unsafe { (&*src, &*dst) };
        if src.data == dst.data {
            return Ok(());
        }
        // SAFETY: each buffer's `dims` holds `rank` entries valid for the call.
        let (sd, dd) = unsafe { (raw_dims(src), raw_dims(dst)) };
        if src.dtype != dst.dtype || sd != dd {
            return Err(Error::Invalid(format!(
                "result {r} ({:?}, type {}) is not of operand {a}'s type ({:?}, type {})",
                dd, dst.dtype, sd, src.dtype
            )));
        }
        let width = xla_ffi_data_type_bytes(src.dtype).ok_or_else(|| {
            Error::Invalid(format!("operand {a} has XLA element type {}", src.dtype))
        })?;
        let bytes = sd.iter().product::<i64>().max(0) as usize * width;
        if bytes > 0 {
            if src.data.is_null() || dst.data.is_null() {
                return Err(Error::Invalid("buffer with null data".into()));
            }
            // SAFETY: both buffers hold `bytes` bytes (same type and dims) for this call, and
            // are distinct XLA allocations (checked unequal above; XLA never overlaps an
            // operand with a result it did not alias).
            unsafe {
                std::ptr::copy_nonoverlapping(src.data.cast::<u8>(), dst.data.cast::<u8>(), bytes)
            };
        }
        Ok(())
    }

    /// The address of operand `i`'s data, of any element type: for identity only (the
    /// packed-weight cache's keys), never read through.
    pub fn arg_address(&self, i: usize) -> Result<usize> {
        let p = self.arg_entry(i)?;
        if p.is_null() {
            return Err(Error::Invalid(format!("operand {i} is not a buffer")));
        }
        // SAFETY: a non-null BUFFER entry is an `XLA_FFI_Buffer` valid for this call.
        Ok(unsafe { (*p).data } as usize)
    }

    /// Result `i`.
    pub fn ret(&self, i: usize) -> Result<BufferRef<'_>> {
        // SAFETY: a result of type BUFFER is an `XLA_FFI_Buffer` valid for this call.
        unsafe { buffer_ref(self.ret_entry(i)?, "result", i) }
    }

    /// Result `i`'s elements, to write. Each result can be taken this way once per call (a
    /// second request is an error), so two slices never alias.
    #[allow(clippy::mut_from_ref)]
    pub fn ret_slice_mut<T: Element>(&self, i: usize) -> Result<&mut [T]> {
        let b = self.ret(i)?;
        let bit = 1u64
            .checked_shl(i as u32)
            .ok_or_else(|| Error::Invalid(format!("result {i}: too many results to borrow")))?;
        if self.taken.get() & bit != 0 {
            return Err(Error::Invalid(format!("result {i} is already borrowed")));
        }
        let p = b.typed_ptr::<T>()?;
        self.taken.set(self.taken.get() | bit);
        // SAFETY: as in `BufferRef::as_slice`; a result buffer is this call's own output,
        // aliased by no operand (the one kiln call that declares operand aliasing, the ordering
        // call, never takes a result slice), and the
        // `taken` bit makes this the only slice of it handed out during the call, which the
        // borrow of `self` does not outlive.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, b.numel()) })
    }

    /// The attribute `name`, if the call has it.
    pub fn attr(&self, name: &str) -> Option<Attr<'_>> {
        let a = &self.frame.attrs;
        for i in 0..a.size.max(0) as usize {
            // SAFETY: `i < size`; `names`, `types` and `attrs` hold `size` entries, each name a
            // byte span valid for this call.
            let (n, ty, p) = unsafe { (&**a.names.add(i), *a.types.add(i), *a.attrs.add(i)) };
            // SAFETY: the span's `len` bytes at `ptr` are readable (XLA FFI contract).
            let bytes = unsafe { std::slice::from_raw_parts(n.ptr.cast::<u8>(), n.len) };
            if bytes != name.as_bytes() {
                continue;
            }
            // SAFETY: an attribute of type `ty` points to the matching XLA FFI struct, whose
            // data lives for the call.
            return Some(unsafe { attr_value(ty, p) });
        }
        None
    }

    /// Whether the call has the integer attribute `name` set to 1 (absent: false).
    pub fn flag(&self, name: &str) -> bool {
        matches!(self.attr(name), Some(Attr::Int(1)))
    }

    /// The integer attribute `name`.
    pub fn attr_int(&self, name: &str) -> Result<i64> {
        match self.attr(name) {
            Some(Attr::Int(v)) => Ok(v),
            other => Err(Error::Invalid(format!(
                "attribute {name}: expected an integer, got {other:?}"
            ))),
        }
    }

    /// The float attribute `name`.
    pub fn attr_f64(&self, name: &str) -> Result<f64> {
        match self.attr(name) {
            Some(Attr::Float(v)) => Ok(v),
            other => Err(Error::Invalid(format!(
                "attribute {name}: expected a float, got {other:?}"
            ))),
        }
    }

    /// The `i64` array attribute `name`.
    pub fn attr_ints(&self, name: &str) -> Result<&[i64]> {
        match self.attr(name) {
            Some(Attr::Ints(v)) => Ok(v),
            other => Err(Error::Invalid(format!(
                "attribute {name}: expected array<i64>, got {other:?}"
            ))),
        }
    }
}

/// Decodes one attribute.
///
/// # Safety
/// `p` must point to the XLA FFI struct of attribute type `ty` (`XLA_FFI_Scalar`,
/// `XLA_FFI_Array`, `XLA_FFI_ByteSpan`, ...), valid with its data for `'a`.
unsafe fn attr_value<'a>(ty: u32, p: *mut c_void) -> Attr<'a> {
    match ty {
        XLA_FFI_AttrType_SCALAR => {
            // SAFETY: a SCALAR attribute is an `XLA_FFI_Scalar` (caller's guarantee).
            let s = unsafe { &*p.cast::<XLA_FFI_Scalar>() };
            match s.dtype {
                // SAFETY: an S64 scalar's `value` points to an `i64`.
                XLA_FFI_DataType_S64 => Attr::Int(unsafe { *s.value.cast::<i64>() }),
                // SAFETY: an S32 scalar's `value` points to an `i32`.
                XLA_FFI_DataType_S32 => Attr::Int(i64::from(unsafe { *s.value.cast::<i32>() })),
                // SAFETY: an F64 scalar's `value` points to an `f64`.
                XLA_FFI_DataType_F64 => Attr::Float(unsafe { *s.value.cast::<f64>() }),
                // SAFETY: an F32 scalar's `value` points to an `f32`.
                XLA_FFI_DataType_F32 => Attr::Float(f64::from(unsafe { *s.value.cast::<f32>() })),
                _ => Attr::Other,
            }
        }
        XLA_FFI_AttrType_ARRAY => {
            // SAFETY: an ARRAY attribute is an `XLA_FFI_Array` (caller's guarantee).
            let arr = unsafe { &*p.cast::<XLA_FFI_Array>() };
            if arr.dtype != XLA_FFI_DataType_S64 {
                Attr::Other
            } else if arr.size == 0 || arr.data.is_null() {
                Attr::Ints(&[])
            } else {
                // SAFETY: an S64 array holds `size` `i64`s at `data`.
                Attr::Ints(unsafe { std::slice::from_raw_parts(arr.data.cast::<i64>(), arr.size) })
            }
        }
        XLA_FFI_AttrType_STRING => {
            // SAFETY: a STRING attribute is an `XLA_FFI_ByteSpan` (caller's guarantee).
            let s = unsafe { &*p.cast::<XLA_FFI_ByteSpan>() };
            if s.len == 0 {
                return Attr::Str("");
            }
            // SAFETY: the span's `len` bytes at `ptr` are readable.
            let b = unsafe { std::slice::from_raw_parts(s.ptr.cast::<u8>(), s.len) };
            std::str::from_utf8(b).map_or(Attr::Other, Attr::Str)
        }
        _ => Attr::Other,
    }
}

/// Entry `i` of an operand or result array (`what`) of `size` entries: its buffer pointer
/// (possibly null), after checking that `i` is in range and that the entry's type is
/// `buffer` (the array's BUFFER type).
///
/// # Safety
/// `types` and `bufs` must hold `size` entries valid for the call.
unsafe fn buffer_entry(
    types: *const u32,
    bufs: *const *mut c_void,
    size: i64,
    i: usize,
    buffer: u32,
    what: &str,
) -> Result<*const XLA_FFI_Buffer> {
    let n = size.max(0) as usize;
    if i >= n {
        return Err(Error::Invalid(format!(
            "{what} {i} requested, the call has {n}"
        )));
    }
    // SAFETY: `i < size` (caller's guarantee for the arrays).
    let (ty, p) = unsafe { (*types.add(i), *bufs.add(i)) };
    if ty != buffer {
        return Err(Error::Invalid(format!("{what} {i} is not a buffer")));
    }
    Ok(p.cast())
}

/// A buffer's dims (none for rank 0 or a null `dims`).
///
/// # Safety
/// `b.dims` must be null or hold `b.rank` entries valid for as long as `b` is borrowed.
unsafe fn raw_dims(b: &XLA_FFI_Buffer) -> &[i64] {
    if b.rank <= 0 || b.dims.is_null() {
        &[]
    } else {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts(b.dims, b.rank as usize) }
    }
}

/// Reads an `XLA_FFI_Buffer`.
///
/// # Safety
/// `b` must be null or point to an `XLA_FFI_Buffer` valid for `'a`.
unsafe fn buffer_ref<'a>(b: *const XLA_FFI_Buffer, what: &str, i: usize) -> Result<BufferRef<'a>> {
    if b.is_null() {
        return Err(Error::Invalid(format!("{what} {i} is null")));
    }
    // SAFETY: guaranteed by the caller.
    let b = unsafe { &*b };
    let dtype = match b.dtype {
        XLA_FFI_DataType_F32 => DType::F32,
        XLA_FFI_DataType_F64 => DType::F64,
        d => {
            return Err(Error::Invalid(format!(
                "{what} {i} has XLA element type {d}; kiln's kernels take f32 or f64"
            )))
        }
    };
    // SAFETY: guaranteed by the caller.
    let dims = unsafe { raw_dims(b) };
    if dims.iter().any(|&d| d < 0) {
        return Err(Error::Invalid(format!("{what} {i} has dims {dims:?}")));
    }
    Ok(BufferRef {
        dtype,
        dims,
        data: b.data,
    })
}

impl BufferRef<'_> {
    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }

    /// The data pointer, checked against `T` and against null (an empty buffer gives a
    /// dangling, aligned pointer).
    fn typed_ptr<T: Element>(&self) -> Result<*mut T> {
        if T::DTYPE != self.dtype {
            return Err(Error::Invalid(format!(
                "buffer of {:?} read as {:?}",
                self.dtype,
                T::DTYPE
            )));
        }
        if self.numel() == 0 {
            return Ok(std::ptr::NonNull::<T>::dangling().as_ptr());
        }
        if self.data.is_null() || !self.data.cast::<T>().is_aligned() {
            return Err(Error::Invalid("buffer with null or misaligned data".into()));
        }
        Ok(self.data.cast::<T>())
    }

    /// The buffer's elements, row-major (operand or result).
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        let p = self.typed_ptr::<T>()?;
        // SAFETY: XLA guarantees a dense row-major array of `dims` elements of this (checked)
        // type, valid and not written by anyone else for the duration of the call, which the
        // borrow of `self` does not outlive.
        Ok(unsafe { std::slice::from_raw_parts(p, self.numel()) })
    }

    /// A libtorch tensor viewing this buffer's memory (no copy), contiguous with the buffer's
    /// dims.
    ///
    /// The view does not own the memory: it must be dropped before the kernel returns (every
    /// kiln kernel builds its views inside [`FfiKernel::run`] and drops them there). Writing
    /// through a view of an *operand* is not allowed (XLA may share the buffer).
    pub fn tensor(&self) -> Result<tch::Tensor> {
        self.view(0, self.dims, &[])
    }

    /// A libtorch tensor viewing this buffer's memory with `sizes` and element `strides`
    /// that stay inside the buffer (e.g. a channels-last `[N, C, H, W]` view of an NHWC
    /// buffer). Same rules as [`BufferRef::tensor`].
    pub fn tensor_strided(&self, sizes: &[i64], strides: &[i64]) -> Result<tch::Tensor> {
        self.tensor_view(0, sizes, strides)
    }

    /// [`BufferRef::tensor_strided`] starting `offset` elements into the buffer (e.g. one of
    /// the query, key and value inside a fused projection's result).
    pub fn tensor_view(&self, offset: i64, sizes: &[i64], strides: &[i64]) -> Result<tch::Tensor> {
        let numel: i64 = self.dims.iter().product();
        if !view_fits(offset, sizes, strides, numel) {
            return Err(Error::Invalid(format!(
                "a view at offset {offset} of sizes {sizes:?} and strides {strides:?} does not fit a buffer of {:?}",
                self.dims
            )));
        }
        // An empty view reads nothing: it starts at the buffer (which may be empty too).
        let offset = if sizes.contains(&0) { 0 } else { offset };
        self.view(offset, sizes, strides)
    }

    fn view(&self, offset: i64, sizes: &[i64], strides: &[i64]) -> Result<tch::Tensor> {
        let kind = match self.dtype {
            DType::F32 => tch::Kind::Float,
            _ => tch::Kind::Double,
        };
        let numel: i64 = self.dims.iter().product();
        if numel > 0 && self.data.is_null() {
            return Err(Error::Invalid("buffer with null data".into()));
        }
        // SAFETY: XLA guarantees that `data` holds a dense row-major array of `dims` elements
        // of this type for the duration of the call, and the view is dropped within the call
        // (see above); the view covers those elements only (`sizes` are `dims` with default
        // strides and offset 0, or were checked to stay inside by `tensor_view`, so the
        // offset pointer is inside the buffer too). Empty arrays are viewed at offset 0
        // without reading memory.
        let t = unsafe {
            tch::Tensor::f_from_blob(
                self.data
                    .cast::<u8>()
                    .offset(offset as isize * self.dtype.size_in_bytes() as isize),
                sizes,
                strides,
                kind,
                tch::Device::Cpu,
            )
        }?;
        Ok(t)
    }
}

/// Does the view at `offset` of `sizes` and `strides` (as many of each, none negative) read
/// only elements `0..numel` of a dense array? An empty view (a size 0) reads nothing: it fits.
pub(crate) fn view_fits(offset: i64, sizes: &[i64], strides: &[i64], numel: i64) -> bool {
    sizes.len() == strides.len()
        && offset >= 0
        && sizes.iter().all(|&s| s >= 0)
        && strides.iter().all(|&s| s >= 0)
        && (sizes.contains(&0)
            || offset
                + sizes
                    .iter()
                    .zip(strides)
                    .map(|(&s, &t)| (s - 1) * t)
                    .sum::<i64>()
                < numel)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A view at an offset reads the elements libtorch's `as_strided` reads; views reaching
    /// outside the buffer are errors, not reads.
    #[test]
    fn views_read_inside_their_buffer_only() {
        let mut data: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let dims = [2i64, 12];
        let b = BufferRef {
            dtype: DType::F32,
            dims: &dims,
            data: data.as_mut_ptr().cast(),
        };
        // Column 1 of a [4, 6] reading, from element 6 on: 7, 13, 19.
        let v = b.tensor_view(7, &[3], &[6]).unwrap();
        assert_eq!(Vec::<f32>::try_from(&v).unwrap(), [7.0, 13.0, 19.0]);
        let whole = tch::Tensor::from_slice(&data);
        assert!(v.equal(&whole.as_strided([3], [6], Some(7))));
        // The last element is index 23: one more step, or one more offset, is outside.
        assert!(b.tensor_view(5, &[4], &[6]).is_ok());
        assert!(b.tensor_view(6, &[4], &[6]).is_err());
        assert!(b.tensor_view(-1, &[1], &[1]).is_err());
        assert!(b.tensor_view(0, &[2, 2], &[1]).is_err());
        // Empty views read nothing, wherever they say they start.
        assert_eq!(b.tensor_view(100, &[0], &[1]).unwrap().numel(), 0);
    }
}
