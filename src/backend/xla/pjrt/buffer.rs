//! `PJRT_Buffer`: an array on a device, and its element types.

use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, OnceLock};

use parking_lot::Mutex;
use smallvec::SmallVec;

use super::api::{Event, Fns};
use super::client::{host_byte_size, ClientInner};
use super::handoff;
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

/// [`Buffer`]s alive in this process (all clients together); see [`live_buffers`].
static LIVE_BUFFERS: AtomicUsize = AtomicUsize::new(0);

/// The number of PJRT buffers kiln owns right now, in the whole process (every client, every
/// thread): incremented when PJRT hands kiln a buffer (an upload or an execution's output),
/// decremented when the [`Buffer`] is dropped (`PJRT_Buffer_Destroy` follows at once, or,
/// once kiln's kernels are registered, on a thread of its own). Donated buffers count until
/// their wrapper is dropped.
///
/// For leak checks: a loop that replays a compiled function or a training step must leave this
/// count where it was once its results are dropped.
pub fn live_buffers() -> usize {
    LIVE_BUFFERS.load(Ordering::Relaxed)
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
    /// Serializes `PJRT_Buffer_{Increase,Decrease}ExternalReferenceCount` on this buffer: the
    /// C API wrapper keeps the references in a plain `std::vector` inside the `PJRT_Buffer`
    /// (push on increase, pop on decrease) with no lock of its own, so two threads reading
    /// the same buffer through `&Buffer` would otherwise race on it.
    external_refs: Mutex<()>,
    /// The completion of the last execution that took this buffer as an argument (when the
    /// plugin reports it): dropping the buffer before it completes would block in the plugin.
    last_use: Mutex<Option<Arc<Completion>>>,
    /// The address this buffer registered with the packed-weight cache (0: none); forgotten
    /// when the buffer is donated or destroyed ([`Buffer::mark_weight_source`]).
    weight_address: AtomicUsize,
    /// The host tensor whose memory this buffer's storage is, for a buffer lent that memory
    /// ([`Client::lend_tch`](super::Client::lend_tch)); released once the plugin lets go.
    lease: Option<HostLease>,
    /// Whether [`Buffer::is_plain_array`] is known to hold (see [`Buffer::mark_plain`]).
    plain: bool,
}

/// A libtorch tensor whose memory a buffer uses as its storage (a zero-copy upload), with
/// the plugin's `done_with_host_buffer` event, which completes once the buffer's storage is
/// released. Holding a handle on the tensor keeps the memory allocated until then.
pub(crate) struct HostLease {
    /// `None` if the plugin gave no event: the tensor is then kept until the buffer is
    /// destroyed.
    done: Option<NonNull<sys::PJRT_Event>>,
    tensor: tch::Tensor,
}

impl HostLease {
    /// Takes ownership of `done` (the event of the upload that made a buffer of `tensor`'s
    /// memory).
    pub(crate) fn new(done: Option<NonNull<sys::PJRT_Event>>, tensor: tch::Tensor) -> HostLease {
        HostLease { done, tensor }
    }

    /// Waits until the plugin has let go of the memory, then drops the event and the tensor.
    /// The buffer must be destroyed first: the event completes only then.
    pub(crate) fn release(self, client: &ClientInner) {
        if let Some(done) = self.done {
            let api = client.api();
            // SAFETY: `done` is a live event owned by the lease, awaited and destroyed once,
            // here.
            unsafe {
                let waited = api.await_event(done, "done_with_host_buffer");
                if let Err(e) = waited {
                    if cfg!(debug_assertions) {
                        eprintln!("kiln: ignoring error in cleanup: {e}");
                    }
                }
                api.destroy_event(done);
            }
        }
        drop(self.tensor);
    }
}

// SAFETY: a `PJRT_Event` may be awaited and destroyed from any thread, and a `tch::Tensor`
// handle may be dropped from any thread (libtorch's reference counts are atomic).
unsafe impl Send for HostLease {}

// SAFETY: a `PJRT_Buffer` is not tied to a thread, and `xla::PjRtBuffer` (which the C API
// wraps) is thread-safe: queries, transfers and deletion may be issued from any thread.
unsafe impl Send for Buffer {}
// SAFETY: see `Send`; `&Buffer` only allows thread-safe PJRT calls.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// Takes ownership of a buffer created by `client`.
    pub(crate) fn from_raw(client: &Arc<ClientInner>, raw: NonNull<sys::PJRT_Buffer>) -> Buffer {
        LIVE_BUFFERS.fetch_add(1, Ordering::Relaxed);
        Buffer {
            client: Arc::clone(client),
            raw,
            external_refs: Mutex::new(()),
            last_use: Mutex::new(None),
            weight_address: AtomicUsize::new(0),
            lease: None,
            plain: false,
        }
    }

    /// Takes ownership of a buffer created by `client` whose storage is `lease`'s memory.
    pub(crate) fn leased(
        client: &Arc<ClientInner>,
        raw: NonNull<sys::PJRT_Buffer>,
        lease: HostLease,
    ) -> Buffer {
        let mut b = Buffer::from_raw(client, raw);
        b.lease = Some(lease);
        b
    }

    /// Registers this buffer's address with the packed-weight cache (`kernels::weights`),
    /// once: an execution is about to read it as a variable, and packed weights computed
    /// from it may be kept until it is donated or destroyed. Skipped while the buffer is not
    /// ready (its storage may not exist yet) or when the plugin cannot give the address:
    /// kernels then pack without keeping the result.
    pub(crate) fn mark_weight_source(&self) {
        if self.weight_address.load(Ordering::Acquire) != 0 {
            return;
        }
        let Some(read) = self.client.direct_read.as_ref() else {
            return;
        };
        if !self.is_ready_now() {
            return;
        }
        let Some(address) = read.address(self) else {
            return;
        };
        if self
            .weight_address
            .compare_exchange(0, address, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            crate::backend::xla::kernels::weights::register(address);
        }
    }

    /// The address of the buffer's storage, as an identity only (nothing is read through
    /// it); `None` where the plugin has no direct read (not a CPU plugin) or does not say.
    pub(crate) fn storage_address(&self) -> Option<usize> {
        self.client.direct_read.as_ref()?.address(self)
    }

    /// Forgets this buffer's registration with the packed-weight cache (before it is
    /// donated: its memory is about to hold the execution's output).
    pub(crate) fn forget_weight_source(&self) {
        let address = self.weight_address.swap(0, Ordering::AcqRel);
        if address != 0 {
            crate::backend::xla::kernels::weights::forget(address);
        }
    }

    /// Records that an execution that completes with `done` reads this buffer.
    pub(crate) fn used_by(&self, done: &Arc<Completion>) {
        *self.last_use.lock() = Some(Arc::clone(done));
    }

    /// Whether an execution's completion is recorded on this buffer.
    #[cfg(test)]
    pub(crate) fn has_last_use(&self) -> bool {
        self.last_use.lock().is_some()
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
        Ok(self.dim_list()?.into_vec())
    }

    /// [`Buffer::dims`] without allocating for up to 8 of them (a download asks for them on
    /// every call).
    fn dim_list(&self) -> Result<SmallVec<[i64; 8]>> {
        let api = self.client.api();
        let mut args = sys::PJRT_Buffer_Dimensions_Args::new();
        args.buffer = self.raw();
        // SAFETY: live buffer, valid args struct.
        let err = unsafe { (api.fns.PJRT_Buffer_Dimensions)(&mut args) };
        api.check("PJRT_Buffer_Dimensions", err)?;
        if args.num_dims == 0 || args.dims.is_null() {
            return Ok(SmallVec::new());
        }
        // SAFETY: the plugin returned `num_dims` dimensions owned by the live buffer.
        Ok(SmallVec::from_slice(unsafe {
            std::slice::from_raw_parts(args.dims, args.num_dims)
        }))
    }

    /// Bytes of the dense host copy: `product(dims) * element_type().byte_size()`.
    ///
    /// # Errors
    /// As [`Buffer::element_type`] and [`Buffer::dims`].
    pub fn host_size(&self) -> Result<usize> {
        host_byte_size(self.element_type()?, &self.dim_list()?)
    }

    /// Copies the buffer into `dst` (dense, row-major), blocking until the copy is done (and
    /// so until the buffer has been computed).
    ///
    /// On a host-memory platform (the CPU plugin: see [`Client::reads_buffers_directly`])
    /// the bytes are copied straight out of the buffer's memory once it is ready, without
    /// `PJRT_Buffer_ToHostBuffer`, whose copy the CPU plugin runs on a worker thread (thread
    /// hand-offs: ~25 µs per call for a small array, against ~0.3 µs). It is used only when
    /// the buffer's layout is the dense row-major one `dst` expects; whenever a condition
    /// does not hold or a step fails, `to_host` falls back to `PJRT_Buffer_ToHostBuffer`,
    /// which also reports the error, so errors are those of that call.
    ///
    /// [`Client::reads_buffers_directly`]: super::Client::reads_buffers_directly
    ///
    /// # Errors
    /// [`Error::Invalid`] if `dst.len()` is not [`Buffer::host_size`]; [`Error::Pjrt`] if the
    /// buffer was deleted (donated) or its computation failed.
    pub fn to_host(&self, dst: &mut [u8]) -> Result<()> {
        let rank = self.check_host_size(dst)?;
        self.to_host_sized(dst, rank)
    }

    /// [`Buffer::to_host`] into `dst` of the right size (checked by the caller) for a buffer
    /// of rank `rank`.
    fn to_host_sized(&self, dst: &mut [u8], rank: usize) -> Result<()> {
        if let Some(direct) = &self.client.direct_read {
            // Empty arrays may have no storage at all (a null address): not worth a case.
            if !dst.is_empty() && direct.read(self, rank, dst) {
                return Ok(());
            }
        }
        self.to_host_via_transfer_unchecked(dst)
    }

    /// [`Buffer::to_host`] by the direct read only: `Ok(false)` (and `dst` unspecified) where
    /// it does not apply or fails; for tests.
    #[cfg(test)]
    pub(crate) fn to_host_direct(&self, dst: &mut [u8]) -> Result<bool> {
        let rank = self.check_host_size(dst)?;
        Ok(match &self.client.direct_read {
            Some(direct) if !dst.is_empty() => direct.read(self, rank, dst),
            _ => false,
        })
    }

    /// Runs `f` while holding an external reference on the buffer, as the direct read does;
    /// `None` if there is no direct read or the reference is refused. For tests.
    #[cfg(test)]
    pub(crate) fn with_external_reference<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        let direct = self.client.direct_read.as_ref()?;
        let _reference = ExternalReference::acquire(self, direct)?;
        Some(f())
    }

    /// [`Buffer::to_host`] through `PJRT_Buffer_ToHostBuffer` only (the path used where the
    /// direct read does not apply); for tests and measurements.
    #[cfg(test)]
    pub(crate) fn to_host_via_transfer(&self, dst: &mut [u8]) -> Result<()> {
        self.check_host_size(dst)?;
        self.to_host_via_transfer_unchecked(dst)
    }

    /// `Err(Error::Invalid)` unless `dst` has exactly [`Buffer::host_size`] bytes; the rank.
    fn check_host_size(&self, dst: &[u8]) -> Result<usize> {
        let ty = self.element_type()?;
        let dims = self.dim_list()?;
        let expected = host_byte_size(ty, &dims)?;
        if dst.len() != expected {
            return Err(Error::Invalid(format!(
                "to_host: destination has {} bytes, the buffer {ty}{dims:?} needs {expected}",
                dst.len()
            )));
        }
        Ok(dims.len())
    }

    /// `PJRT_Buffer_ToHostBuffer` into `dst`, which has exactly [`Buffer::host_size`] bytes.
    fn to_host_via_transfer_unchecked(&self, dst: &mut [u8]) -> Result<()> {
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

    /// Copies the buffer into a new contiguous CPU libtorch tensor of `kind`, whose element
    /// size must be the buffer's (waits for the buffer). Unlike [`Buffer::to_host_vec`]
    /// followed by a tensor built from the bytes, the tensor's memory is written once and never
    /// zero-filled first: libtorch fills a tensor of 32,768 elements or more with an OpenMP
    /// parallel loop, whose worker then spins on a core XLA's next execution needs (bert's
    /// `[4, 64, 256]` output: 22.9 ms a call instead of 16.7 ms under OpenMP's default wait
    /// policy).
    ///
    /// # Errors
    /// [`Error::Invalid`] if `kind`'s element size differs from the buffer's; as
    /// [`Buffer::to_host`].
    pub fn to_tch(&self, kind: tch::Kind) -> Result<tch::Tensor> {
        self.to_tch_of(kind, &self.dim_list()?)
    }

    /// [`Buffer::to_tch`] of a buffer the caller expects to have `shape`: an error if its
    /// dims differ, so the caller may type the tensor without asking libtorch for its sizes.
    pub(crate) fn to_tch_shaped(&self, kind: tch::Kind, shape: &[usize]) -> Result<tch::Tensor> {
        let dims = self.dim_list()?;
        if dims.len() != shape.len() || dims.iter().zip(shape).any(|(&d, &s)| d as usize != s) {
            return Err(Error::Internal(format!(
                "to_tch: a buffer of dims {dims:?} was expected to have shape {shape:?}"
            )));
        }
        self.to_tch_of(kind, &dims)
    }

    /// [`Buffer::to_tch`] of a buffer whose dims are `dims` (as the plugin gave them).
    fn to_tch_of(&self, kind: tch::Kind, dims: &[i64]) -> Result<tch::Tensor> {
        let size = host_byte_size(self.element_type()?, dims)?;
        // `size` is the buffer's host size: from its element type and dims just above.
        new_tch_filled(kind, dims, size, |dst| self.to_host_sized(dst, dims.len()))
    }

    /// Whether the direct read applies to this buffer as a dense row-major array of `dims`
    /// with elements of `element_size` bytes, stored in exactly its host size: the checks
    /// [`DirectRead::read`] makes on every read, made once. An executable's output `i` has
    /// the same shape and layout on every execution (static shapes), so the answer for one
    /// execution's output holds for the others' ([`Buffer::into_tch_plain`]).
    pub(crate) fn is_plain_array(&self, dims: &[usize], element_size: usize) -> bool {
        let Some(direct) = &self.client.direct_read else {
            return false;
        };
        if self.lease.is_some() {
            return false;
        }
        let Ok(ty) = self.element_type() else {
            return false;
        };
        let Ok(got) = self.dim_list() else {
            return false;
        };
        if ty.byte_size() != element_size
            || got.len() != dims.len()
            || got
                .iter()
                .zip(dims)
                .any(|(&g, &d)| usize::try_from(g).ok() != Some(d))
        {
            return false;
        }
        direct.layout_is_dense(self, dims.len())
            && host_byte_size(ty, &got).ok() == self.on_device_size().ok()
    }

    /// Marks this buffer as an output that [`Buffer::is_plain_array`] holds for (as it did
    /// for the same output of an earlier execution of its executable).
    pub(crate) fn mark_plain(&mut self) {
        self.plain = true;
    }

    /// [`Buffer::to_tch_shaped`] of a buffer the caller gives up, with fewer plugin calls
    /// where it is marked plain ([`Buffer::mark_plain`]): the layout, type and dims checks
    /// were made once for its executable's output, and no external reference is taken,
    /// because no one else can donate, delete or write a buffer owned here (see
    /// [`DirectRead`], point 4). The LinearModel's result: 3 plugin calls besides the
    /// ready event's and 3 of the plugin's allocations, against 9 and 8 through
    /// [`Buffer::to_tch_shaped`].
    pub(crate) fn into_tch_plain(
        mut self,
        kind: tch::Kind,
        shape: &[usize],
    ) -> Result<tch::Tensor> {
        if !self.plain || self.lease.is_some() {
            return self.to_tch_shaped(kind, shape);
        }
        let dims: SmallVec<[i64; 8]> = shape.iter().map(|&d| d as i64).collect();
        let size = shape
            .iter()
            .try_fold(kind.elt_size_in_bytes(), |n, &d| n.checked_mul(d))
            .ok_or_else(|| Error::Invalid(format!("to_tch: shape {shape:?} overflows")))?;
        new_tch_filled(kind, &dims, size, |dst| {
            if self.read_plain(dst) {
                Ok(())
            } else {
                // Any error (a failed computation, a donated buffer) is the checked path's
                // to report.
                self.to_host_sized(dst, shape.len())
            }
        })
    }

    /// Copies this buffer, marked plain, into `dst` (non-empty) straight from its memory:
    /// `false`, with `dst` unspecified, where a step fails. [`DirectRead::read`] without its
    /// layout check (made once for the executable's output) and without an external
    /// reference: `&mut self` is the only handle on the buffer.
    fn read_plain(&mut self, dst: &mut [u8]) -> bool {
        let Some(direct) = &self.client.direct_read else {
            return false;
        };
        // Defined (point 3 of `DirectRead`), then sized (point 2), then the address (the
        // storage may only exist once the computation ran).
        if self.ready().is_err() || self.on_device_size().ok() != Some(dst.len()) {
            return false;
        }
        let Some(address) = direct.address(self) else {
            return false;
        };
        // SAFETY: the source is host memory of this process (point 1 of `DirectRead`: a
        // direct read exists only for CPU clients) of exactly `dst.len()` bytes (point 2: the
        // on-device size just checked), written and synchronized with (point 3: the ready
        // event awaited above), and kept allocated and unchanged during the copy (point 4,
        // without an external reference: the C API ties the address's validity to one
        // because another holder of the buffer could delete or donate it meanwhile; `&mut
        // self` is the only handle, and the storage is the plugin's own, not a lease's
        // (`into_tch_plain` checks), allocated for the buffer's lifetime). `dst` is a unique
        // borrow of other memory: the two cannot overlap.
        unsafe {
            ptr::copy_nonoverlapping(address as *const u8, dst.as_mut_ptr(), dst.len());
        }
        true
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

    /// Whether the buffer's contents are computed, without waiting (`false` also when the
    /// plugin cannot say, or the computation failed).
    pub(crate) fn is_ready_now(&self) -> bool {
        let api = self.client.api();
        let mut args = sys::PJRT_Buffer_ReadyEvent_Args::new();
        args.buffer = self.raw();
        // SAFETY: live buffer, valid args struct.
        let err = unsafe { (api.fns.PJRT_Buffer_ReadyEvent)(&mut args) };
        let event = Event::new(api, args.event);
        if api.check("PJRT_Buffer_ReadyEvent", err).is_err() {
            return false;
        }
        match event {
            // SAFETY: the event is live (owned by `e`, destroyed when it drops).
            Some(e) => (unsafe { api.event_is_ready(e.raw()) }) == Some(true),
            None => true,
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

/// The direct host read of [`Buffer::to_host`] on host-memory platforms: the optional
/// `PJRT_Api` slots it calls, copied out of the table when a client is created.
///
/// # Why the read is sound
///
/// [`DirectRead::read`] copies `dst.len()` bytes from the address that
/// `PJRT_Buffer_OpaqueDeviceMemoryDataPointer` returns. That is sound because:
///
/// 1. *The address is a host address of this process.* A `DirectRead` exists only for clients
///    of the platform `cpu` (checked in `Client::new`), whose buffers all live in host memory
///    allocated by the plugin in this process.
/// 2. *The memory holds at least `dst.len()` bytes.* `PJRT_Buffer_OnDeviceSizeInBytes` (the
///    size of the buffer's storage for its on-device shape) must equal `dst.len()`, which
///    `to_host` has checked to be the dense host size.
/// 3. *The contents are written, and the writes are visible.* The buffer's ready event is
///    awaited (without error) first: it completes when the computation or transfer defining
///    the buffer has finished, and awaiting it synchronizes with that completion.
/// 4. *The memory stays allocated and unmodified during the copy.* An external reference
///    (`PJRT_Buffer_IncreaseExternalReferenceCount`) is held from before the address is
///    taken until after the copy; the C API documents the address as valid only while the
///    count is above zero. The reference is a hold on the buffer's storage that (a) owns a
///    count on the storage, so it stays allocated even if the buffer is deleted meanwhile,
///    and (b) makes PJRT refuse to donate the buffer, donation being the only way PJRT
///    writes into a defined buffer. On the CPU plugin an execution that would donate it
///    runs anyway, but with the buffer as a plain input and a fresh output ("donation by
///    copy", `allow_fallback_for_donation` in XLA's CPU client); other plugins fail it.
///    Either way the memory is not written (checked by the test
///    `external_reference_blocks_donation`). A donation that came first makes the buffer
///    deleted, and taking the reference then fails. The `PJRT_Buffer` itself cannot be
///    destroyed during the read: that needs the `Buffer` by value, and `to_host` borrows
///    it. A buffer's storage is the plugin's own, except for a lent buffer
///    (`Client::lend_tch`), whose storage is a libtorch tensor's memory that the lease keeps
///    allocated and the lender keeps unchanged while the buffer lives.
/// 5. *Taking and dropping the reference is itself race-free.* The C wrapper keeps external
///    references in an unsynchronized vector in the `PJRT_Buffer`; kiln serializes both
///    calls with the `Buffer`'s own lock (`Buffer::external_refs`).
/// 6. *The copy does not overlap `dst`*, a unique borrow of kiln's memory, and copies bytes
///    (`u8`, no alignment or validity requirement).
///
/// Whether the bytes are the *right* ones (not a safety matter) is checked by the layout:
/// `PJRT_Buffer_GetMemoryLayout` must report a tiled layout without tiles whose
/// `minor_to_major` is `[rank-1, ..., 0]` (row-major), and the size check (2) rules out
/// padding and packed sub-byte storage. Note the order: the ready event is awaited *before*
/// the reference is taken, because taking one reads the storage's address, and the CPU
/// plugin may allocate an output's storage only when the computation producing it runs
/// (`CpuDeviceMemory::CreateDelayedMemory`).
#[derive(Clone, Copy)]
pub(crate) struct DirectRead {
    get_memory_layout: sys::PJRT_Buffer_GetMemoryLayout,
    increase_external_reference_count: sys::PJRT_Buffer_IncreaseExternalReferenceCount,
    decrease_external_reference_count: sys::PJRT_Buffer_DecreaseExternalReferenceCount,
    opaque_device_memory_data_pointer: sys::PJRT_Buffer_OpaqueDeviceMemoryDataPointer,
}

impl DirectRead {
    /// The direct read's functions, if the plugin has all of them.
    pub(crate) fn new(fns: &Fns) -> Option<DirectRead> {
        Some(DirectRead {
            get_memory_layout: fns.PJRT_Buffer_GetMemoryLayout?,
            increase_external_reference_count: fns.PJRT_Buffer_IncreaseExternalReferenceCount?,
            decrease_external_reference_count: fns.PJRT_Buffer_DecreaseExternalReferenceCount?,
            opaque_device_memory_data_pointer: fns.PJRT_Buffer_OpaqueDeviceMemoryDataPointer?,
        })
    }

    /// The address of `buffer`'s storage (`PJRT_Buffer_OpaqueDeviceMemoryDataPointer`), as an
    /// identity only: nothing is read through it. `None` if the plugin does not say.
    pub(crate) fn address(&self, buffer: &Buffer) -> Option<usize> {
        let mut pointer = sys::PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args::new();
        pointer.buffer = buffer.raw();
        // SAFETY: live buffer (borrowed), valid args struct.
        let err = unsafe { (self.opaque_device_memory_data_pointer)(&mut pointer) };
        let api = buffer.client.api();
        if api
            .check("PJRT_Buffer_OpaqueDeviceMemoryDataPointer", err)
            .is_err()
        {
            return None;
        }
        Some(pointer.device_memory_ptr as usize).filter(|&a| a != 0)
    }

    /// Copies `buffer`, of rank `rank`, into `dst` (non-empty, exactly the dense host size)
    /// straight from its memory; `false`, with `dst` unspecified, if the direct read does not
    /// apply or a step failed (the caller then uses `PJRT_Buffer_ToHostBuffer`, which reports
    /// any error).
    fn read(&self, buffer: &Buffer, rank: usize, dst: &mut [u8]) -> bool {
        let api = buffer.client.api();
        let raw = buffer.raw();
        if !self.layout_is_dense(buffer, rank) {
            return false;
        }
        // Size (soundness point 2 of `DirectRead`).
        if buffer.on_device_size().ok() != Some(dst.len()) {
            return false;
        }
        // Defined (point 3): an error here (computation failed, buffer donated) is reported
        // by the fallback.
        if buffer.ready().is_err() {
            return false;
        }
        // Held (point 4) until `_reference` is dropped, after the copy.
        let Some(_reference) = ExternalReference::acquire(buffer, self) else {
            return false;
        };
        let mut pointer = sys::PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args::new();
        pointer.buffer = raw;
        // SAFETY: live buffer, valid args struct.
        let err = unsafe { (self.opaque_device_memory_data_pointer)(&mut pointer) };
        if api
            .check("PJRT_Buffer_OpaqueDeviceMemoryDataPointer", err)
            .is_err()
            || pointer.device_memory_ptr.is_null()
        {
            return false;
        }
        // SAFETY: see "Why the read is sound" on `DirectRead`: the source is host memory of
        // this process (1) of at least `dst.len()` bytes (2), fully written and synchronized
        // with (3), kept allocated and unmodified by the external reference `_reference`
        // held across this copy (4); it cannot overlap `dst`, a unique borrow (6).
        unsafe {
            ptr::copy_nonoverlapping(
                pointer.device_memory_ptr.cast::<u8>().cast_const(),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        true
    }
}

impl DirectRead {
    /// Whether `buffer`'s layout is the dense row-major one of a host array of rank `rank`
    /// (`false` also where the plugin fails the query).
    fn layout_is_dense(&self, buffer: &Buffer, rank: usize) -> bool {
        let mut layout = sys::PJRT_Buffer_GetMemoryLayout_Args::new();
        layout.buffer = buffer.raw();
        // SAFETY: live buffer, valid args struct.
        let err = unsafe { (self.get_memory_layout)(&mut layout) };
        buffer
            .client
            .api()
            .check("PJRT_Buffer_GetMemoryLayout", err)
            .is_ok()
            && is_dense_row_major(&layout.layout, rank)
    }
}

/// A new contiguous CPU tensor of `kind` and `dims` holding `size` bytes, written by `fill`
/// (not zero-filled first; see [`Buffer::to_tch`]).
fn new_tch_filled(
    kind: tch::Kind,
    dims: &[i64],
    size: usize,
    fill: impl FnOnce(&mut [u8]) -> Result<()>,
) -> Result<tch::Tensor> {
    let t = crate::backend::xla::kernels::onednn::empty_cpu(kind, dims)?;
    // `empty` of `dims` holds their product of elements (counted here: tch's `numel` fetches
    // the sizes into a new `Vec` through two FFI calls).
    let numel = dims
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?));
    if numel.and_then(|n| n.checked_mul(kind.elt_size_in_bytes())) != Some(size) {
        return Err(Error::Invalid(format!(
            "to_tch: a {kind:?} tensor of dims {dims:?} does not hold the buffer's {size} bytes"
        )));
    }
    if size > 0 {
        let p = t.data_ptr().cast::<u8>();
        if p.is_null() {
            return Err(Error::Invalid("to_tch: libtorch gave no storage".into()));
        }
        // SAFETY: `t` is a new contiguous CPU tensor (`empty`) owning `size` bytes at `p`;
        // nothing else refers to its storage while the slice lives (it is dropped before `t`
        // is returned).
        let dst = unsafe { std::slice::from_raw_parts_mut(p, size) };
        fill(dst)?;
    }
    Ok(t)
}

/// Whether a buffer layout is the dense row-major one of a host array of rank `rank`.
fn is_dense_row_major(layout: &sys::PJRT_Buffer_MemoryLayout, rank: usize) -> bool {
    if layout.type_ != sys::PJRT_Buffer_MemoryLayout_Type_Tiled {
        return false;
    }
    // SAFETY: `type_` says that `tiled` is the union's live member (and it is plain data: any
    // bit pattern is a valid value).
    let tiled = unsafe { layout.u.tiled };
    if tiled.num_tiles != 0 || tiled.minor_to_major_size != rank {
        return false;
    }
    if rank == 0 {
        return true;
    }
    if tiled.minor_to_major.is_null() {
        return false;
    }
    // SAFETY: the plugin returned `minor_to_major_size` (= `rank`) dimension numbers, owned by
    // the buffer, which is alive (borrowed by the caller).
    let minor_to_major = unsafe { std::slice::from_raw_parts(tiled.minor_to_major, rank) };
    minor_to_major
        .iter()
        .enumerate()
        .all(|(i, &d)| usize::try_from(d) == Ok(rank - 1 - i))
}

/// An external reference on a buffer (`PJRT_Buffer_IncreaseExternalReferenceCount`), dropped
/// (`PJRT_Buffer_DecreaseExternalReferenceCount`) on drop.
struct ExternalReference<'a> {
    buffer: &'a Buffer,
    decrease: sys::PJRT_Buffer_DecreaseExternalReferenceCount,
}

impl<'a> ExternalReference<'a> {
    /// Takes a reference; `None` if the plugin refuses (e.g. the buffer was deleted).
    fn acquire(buffer: &'a Buffer, direct: &DirectRead) -> Option<ExternalReference<'a>> {
        let api = buffer.client.api();
        let mut args = sys::PJRT_Buffer_IncreaseExternalReferenceCount_Args::new();
        args.buffer = buffer.raw();
        let err = {
            let _serialized = buffer.external_refs.lock();
            // SAFETY: live buffer, valid args struct; calls that change the buffer's external
            // references are serialized by `external_refs` (see there).
            unsafe { (direct.increase_external_reference_count)(&mut args) }
        };
        api.check("PJRT_Buffer_IncreaseExternalReferenceCount", err)
            .ok()
            .map(|()| ExternalReference {
                buffer,
                decrease: direct.decrease_external_reference_count,
            })
    }
}

impl Drop for ExternalReference<'_> {
    fn drop(&mut self) {
        let api = self.buffer.client.api();
        let mut args = sys::PJRT_Buffer_DecreaseExternalReferenceCount_Args::new();
        args.buffer = self.buffer.raw();
        let err = {
            let _serialized = self.buffer.external_refs.lock();
            // SAFETY: live buffer (borrowed by `self`), valid args struct; drops the reference
            // this guard took (the count is above zero), serialized like the increase.
            unsafe { (self.decrease)(&mut args) }
        };
        api.ignore_error("PJRT_Buffer_DecreaseExternalReferenceCount", err);
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        LIVE_BUFFERS.fetch_sub(1, Ordering::Relaxed);
        let dying = Dying {
            client: self.client.clone(),
            raw: self.raw,
            weight_address: *self.weight_address.get_mut(),
            lease: self.lease.take(),
        };
        // Destroying a buffer that a running execution still uses blocks until that
        // execution is done, and a thread blocked in the plugin cannot run the kernel jobs
        // XLA's workers hand over (see `handoff`): a training step's replaced parameters
        // would then make its kernels run on the workers. With kernels registered, such
        // buffers are destroyed on a thread of their own instead (the others right here: a
        // hand-over to that thread costs more than the destroy).
        let last_use = self.last_use.get_mut().take();
        let in_use = last_use.as_ref().is_some_and(|done| !done.is_ready());
        if in_use && dying.lease.is_some() {
            // A lent buffer's memory is its caller's tensor, which may change once the buffer
            // is dropped: wait here for the executions reading it (serving handed-over
            // kernels meanwhile), then destroy it here.
            if let Some(done) = last_use {
                done.wait();
            }
        } else if in_use && handoff::enabled() {
            if let Some(tx) = RELEASER.get_or_init(spawn_releaser) {
                // A failed send hands the buffer back, and dropping it destroys it here.
                let _ = tx.send(dying);
            }
        }
    }
}

/// The completion event of one execution on one device (`device_complete_events` of
/// `PJRT_LoadedExecutable_Execute`), destroyed on drop.
pub(crate) struct Completion {
    client: Arc<ClientInner>,
    raw: NonNull<sys::PJRT_Event>,
}

// SAFETY: a `PJRT_Event` may be queried and destroyed from any thread.
unsafe impl Send for Completion {}
// SAFETY: as above; `is_ready` only reads the event.
unsafe impl Sync for Completion {}

impl Completion {
    /// Takes ownership of an event the plugin returned; `None` for a null event.
    pub(crate) fn new(client: &Arc<ClientInner>, raw: *mut sys::PJRT_Event) -> Option<Completion> {
        NonNull::new(raw).map(|raw| Completion {
            client: Arc::clone(client),
            raw,
        })
    }

    /// Whether the execution is done (`true` also if the plugin cannot say: callers then
    /// behave as without the event).
    fn is_ready(&self) -> bool {
        // SAFETY: `self.raw` is a live event owned by `self`.
        unsafe { self.client.api().event_is_ready(self.raw) }.unwrap_or(true)
    }

    /// Blocks until the execution is done (an error it ended with is the execution's
    /// outputs' to report, not this wait's).
    fn wait(&self) {
        // SAFETY: `self.raw` is a live event owned by `self`, not destroyed during the wait.
        let _ = unsafe {
            self.client
                .api()
                .await_event(self.raw, "PJRT_LoadedExecutable_Execute")
        };
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        // SAFETY: the event is owned by this wrapper and destroyed exactly once, here.
        unsafe { self.client.api().destroy_event(self.raw) };
    }
}

/// A buffer on its way to `PJRT_Buffer_Destroy` (on drop).
struct Dying {
    client: Arc<ClientInner>,
    raw: NonNull<sys::PJRT_Buffer>,
    /// Its registration with the packed-weight cache (0: none), forgotten just before it is
    /// destroyed.
    weight_address: usize,
    /// The host memory the buffer was lent, released after the buffer is destroyed.
    lease: Option<HostLease>,
}

// SAFETY: as for `Buffer`: a `PJRT_Buffer` may be destroyed from any thread.
unsafe impl Send for Dying {}

impl Drop for Dying {
    fn drop(&mut self) {
        let api = self.client.api();
        let mut args = sys::PJRT_Buffer_Destroy_Args::new();
        args.buffer = self.raw.as_ptr();
        // Forgotten before the memory can be reused by another buffer (a packed weight
        // cached under this address must never meet that buffer). A kernel of an execution
        // still reading this one can no longer cache under the address either.
        if self.weight_address != 0 {
            crate::backend::xla::kernels::weights::forget(self.weight_address);
        }
        // SAFETY: the buffer's only owner (its `Buffer` was dropped and handed it over) destroys
        // it exactly once, here; `self.client` keeps its client alive until after this call.
        let err = unsafe { (api.fns.PJRT_Buffer_Destroy)(&mut args) };
        api.ignore_error("PJRT_Buffer_Destroy", err);
        if let Some(lease) = self.lease.take() {
            lease.release(&self.client);
        }
    }
}

/// The channel to the thread that destroys dropped buffers (`None`: it could not be started;
/// buffers are then destroyed where they are dropped).
static RELEASER: OnceLock<Option<mpsc::Sender<Dying>>> = OnceLock::new();

fn spawn_releaser() -> Option<mpsc::Sender<Dying>> {
    let (tx, rx) = mpsc::channel::<Dying>();
    std::thread::Builder::new()
        .name("kiln-buffer-release".into())
        .spawn(move || rx.into_iter().for_each(drop))
        .ok()
        .map(|_| tx)
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
