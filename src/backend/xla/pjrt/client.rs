//! `PJRT_Client`: compiling programs and creating device buffers.

use std::ffi::c_char;
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use super::api::{copy_string, Api, ApiInner, Event};
use super::buffer::{Buffer, DirectRead, ElementType, HostLease};
use super::executable::LoadedExecutable;
use super::sys::{self, Args};
use crate::error::{Error, Result};

/// The value of one plugin-specific client create option (`PJRT_NamedValue`), e.g. the CPU
/// plugin's `cpu_device_count` or a GPU plugin's `node_id` / `num_nodes`.
#[derive(Clone, Debug, PartialEq)]
pub enum NamedValue {
    /// `PJRT_NamedValue_kString`.
    Str(String),
    /// `PJRT_NamedValue_kInt64`.
    Int(i64),
    /// `PJRT_NamedValue_kInt64List`.
    IntList(Vec<i64>),
    /// `PJRT_NamedValue_kFloat`.
    Float(f32),
    /// `PJRT_NamedValue_kBool`.
    Bool(bool),
}

/// `options` as C named values; they borrow the names and the string and list values.
fn named_values(options: &[(String, NamedValue)]) -> Vec<sys::PJRT_NamedValue> {
    options
        .iter()
        .map(|(name, value)| {
            let mut nv = sys::PJRT_NamedValue::new();
            nv.name = name.as_ptr().cast::<c_char>();
            nv.name_size = name.len();
            match value {
                NamedValue::Str(v) => {
                    nv.type_ = sys::PJRT_NamedValue_kString;
                    nv.u.string_value = v.as_ptr().cast::<c_char>();
                    nv.value_size = v.len();
                }
                NamedValue::Int(v) => {
                    nv.type_ = sys::PJRT_NamedValue_kInt64;
                    nv.u.int64_value = *v;
                    nv.value_size = 1;
                }
                NamedValue::IntList(v) => {
                    nv.type_ = sys::PJRT_NamedValue_kInt64List;
                    nv.u.int64_array_value = v.as_ptr();
                    nv.value_size = v.len();
                }
                NamedValue::Float(v) => {
                    nv.type_ = sys::PJRT_NamedValue_kFloat;
                    nv.u.float_value = *v;
                    nv.value_size = 1;
                }
                NamedValue::Bool(v) => {
                    nv.type_ = sys::PJRT_NamedValue_kBool;
                    nv.u.bool_value = *v;
                    nv.value_size = 1;
                }
            }
            nv
        })
        .collect()
}

/// A PJRT client: one runtime instance of a plugin, owning its devices.
///
/// Cheap to clone (an `Arc`); buffers and executables created by a client keep it alive, so
/// the underlying `PJRT_Client` is destroyed only after the last of them is dropped.
///
/// `Client` is `Send + Sync`: the PJRT C API requires a client's methods to be thread-safe
/// (they wrap `xla::PjRtClient`, which is), so compiling, uploading and executing may happen
/// from several threads at once.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<ClientInner>,
}

/// What a [`Client`] shares with its clones, buffers and executables.
pub(crate) struct ClientInner {
    pub(crate) api: Api,
    pub(crate) raw: NonNull<sys::PJRT_Client>,
    /// Addressable devices, owned by the client and valid for its lifetime.
    devices: Vec<NonNull<sys::PJRT_Device>>,
    /// The functions of the direct host read of [`Buffer::to_host`], when buffers of this
    /// client live in host memory (platform `cpu`) and the plugin has every slot it needs;
    /// `None` otherwise (`to_host` then always uses `PJRT_Buffer_ToHostBuffer`).
    pub(crate) direct_read: Option<DirectRead>,
}

// SAFETY: a `PJRT_Client` is not tied to the thread that created it, and the PJRT C API
// requires client methods (compile, buffer creation, queries) to be thread-safe, as
// `xla::PjRtClient` is; the device handles are immutable objects owned by the client.
unsafe impl Send for ClientInner {}
// SAFETY: see `Send`: every method only passes the handles to thread-safe PJRT calls.
unsafe impl Sync for ClientInner {}

impl ClientInner {
    #[inline]
    pub(crate) fn api(&self) -> &ApiInner {
        self.api.inner()
    }
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        let api = self.api.inner();
        let mut args = sys::PJRT_Client_Destroy_Args::new();
        args.client = self.raw.as_ptr();
        // SAFETY: the client is owned by this wrapper and destroyed exactly once, here; every
        // buffer and executable holds an `Arc<ClientInner>`, so none outlives it.
        let err = unsafe { (api.fns.PJRT_Client_Destroy)(&mut args) };
        api.ignore_error("PJRT_Client_Destroy", err);
    }
}

impl Client {
    /// Creates a client of the plugin with default options.
    ///
    /// # Errors
    /// [`Error::Pjrt`] if the plugin cannot create a client (e.g. no device).
    pub fn new(api: &Api) -> Result<Client> {
        Client::create(api, &[], true)
    }

    /// Creates a client of the plugin with plugin-specific create options (names and types
    /// are the plugin's: the CPU plugin reads `cpu_device_count`, GPU plugins read
    /// `node_id`, `num_nodes`, `visible_devices`, ...).
    ///
    /// A plugin may ignore names it does not know (`xla-cpu-pjrt` 0.0.1 does) or reject them
    /// (newer CPU plugins).
    ///
    /// # Errors
    /// [`Error::Pjrt`] if the plugin rejects an option or cannot create a client.
    pub fn with_options(api: &Api, options: &[(String, NamedValue)]) -> Result<Client> {
        Client::create(api, options, true)
    }

    /// [`Client::new`], with the direct host read of [`Buffer::to_host`] allowed or not
    /// (`false`: every read goes through `PJRT_Buffer_ToHostBuffer`; for tests).
    #[cfg(test)]
    pub(crate) fn with_direct_read(api: &Api, allow_direct_read: bool) -> Result<Client> {
        Client::create(api, &[], allow_direct_read)
    }

    fn create(
        api: &Api,
        options: &[(String, NamedValue)],
        allow_direct_read: bool,
    ) -> Result<Client> {
        let a = api.inner();
        let values = named_values(options);
        let mut args = sys::PJRT_Client_Create_Args::new();
        args.create_options = values.as_ptr();
        args.num_options = values.len();
        // SAFETY: `args` is a valid args struct with no key-value callbacks; its `num_options`
        // named values, and the names, strings and lists they point into (`options`), outlive
        // the call (the plugin copies what it keeps).
        let err = unsafe { (a.fns.PJRT_Client_Create)(&mut args) };
        a.check("PJRT_Client_Create", err)?;
        let raw = NonNull::new(args.client).ok_or_else(|| Error::Pjrt {
            call: "PJRT_Client_Create",
            code: "INTERNAL".into(),
            message: "the plugin returned no client".into(),
        })?;
        // Owned from here on: an error below destroys it.
        let mut inner = ClientInner {
            api: api.clone(),
            raw,
            devices: Vec::new(),
            direct_read: None,
        };

        let mut args = sys::PJRT_Client_AddressableDevices_Args::new();
        args.client = raw.as_ptr();
        // SAFETY: `raw` is a live client; `args` is a valid args struct.
        let err = unsafe { (a.fns.PJRT_Client_AddressableDevices)(&mut args) };
        a.check("PJRT_Client_AddressableDevices", err)?;
        if args.num_addressable_devices > 0 && !args.addressable_devices.is_null() {
            // SAFETY: the plugin returned an array of `num_addressable_devices` device pointers
            // owned by the client; it is copied here.
            let devices = unsafe {
                std::slice::from_raw_parts(args.addressable_devices, args.num_addressable_devices)
            };
            inner.devices = devices.iter().filter_map(|&d| NonNull::new(d)).collect();
        }
        if allow_direct_read && platform_name(a, raw)? == "cpu" {
            // The CPU plugin keeps every buffer in this process's memory (host memory is its
            // only memory kind), so a buffer's device address is a host address.
            inner.direct_read = DirectRead::new(&a.fns);
        }
        Ok(Client {
            inner: Arc::new(inner),
        })
    }

    /// Whether [`Buffer::to_host`] reads buffers of this client directly from their host
    /// memory (see there) rather than through `PJRT_Buffer_ToHostBuffer`.
    pub fn reads_buffers_directly(&self) -> bool {
        self.inner.direct_read.is_some()
    }

    /// The [`Api`] this client was created from.
    pub fn api(&self) -> &Api {
        &self.inner.api
    }

    /// The platform name, e.g. `"cpu"`, `"cuda"`.
    ///
    /// # Errors
    /// [`Error::Pjrt`] if the plugin fails the query.
    pub fn platform_name(&self) -> Result<String> {
        platform_name(self.inner.api(), self.inner.raw)
    }

    /// A platform-specific version string (e.g. the CUDA version); may be empty.
    ///
    /// # Errors
    /// [`Error::Pjrt`] if the plugin fails the query.
    pub fn platform_version(&self) -> Result<String> {
        let api = self.inner.api();
        let mut args = sys::PJRT_Client_PlatformVersion_Args::new();
        args.client = self.inner.raw.as_ptr();
        // SAFETY: live client, valid args struct.
        let err = unsafe { (api.fns.PJRT_Client_PlatformVersion)(&mut args) };
        api.check("PJRT_Client_PlatformVersion", err)?;
        // SAFETY: the plugin returned `platform_version_size` bytes owned by the live client.
        Ok(unsafe { copy_string(args.platform_version, args.platform_version_size) })
    }

    /// The number of devices this client can run on and place buffers on.
    pub fn addressable_device_count(&self) -> usize {
        self.inner.devices.len()
    }

    /// The global ids of the addressable devices, in order (`PJRT_DeviceDescription_Id`);
    /// `None` if the plugin lacks the device description functions.
    ///
    /// # Errors
    /// [`Error::Pjrt`] if the plugin fails a query.
    pub fn addressable_device_ids(&self) -> Result<Option<Vec<i64>>> {
        let api = self.inner.api();
        let (Some(get_description), Some(get_id)) = (
            api.fns.PJRT_Device_GetDescription,
            api.fns.PJRT_DeviceDescription_Id,
        ) else {
            return Ok(None);
        };
        let mut ids = Vec::with_capacity(self.inner.devices.len());
        for device in &self.inner.devices {
            let mut args = sys::PJRT_Device_GetDescription_Args::new();
            args.device = device.as_ptr();
            // SAFETY: a live device of this client; valid args struct.
            let err = unsafe { get_description(&mut args) };
            api.check("PJRT_Device_GetDescription", err)?;
            let mut id = sys::PJRT_DeviceDescription_Id_Args::new();
            id.device_description = args.device_description;
            // SAFETY: the description the plugin just returned, owned by the live device.
            let err = unsafe { get_id(&mut id) };
            api.check("PJRT_DeviceDescription_Id", err)?;
            ids.push(i64::from(id.id));
        }
        Ok(Some(ids))
    }

    /// Compiles a StableHLO (MLIR) module given as text (or MLIR bytecode) with serialized
    /// `CompileOptionsProto` bytes (see [`compile_options_bytes`](super::compile_options_bytes)).
    ///
    /// # Errors
    /// [`Error::Pjrt`] with the plugin's message (e.g. the MLIR parse error) if the module
    /// does not parse, verify or compile.
    pub fn compile(&self, mlir_text: &str, compile_options: &[u8]) -> Result<LoadedExecutable> {
        let api = self.inner.api();
        const FORMAT: &str = "mlir";
        let mut program = sys::PJRT_Program::new();
        // The plugin parses the text with MLIR, whose lexer (llvm::MemoryBuffer semantics)
        // expects a NUL right after the last byte and reads past `code_size` without one: a
        // non-terminated `&str` made it lex whatever followed in memory. Pass a terminated
        // copy; `code_size` excludes the NUL.
        let mut code = Vec::with_capacity(mlir_text.len() + 1);
        code.extend_from_slice(mlir_text.as_bytes());
        code.push(0u8);
        // The C API declares `code` as `char*` because other calls write it; compile only
        // reads it.
        program.code = code.as_ptr().cast::<c_char>().cast_mut();
        program.code_size = mlir_text.len();
        program.format = FORMAT.as_ptr().cast::<c_char>();
        program.format_size = FORMAT.len();
        let mut args = sys::PJRT_Client_Compile_Args::new();
        args.client = self.inner.raw.as_ptr();
        args.program = &program;
        args.compile_options = compile_options.as_ptr().cast::<c_char>();
        args.compile_options_size = compile_options.len();
        // SAFETY: live client; `program`, the code (`code`, NUL-terminated), the format and the
        // options all outlive the call (the plugin copies what it keeps).
        let err = unsafe { (api.fns.PJRT_Client_Compile)(&mut args) };
        api.check("PJRT_Client_Compile", err)?;
        LoadedExecutable::from_raw(&self.inner, args.executable, "PJRT_Client_Compile")
    }

    /// Loads an executable serialized by [`LoadedExecutable::serialize`] (same plugin and
    /// version only).
    ///
    /// # Errors
    /// [`Error::Pjrt`] if the bytes are not a serialized executable of this plugin.
    pub fn deserialize_executable(&self, bytes: &[u8]) -> Result<LoadedExecutable> {
        let api = self.inner.api();
        let mut args = sys::PJRT_Executable_DeserializeAndLoad_Args::new();
        args.client = self.inner.raw.as_ptr();
        args.serialized_executable = bytes.as_ptr().cast::<c_char>();
        args.serialized_executable_size = bytes.len();
        // SAFETY: live client; `bytes` outlives the call; no overriding compile options.
        let err = unsafe { (api.fns.PJRT_Executable_DeserializeAndLoad)(&mut args) };
        api.check("PJRT_Executable_DeserializeAndLoad", err)?;
        LoadedExecutable::from_raw(
            &self.inner,
            args.loaded_executable,
            "PJRT_Executable_DeserializeAndLoad",
        )
    }

    /// Copies a dense, row-major host array to a new buffer on addressable device `device`.
    ///
    /// Blocks until the plugin is done reading `data` (`done_with_host_buffer`), so `data`
    /// may be changed or freed as soon as this returns; the device copy itself may still be
    /// in flight (later uses of the buffer wait for it).
    ///
    /// # Errors
    /// [`Error::Invalid`] if a dimension is negative, `data.len()` is not
    /// `product(dims) * ty.byte_size()` or `device` is out of range; [`Error::Pjrt`] if the
    /// transfer fails.
    pub fn buffer_from_host(
        &self,
        data: &[u8],
        ty: ElementType,
        dims: &[i64],
        device: usize,
    ) -> Result<Buffer> {
        let Upload { raw, done, status } = self.upload_host_buffer(
            "buffer_from_host",
            data,
            ty,
            dims,
            device,
            sys::PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes,
        )?;
        let buffer = raw.map(|raw| Buffer::from_raw(&self.inner, raw));
        // Even on error, wait until the plugin has let go of `data` before returning.
        let waited = match done {
            Some(done) => done.wait("PJRT_Client_BufferFromHostBuffer"),
            None => Ok(()),
        };
        status?;
        waited?;
        buffer.ok_or_else(no_buffer)
    }

    /// `PJRT_Client_BufferFromHostBuffer` of `data` with `semantics`, after checking `data`'s
    /// size against `ty` and `dims`.
    ///
    /// The caller must keep `data`'s memory allocated and unchanged for as long as
    /// `semantics` says (until `done` completes for both semantics kiln uses).
    fn upload_host_buffer(
        &self,
        caller: &str,
        data: &[u8],
        ty: ElementType,
        dims: &[i64],
        device: usize,
        semantics: sys::PJRT_HostBufferSemantics,
    ) -> Result<Upload<'_>> {
        let expected = host_byte_size(ty, dims)?;
        if data.len() != expected {
            return Err(Error::Invalid(format!(
                "{caller}: {} bytes given for {ty}{dims:?}, which needs {expected}",
                data.len()
            )));
        }
        let device_ptr = *self.inner.devices.get(device).ok_or_else(|| {
            Error::Invalid(format!(
                "{caller}: device {device} out of range (the client has {} addressable devices)",
                self.inner.devices.len()
            ))
        })?;

        let api = self.inner.api();
        let mut args = sys::PJRT_Client_BufferFromHostBuffer_Args::new();
        args.client = self.inner.raw.as_ptr();
        args.data = data.as_ptr().cast();
        args.type_ = ty.to_pjrt();
        args.dims = dims.as_ptr();
        args.num_dims = dims.len();
        args.host_buffer_semantics = semantics;
        args.device = device_ptr.as_ptr();
        // SAFETY: live client and device; `data` holds exactly the dense array described by
        // `ty` and `dims` (checked above), and the caller keeps it as `semantics` requires.
        let err = unsafe { (api.fns.PJRT_Client_BufferFromHostBuffer)(&mut args) };
        // Take ownership of both outputs before looking at the error, so nothing leaks.
        let done = Event::new(api, args.done_with_host_buffer);
        let status = api.check("PJRT_Client_BufferFromHostBuffer", err);
        Ok(Upload {
            raw: NonNull::new(args.buffer),
            done,
            status,
        })
    }

    /// [`Client::buffer_from_host`] reading a contiguous CPU libtorch tensor's memory in place
    /// (no host copy of its own first); `ty` and `dims` describe the buffer, whose bytes must
    /// be the tensor's.
    ///
    /// # Errors
    /// [`Error::Invalid`] if `t` is not a contiguous CPU tensor; as
    /// [`Client::buffer_from_host`] (which rejects a tensor holding another number of bytes
    /// than `ty` and `dims` need).
    pub fn buffer_from_tch(
        &self,
        t: &tch::Tensor,
        ty: ElementType,
        dims: &[i64],
        device: usize,
    ) -> Result<Buffer> {
        let data = tch_bytes("buffer_from_tch", t)?;
        if data.1 == 0 {
            return self.buffer_from_host(&[], ty, dims, device);
        }
        // SAFETY: `t` is a contiguous CPU tensor holding `data.1` bytes at `data.0` (its data
        // pointer, storage offset included), and `t` is borrowed until `buffer_from_host` has
        // returned, by which time the plugin no longer reads them.
        let data = unsafe { std::slice::from_raw_parts(data.0, data.1) };
        self.buffer_from_host(data, ty, dims, device)
    }

    /// A buffer whose storage is a contiguous CPU libtorch tensor's memory, where the plugin
    /// allows it (`kImmutableZeroCopy`; the CPU plugin does for dense arrays aligned as its
    /// own, which libtorch's allocations are; otherwise it copies). The buffer holds a handle
    /// on the tensor until the plugin lets go of the memory, after the buffer is destroyed.
    ///
    /// The memory is read in place, so the tensor's values must not change while the buffer
    /// lives: use this for a buffer that one synchronous call reads and drops (dropping a
    /// lent buffer waits for the executions reading it). An upload costs no allocation or
    /// copy in the plugin, and the buffer's destruction no free.
    ///
    /// # Errors
    /// As [`Client::buffer_from_tch`].
    pub fn lend_tch(
        &self,
        t: &tch::Tensor,
        ty: ElementType,
        dims: &[i64],
        device: usize,
    ) -> Result<Buffer> {
        let data = tch_bytes("lend_tch", t)?;
        if data.1 == 0 {
            return self.buffer_from_host(&[], ty, dims, device);
        }
        // A handle of the lease's own keeps the memory allocated after the caller's goes.
        let keep = t.shallow_clone();
        // SAFETY: `keep` is a contiguous CPU tensor holding `data.1` bytes at `data.0`; the
        // memory stays allocated until the buffer is destroyed and `done` has completed (the
        // lease holds `keep` until then), and the caller keeps its values unchanged while the
        // buffer lives (this function's contract), which is as long as the plugin reads them.
        let bytes = unsafe { std::slice::from_raw_parts(data.0, data.1) };
        let Upload { raw, done, status } = self.upload_host_buffer(
            "lend_tch",
            bytes,
            ty,
            dims,
            device,
            sys::PJRT_HostBufferSemantics_kImmutableZeroCopy,
        )?;
        let lease = HostLease::new(done.map(Event::into_raw), keep);
        let buffer = match raw {
            Some(raw) => Some(Buffer::leased(&self.inner, raw, lease)),
            None => {
                lease.release(&self.inner);
                None
            }
        };
        status?;
        buffer.ok_or_else(no_buffer)
    }
}

/// What `PJRT_Client_BufferFromHostBuffer` gave: the buffer and the `done_with_host_buffer`
/// event (both owned by the caller, even on error), and the call's status.
struct Upload<'a> {
    raw: Option<NonNull<sys::PJRT_Buffer>>,
    done: Option<Event<'a>>,
    status: Result<()>,
}

/// The data pointer and byte size of a contiguous CPU tensor (a null pointer only for an
/// empty one).
fn tch_bytes(caller: &str, t: &tch::Tensor) -> Result<(*const u8, usize)> {
    if t.device() != tch::Device::Cpu || !t.is_contiguous() {
        return Err(Error::Invalid(format!(
            "{caller}: a {:?} tensor on {:?}, contiguous: {} (needs a contiguous CPU tensor)",
            t.kind(),
            t.device(),
            t.is_contiguous()
        )));
    }
    let size = t.numel() * t.kind().elt_size_in_bytes();
    if size == 0 {
        return Ok((ptr::null(), 0));
    }
    let p = t.data_ptr().cast::<u8>().cast_const();
    if p.is_null() {
        return Err(Error::Invalid(format!(
            "{caller}: the tensor has no storage"
        )));
    }
    Ok((p, size))
}

fn no_buffer() -> Error {
    Error::Pjrt {
        call: "PJRT_Client_BufferFromHostBuffer",
        code: "INTERNAL".into(),
        message: "the plugin returned no buffer".into(),
    }
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("api", &self.inner.api)
            .field("addressable_devices", &self.inner.devices.len())
            .finish()
    }
}

/// `PJRT_Client_PlatformName` of a live client.
fn platform_name(api: &ApiInner, client: NonNull<sys::PJRT_Client>) -> Result<String> {
    let mut args = sys::PJRT_Client_PlatformName_Args::new();
    args.client = client.as_ptr();
    // SAFETY: live client (the caller's), valid args struct.
    let err = unsafe { (api.fns.PJRT_Client_PlatformName)(&mut args) };
    api.check("PJRT_Client_PlatformName", err)?;
    // SAFETY: the plugin returned `platform_name_size` bytes owned by the live client.
    Ok(unsafe { copy_string(args.platform_name, args.platform_name_size) })
}

/// `product(dims) * ty.byte_size()`, checked for negative dimensions and overflow.
pub(crate) fn host_byte_size(ty: ElementType, dims: &[i64]) -> Result<usize> {
    let mut n = ty.byte_size();
    for &d in dims {
        let d = usize::try_from(d)
            .map_err(|_| Error::Invalid(format!("negative dimension in shape {dims:?}")))?;
        n = n
            .checked_mul(d)
            .ok_or_else(|| Error::Invalid(format!("shape {dims:?} of {ty} is too large")))?;
    }
    Ok(n)
}
