//! `PJRT_Buffer`: an array on a device, and its element types.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use super::api::Event;
use super::client::{host_byte_size, ClientInner};
use super::sys::{self, Args};
use crate::error::{Error, Result};

/// Element types of device buffers (the subset of `PJRT_Buffer_Type` kiln uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementType {
    /// Boolean, one byte per element (0 or 1).
    Pred,
    /// Signed 8-bit integer.
    S8,
    /// Signed 16-bit integer.
    S16,
    /// Signed 32-bit integer.
    S32,
    /// Signed 64-bit integer.
    S64,
    /// Unsigned 8-bit integer.
    U8,
    /// Unsigned 16-bit integer.
    U16,
    /// Unsigned 32-bit integer.
    U32,
    /// Unsigned 64-bit integer.
    U64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
}

impl ElementType {
    /// All element types, in declaration order.
    pub const ALL: [ElementType; 13] = [
        ElementType::Pred,
        ElementType::S8,
        ElementType::S16,
        ElementType::S32,
        ElementType::S64,
        ElementType::U8,
        ElementType::U16,
        ElementType::U32,
        ElementType::U64,
        ElementType::F16,
        ElementType::BF16,
        ElementType::F32,
        ElementType::F64,
    ];

    /// Bytes per element in a dense host array.
    pub fn byte_size(self) -> usize {
        match self {
            ElementType::Pred | ElementType::S8 | ElementType::U8 => 1,
            ElementType::S16 | ElementType::U16 | ElementType::F16 | ElementType::BF16 => 2,
            ElementType::S32 | ElementType::U32 | ElementType::F32 => 4,
            ElementType::S64 | ElementType::U64 | ElementType::F64 => 8,
        }
    }

    /// The XLA name of the type (`pred`, `s32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ElementType::Pred => "pred",
            ElementType::S8 => "s8",
            ElementType::S16 => "s16",
            ElementType::S32 => "s32",
            ElementType::S64 => "s64",
            ElementType::U8 => "u8",
            ElementType::U16 => "u16",
            ElementType::U32 => "u32",
            ElementType::U64 => "u64",
            ElementType::F16 => "f16",
            ElementType::BF16 => "bf16",
            ElementType::F32 => "f32",
            ElementType::F64 => "f64",
        }
    }

    pub(crate) fn to_pjrt(self) -> sys::PJRT_Buffer_Type {
        match self {
            ElementType::Pred => sys::PJRT_Buffer_Type_PRED,
            ElementType::S8 => sys::PJRT_Buffer_Type_S8,
            ElementType::S16 => sys::PJRT_Buffer_Type_S16,
            ElementType::S32 => sys::PJRT_Buffer_Type_S32,
            ElementType::S64 => sys::PJRT_Buffer_Type_S64,
            ElementType::U8 => sys::PJRT_Buffer_Type_U8,
            ElementType::U16 => sys::PJRT_Buffer_Type_U16,
            ElementType::U32 => sys::PJRT_Buffer_Type_U32,
            ElementType::U64 => sys::PJRT_Buffer_Type_U64,
            ElementType::F16 => sys::PJRT_Buffer_Type_F16,
            ElementType::BF16 => sys::PJRT_Buffer_Type_BF16,
            ElementType::F32 => sys::PJRT_Buffer_Type_F32,
            ElementType::F64 => sys::PJRT_Buffer_Type_F64,
        }
    }

    pub(crate) fn from_pjrt(ty: sys::PJRT_Buffer_Type) -> Option<ElementType> {
        ElementType::ALL.into_iter().find(|t| t.to_pjrt() == ty)
    }
}

impl fmt::Display for ElementType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An array on a device, owned by kiln (`PJRT_Buffer_Destroy` on drop).
///
/// Buffers returned by [`LoadedExecutable::execute`](super::LoadedExecutable::execute) may
/// still be being computed; reading them ([`Buffer::to_host`]) or [`Buffer::ready`] waits.
/// A buffer donated to an execution (an input aliased to an output) is deleted by PJRT: it
/// reports [`Buffer::is_deleted`] and can no longer be read or passed to an execution.
pub struct Buffer {
    client: Arc<ClientInner>,
    raw: NonNull<sys::PJRT_Buffer>,
}

// SAFETY: a `PJRT_Buffer` is not tied to a thread, and `xla::PjRtBuffer` (which the C API
// wraps) is thread-safe: queries, transfers and deletion may be issued from any thread.
unsafe impl Send for Buffer {}
// SAFETY: see `Send`; `&Buffer` only allows thread-safe PJRT calls.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// Takes ownership of a buffer created by `client`.
    pub(crate) fn from_raw(client: &Arc<ClientInner>, raw: NonNull<sys::PJRT_Buffer>) -> Buffer {
        Buffer {
            client: Arc::clone(client),
            raw,
        }
    }

    pub(crate) fn raw(&self) -> *mut sys::PJRT_Buffer {
        self.raw.as_ptr()
    }

    pub(crate) fn client(&self) -> &Arc<ClientInner> {
        &self.client
    }

    /// The element type.
    ///
    /// # Errors
    /// [`Error::Pjrt`] if the plugin fails the query; [`Error::Unsupported`] for an element
    /// type kiln does not model (complex, 8-bit floats, ...).
    pub fn element_type(&self) -> Result<ElementType> {
        let api = self.client.api();
        let mut args = sys::PJRT_Buffer_ElementType_Args::new();
        args.buffer = self.raw();
        // SAFETY: live buffer, valid args struct.
        let err = unsafe { (api.fns.PJRT_Buffer_ElementType)(&mut args) };
        api.check("PJRT_Buffer_ElementType", err)?;
        ElementType::from_pjrt(args.type_).ok_or_else(|| Error::Unsupported {
            backend: "xla".into(),
            what: format!("PJRT buffer element type {}", args.type_),
        })
    }

    /// The dimensions (row-major, major to minor).
    ///
    /// # Errors
    /// [`Error::Pjrt`] if the plugin fails the query.
    pub fn dims(&self) -> Result<Vec<i64>> {
        let api = self.client.api();
        let mut args = sys::PJRT_Buffer_Dimensions_Args::new();
        args.buffer = self.raw();
        // SAFETY: live buffer, valid args struct.
        let err = unsafe { (api.fns.PJRT_Buffer_Dimensions)(&mut args) };
        api.check("PJRT_Buffer_Dimensions", err)?;
        if args.num_dims == 0 || args.dims.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: the plugin returned `num_dims` dimensions owned by the live buffer.
        Ok(unsafe { std::slice::from_raw_parts(args.dims, args.num_dims) }.to_vec())
    }

    /// Bytes of the dense host copy: `product(dims) * element_type().byte_size()`.
    ///
    /// # Errors
    /// As [`Buffer::element_type`] and [`Buffer::dims`].
    pub fn host_size(&self) -> Result<usize> {
        host_byte_size(self.element_type()?, &self.dims()?)
    }

    /// Copies the buffer into `dst` (dense, row-major), blocking until the copy is done (and
    /// so until the buffer has been computed).
    ///
    /// # Errors
    /// [`Error::Invalid`] if `dst.len()` is not [`Buffer::host_size`]; [`Error::Pjrt`] if the
    /// buffer was deleted (donated) or its computation failed.
    pub fn to_host(&self, dst: &mut [u8]) -> Result<()> {
        let ty = self.element_type()?;
        let dims = self.dims()?;
        let expected = host_byte_size(ty, &dims)?;
        if dst.len() != expected {
            return Err(Error::Invalid(format!(
                "to_host: destination has {} bytes, the buffer {ty}{dims:?} needs {expected}",
                dst.len()
            )));
        }
        let api = self.client.api();
        let mut args = sys::PJRT_Buffer_ToHostBuffer_Args::new();
        args.src = self.raw();
        args.dst = dst.as_mut_ptr().cast();
        args.dst_size = dst.len();
        // SAFETY: live buffer; `dst` has exactly the size of the dense host array and stays
        // mutably borrowed until the copy's event has been awaited below.
        let err = unsafe { (api.fns.PJRT_Buffer_ToHostBuffer)(&mut args) };
        let event = Event::new(api, args.event);
        let status = api.check("PJRT_Buffer_ToHostBuffer", err);
        // Even on error, wait until the plugin is done with `dst` before releasing it.
        let waited = match event {
            Some(event) => event.wait("PJRT_Buffer_ToHostBuffer"),
            None => Ok(()),
        };
        status.and(waited)
    }

    /// Copies the buffer into a new vector of [`Buffer::host_size`] bytes.
    ///
    /// # Errors
    /// As [`Buffer::to_host`].
    pub fn to_host_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.host_size()?];
        self.to_host(&mut v)?;
        Ok(v)
    }

    /// Blocks until the buffer's contents are computed (`PJRT_Buffer_ReadyEvent`).
    ///
    /// # Errors
    /// [`Error::Pjrt`] if the computation producing the buffer failed, or the buffer was
    /// deleted (donated).
    pub fn ready(&self) -> Result<()> {
        let api = self.client.api();
        let mut args = sys::PJRT_Buffer_ReadyEvent_Args::new();
        args.buffer = self.raw();
        // SAFETY: live buffer, valid args struct.
        let err = unsafe { (api.fns.PJRT_Buffer_ReadyEvent)(&mut args) };
        let event = Event::new(api, args.event);
        api.check("PJRT_Buffer_ReadyEvent", err)?;
        match event {
            Some(event) => event.wait("PJRT_Buffer_ReadyEvent"),
            None => Ok(()),
        }
    }

    /// Whether PJRT has deleted the buffer's storage (it was donated to an execution).
    ///
    /// # Errors
    /// [`Error::Pjrt`] if the plugin fails the query.
    pub fn is_deleted(&self) -> Result<bool> {
        let api = self.client.api();
        let mut args = sys::PJRT_Buffer_IsDeleted_Args::new();
        args.buffer = self.raw();
        // SAFETY: live buffer, valid args struct.
        let err = unsafe { (api.fns.PJRT_Buffer_IsDeleted)(&mut args) };
        api.check("PJRT_Buffer_IsDeleted", err)?;
        Ok(args.is_deleted)
    }

    /// Bytes the buffer occupies on the device (may exceed the host size: padding, tiling).
    ///
    /// # Errors
    /// [`Error::Pjrt`] if the plugin fails the query (e.g. the buffer was deleted).
    pub fn on_device_size(&self) -> Result<usize> {
        let api = self.client.api();
        let mut args = sys::PJRT_Buffer_OnDeviceSizeInBytes_Args::new();
        args.buffer = self.raw();
        // SAFETY: live buffer, valid args struct.
        let err = unsafe { (api.fns.PJRT_Buffer_OnDeviceSizeInBytes)(&mut args) };
        api.check("PJRT_Buffer_OnDeviceSizeInBytes", err)?;
        Ok(args.on_device_size_in_bytes)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let api = self.client.api();
        let mut args = sys::PJRT_Buffer_Destroy_Args::new();
        args.buffer = self.raw();
        // SAFETY: the buffer is owned by this wrapper and destroyed exactly once, here; the
        // client it belongs to is kept alive by `self.client` until after this call.
        let err = unsafe { (api.fns.PJRT_Buffer_Destroy)(&mut args) };
        api.ignore_error("PJRT_Buffer_Destroy", err);
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Buffer");
        match (self.element_type(), self.dims()) {
            (Ok(ty), Ok(dims)) => d.field("type", &ty).field("dims", &dims),
            _ => d.field("raw", &self.raw),
        };
        d.finish()
    }
}
