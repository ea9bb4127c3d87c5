//! Loading a PJRT plugin: `dlopen`, `GetPjrtApi`, version and function-table checks,
//! `PJRT_Plugin_Initialize`; the error and event helpers every other call goes through.

use std::ffi::c_void;
use std::fmt;
use std::path::{Path, PathBuf};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::handoff;
use super::sys::{self, Args};
use crate::error::{Error, Result};

/// A loaded and initialized PJRT plugin (its C API function table).
///
/// Cheap to clone (an `Arc`). A plugin is loaded and initialized at most once per process:
/// loading the same file again (by any path that resolves to it) returns the same `Api`.
/// Plugins are never unloaded: PJRT plugins start threads and register global state that
/// does not survive `dlclose`, so the library stays mapped until the process exits.
#[derive(Clone)]
pub struct Api {
    inner: Arc<ApiInner>,
}

/// What an [`Api`] shares between its clones.
pub(crate) struct ApiInner {
    path: PathBuf,
    version: (i32, i32),
    /// Address of the plugin's `PJRT_Api` table, to recognize the same plugin under two paths.
    table_addr: usize,
    /// The function pointers kiln calls, each checked to be present and non-null at load.
    pub(crate) fns: Fns,
    /// The kiln FFI kernels registered with this plugin (by custom call target) and the
    /// outcome of each registration (see `ffi.rs`).
    pub(crate) ffi_registered: Mutex<Vec<(&'static str, std::result::Result<(), String>)>>,
    /// Keeps the shared object mapped (never dropped in practice: see [`Api`]).
    _library: libloading::Library,
}

/// Every loaded plugin, so that each is initialized once. Entries are never removed.
static REGISTRY: Mutex<Vec<Api>> = Mutex::new(Vec::new());

macro_rules! fns {
    (
        required: [$($name:ident),* $(,)?],
        optional: [$($opt:ident),* $(,)?] $(,)?
    ) => {
        /// The `PJRT_Api` slots kiln calls, copied out of the plugin's table at load time.
        ///
        /// Required slots are plain function pointers (a plugin without one is refused);
        /// optional ones are `None` when the plugin's table ends before them or holds null.
        #[allow(non_snake_case)]
        pub(crate) struct Fns {
            $(pub(crate) $name: sys::$name,)*
            $(pub(crate) $opt: Option<sys::$opt>,)*
        }

        impl Fns {
            /// Reads every slot kiln needs from the plugin's table.
            ///
            /// Returns the name of the first required slot that lies beyond `struct_size` or
            /// is null, and whether it was beyond the table (`true`) or null (`false`).
            ///
            /// # Safety
            /// `table` must point to at least `struct_size` readable bytes of a `PJRT_Api`.
            unsafe fn read(
                table: *const sys::PJRT_Api,
                struct_size: usize,
            ) -> std::result::Result<Fns, (&'static str, bool)> {
                Ok(Fns {
                    $($name: {
                        let end = core::mem::offset_of!(sys::PJRT_Api, $name)
                            + core::mem::size_of::<Option<sys::$name>>();
                        if end > struct_size {
                            return Err((stringify!($name), true));
                        }
                        // SAFETY: the slot lies within the first `struct_size` bytes of the
                        // table, which the caller guarantees are readable; its type
                        // (an optional function pointer, null = None) matches the header.
                        let slot = unsafe { ptr::addr_of!((*table).$name).read_unaligned() };
                        match slot {
                            Some(f) => f,
                            None => return Err((stringify!($name), false)),
                        }
                    },)*
                    $($opt: {
                        let end = core::mem::offset_of!(sys::PJRT_Api, $opt)
                            + core::mem::size_of::<Option<sys::$opt>>();
                        if end > struct_size {
                            None
                        } else {
                            // SAFETY: as for the required slots: within `struct_size`
                            // readable bytes, typed as the header declares it.
                            unsafe { ptr::addr_of!((*table).$opt).read_unaligned() }
                        }
                    },)*
                })
            }
        }
    };
}

fns!(
    required: [
        // Errors first: they are needed to report every other failure.
        PJRT_Error_Destroy,
        PJRT_Error_Message,
        PJRT_Error_GetCode,
        PJRT_Plugin_Initialize,
        PJRT_Event_Destroy,
        PJRT_Event_Await,
        PJRT_Client_Create,
        PJRT_Client_Destroy,
        PJRT_Client_PlatformName,
        PJRT_Client_PlatformVersion,
        PJRT_Client_AddressableDevices,
        PJRT_Client_Compile,
        PJRT_Client_BufferFromHostBuffer,
        PJRT_Executable_Destroy,
        PJRT_Executable_NumOutputs,
        PJRT_Executable_Serialize,
        PJRT_LoadedExecutable_Destroy,
        PJRT_LoadedExecutable_GetExecutable,
        PJRT_LoadedExecutable_Execute,
        PJRT_Executable_DeserializeAndLoad,
        PJRT_Buffer_Destroy,
        PJRT_Buffer_ElementType,
        PJRT_Buffer_Dimensions,
        PJRT_Buffer_OnDeviceSizeInBytes,
        PJRT_Buffer_IsDeleted,
        PJRT_Buffer_ToHostBuffer,
        PJRT_Buffer_ReadyEvent,
    ],
    optional: [
        // The direct host read of `Buffer::to_host` (host-memory platforms only); without any
        // of these, `to_host` uses `PJRT_Buffer_ToHostBuffer`.
        PJRT_Buffer_GetMemoryLayout,
        PJRT_Buffer_IncreaseExternalReferenceCount,
        PJRT_Buffer_DecreaseExternalReferenceCount,
        PJRT_Buffer_OpaqueDeviceMemoryDataPointer,
        // Device ids, for an explicit device assignment of multi-replica programs; without
        // them PJRT's default assignment is used.
        PJRT_Device_GetDescription,
        PJRT_DeviceDescription_Id,
        // The plugin's optimized program (`LoadedExecutable::optimized_program`), for
        // inspection only.
        PJRT_Executable_OptimizedProgram,
        // Waits that serve kernel jobs until an event is ready (`Event::wait`); without
        // them, waits only await and the kernels run on XLA's worker threads.
        PJRT_Event_IsReady,
        PJRT_Event_OnReady,
    ],
);

fn plugin_error(path: &Path, message: impl Into<String>) -> Error {
    Error::Plugin {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

impl Api {
    /// Loads the PJRT plugin at `path` (a shared library exporting `GetPjrtApi`), checks that
    /// it provides every C API function kiln calls, and initializes it.
    ///
    /// Loading a plugin that is already loaded (same file, possibly through another path or a
    /// symlink) returns the existing `Api` without initializing it again.
    ///
    /// # Errors
    /// [`Error::Plugin`] if the file does not exist, is not a loadable shared library, does not
    /// export `GetPjrtApi`, has an unsupported major version, or lacks a function kiln needs
    /// (too old a C API); [`Error::Pjrt`] if `PJRT_Plugin_Initialize` fails.
    pub fn load(path: &Path) -> Result<Api> {
        let canonical = path.canonicalize().map_err(|e| {
            plugin_error(
                path,
                format!(
                    "cannot open the PJRT plugin: {e} (set KILN_PJRT_PLUGIN or install the plugin)"
                ),
            )
        })?;
        if !canonical.is_file() {
            return Err(plugin_error(
                path,
                "not a file (expected a PJRT plugin shared library)",
            ));
        }

        // Held across dlopen and initialization, so that concurrent loads of one plugin
        // initialize it only once.
        let mut registry = REGISTRY.lock();
        if let Some(api) = registry.iter().find(|a| a.inner.path == canonical) {
            return Ok(api.clone());
        }

        let library = open_library(&canonical)
            .map_err(|e| plugin_error(path, format!("not a loadable shared library: {e}")))?;
        // SAFETY: `GetPjrtApi` is declared by pjrt_c_api.h as `const PJRT_Api* GetPjrtApi(void)`,
        // which is the type `sys::GetPjrtApi` spells; the symbol is copied out as a plain
        // function pointer while `library` is alive (and `library` is kept for the process).
        let get_api: sys::GetPjrtApi = unsafe {
            *library
                .get::<sys::GetPjrtApi>(sys::GET_PJRT_API_SYMBOL)
                .map_err(|e| {
                    plugin_error(
                        path,
                        format!("not a PJRT plugin (no GetPjrtApi symbol): {e}"),
                    )
                })?
        };
        // SAFETY: calling the plugin's exported entry point, which takes no arguments.
        let table = unsafe { get_api() };
        if table.is_null() {
            return Err(plugin_error(path, "GetPjrtApi returned null"));
        }
        if let Some(api) = registry
            .iter()
            .find(|a| a.inner.table_addr == table as usize)
        {
            // The same library under another name (a hard link): dlopen returned the same
            // handle, so it is already initialized. Dropping `library` only decrements the
            // loader's reference count.
            return Ok(api.clone());
        }

        // SAFETY: `table` is the non-null result of the plugin's `GetPjrtApi`, a pointer to its
        // static `PJRT_Api`.
        let ((major, minor), fns) = unsafe { read_table(path, table) }?;

        let inner = ApiInner {
            path: canonical,
            version: (major, minor),
            table_addr: table as usize,
            fns,
            ffi_registered: Mutex::new(Vec::new()),
            _library: library,
        };
        let mut args = sys::PJRT_Plugin_Initialize_Args::new();
        // SAFETY: `args` is a valid, initialized args struct; the plugin is initialized here
        // exactly once (the registry lock is held and this table is not registered yet).
        let err = unsafe { (inner.fns.PJRT_Plugin_Initialize)(&mut args) };
        inner.check("PJRT_Plugin_Initialize", err)?;

        let api = Api {
            inner: Arc::new(inner),
        };
        registry.push(api.clone());
        Ok(api)
    }

    /// The plugin's PJRT C API version, `(major, minor)`, e.g. `(0, 81)`.
    pub fn version(&self) -> (i32, i32) {
        self.inner.version
    }

    /// The canonical path of the loaded plugin.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    pub(crate) fn inner(&self) -> &ApiInner {
        &self.inner
    }
}

impl fmt::Debug for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Api")
            .field("path", &self.inner.path)
            .field("version", &self.inner.version)
            .finish()
    }
}

/// Checks a plugin's `PJRT_Api` table: readable version, major version 0, and every slot kiln
/// requires inside the table (`struct_size`) and non-null; optional slots are read if present.
///
/// # Safety
/// `table` must point to a `PJRT_Api` whose first `struct_size` bytes (its first field) are
/// readable.
pub(crate) unsafe fn read_table(
    path: &Path,
    table: *const sys::PJRT_Api,
) -> Result<((i32, i32), Fns)> {
    // SAFETY: the caller guarantees that `table` points to a `PJRT_Api` whose first field,
    // `size_t struct_size` in every version of the C API, is readable.
    let struct_size = unsafe { ptr::addr_of!((*table).struct_size).read_unaligned() };
    if struct_size < sys::API_VERSION_END {
        return Err(plugin_error(
            path,
            format!("PJRT_Api.struct_size is {struct_size} bytes, too small to hold a version"),
        ));
    }
    // SAFETY: `pjrt_api_version` ends at `API_VERSION_END <= struct_size`, so it lies within
    // the plugin's table; its layout (`PJRT_Api_Version`) is fixed for major version 0.
    let version = unsafe { ptr::addr_of!((*table).pjrt_api_version).read_unaligned() };
    let (major, minor) = (version.major_version, version.minor_version);
    if major != 0 {
        return Err(plugin_error(
            path,
            format!(
                "plugin implements PJRT C API {major}.{minor}, kiln supports major version 0 \
                 (0.81 or newer)"
            ),
        ));
    }
    // SAFETY: the caller guarantees that the first `struct_size` bytes of the table (by its
    // own `struct_size` field) are readable.
    let fns = unsafe { Fns::read(table, struct_size) }.map_err(|(name, beyond)| {
        let why = if beyond {
            format!("its PJRT_Api table ({struct_size} bytes) ends before {name}")
        } else {
            format!("its PJRT_Api table has no {name} (null)")
        };
        plugin_error(
            path,
            format!(
                "plugin implements PJRT C API {major}.{minor}, kiln needs {name}, but {why}; \
                 use a plugin built for PJRT C API 0.81 or newer"
            ),
        )
    })?;
    Ok(((major, minor), fns))
}

#[cfg(unix)]
fn open_library(path: &Path) -> std::result::Result<libloading::Library, libloading::Error> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    // SAFETY: loading a PJRT plugin runs its static initializers, which is what the plugin
    // is built for; RTLD_NOW resolves every symbol up front so that a broken plugin fails
    // here rather than at a later call, RTLD_LOCAL keeps its symbols (its own copies of
    // LLVM, protobuf, ...) from interposing on other libraries such as libtorch.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }.map(Into::into)
}

#[cfg(not(unix))]
fn open_library(path: &Path) -> std::result::Result<libloading::Library, libloading::Error> {
    // SAFETY: as above: loading a PJRT plugin runs its initializers, which it is built for.
    unsafe { libloading::Library::new(path) }
}

impl ApiInner {
    /// The plugin's `PJRT_Api` table (static in the plugin, which is never unloaded).
    pub(crate) fn table(&self) -> *const sys::PJRT_Api {
        self.table_addr as *const sys::PJRT_Api
    }

    /// Turns the `PJRT_Error*` returned by `call` into a `Result`, destroying the error.
    #[inline]
    pub(crate) fn check(&self, call: &'static str, err: *mut sys::PJRT_Error) -> Result<()> {
        match NonNull::new(err) {
            None => Ok(()),
            Some(err) => Err(self.take_error(call, err)),
        }
    }

    #[cold]
    fn take_error(&self, call: &'static str, err: NonNull<sys::PJRT_Error>) -> Error {
        let mut msg = sys::PJRT_Error_Message_Args::new();
        msg.error = err.as_ptr();
        // SAFETY: `err` is a live error returned by the plugin; `msg` is a valid args struct.
        unsafe { (self.fns.PJRT_Error_Message)(&mut msg) };
        let message = if msg.message.is_null() {
            String::new()
        } else {
            // SAFETY: the plugin returned `message_size` bytes at `message`, which live as
            // long as `err` (destroyed only below, after this copy).
            let bytes =
                unsafe { std::slice::from_raw_parts(msg.message.cast::<u8>(), msg.message_size) };
            String::from_utf8_lossy(bytes).into_owned()
        };

        let mut code = sys::PJRT_Error_GetCode_Args::new();
        code.error = err.as_ptr();
        // SAFETY: as above, `err` is live and `code` is a valid args struct.
        let code_err = unsafe { (self.fns.PJRT_Error_GetCode)(&mut code) };
        let code = if code_err.is_null() {
            sys::ERROR_CODE_NAMES
                .get(code.code as usize)
                .map_or_else(|| format!("code {}", code.code), |s| (*s).to_string())
        } else {
            self.destroy_error(code_err);
            "UNKNOWN".to_string()
        };

        self.destroy_error(err.as_ptr());
        Error::Pjrt {
            call,
            code,
            message,
        }
    }

    fn destroy_error(&self, err: *mut sys::PJRT_Error) {
        let mut args = sys::PJRT_Error_Destroy_Args::new();
        args.error = err;
        // SAFETY: `err` was returned by the plugin and is destroyed exactly once, here
        // (PJRT_Error_Destroy also accepts null).
        unsafe { (self.fns.PJRT_Error_Destroy)(&mut args) };
    }

    /// Whether `event` is ready (`PJRT_Event_IsReady`); `None` if the plugin cannot say (no
    /// such function, or it failed).
    ///
    /// # Safety
    /// `event` must be a live event of this plugin.
    pub(crate) unsafe fn event_is_ready(&self, event: NonNull<sys::PJRT_Event>) -> Option<bool> {
        let is_ready = self.fns.PJRT_Event_IsReady?;
        let mut args = sys::PJRT_Event_IsReady_Args::new();
        args.event = event.as_ptr();
        // SAFETY: `event` is live (the caller's guarantee).
        let err = unsafe { is_ready(&mut args) };
        if !err.is_null() {
            self.ignore_error("PJRT_Event_IsReady", err);
            return None;
        }
        Some(args.is_ready)
    }

    /// Destroys `event` (`PJRT_Event_Destroy`).
    ///
    /// # Safety
    /// `event` must be a live event of this plugin owned by the caller, not used afterwards.
    pub(crate) unsafe fn destroy_event(&self, event: NonNull<sys::PJRT_Event>) {
        let mut args = sys::PJRT_Event_Destroy_Args::new();
        args.event = event.as_ptr();
        // SAFETY: `event` is live and owned by the caller, who gives it up here.
        let err = unsafe { (self.fns.PJRT_Event_Destroy)(&mut args) };
        self.ignore_error("PJRT_Event_Destroy", err);
    }

    /// Reports a failed cleanup call (in `Drop`, where it cannot be returned) and frees it.
    pub(crate) fn ignore_error(&self, call: &'static str, err: *mut sys::PJRT_Error) {
        if let Err(e) = self.check(call, err) {
            // A destroy that fails leaves nothing the caller could do; do not panic in Drop.
            if cfg!(debug_assertions) {
                eprintln!("kiln: ignoring error in cleanup: {e}");
            }
        }
    }
}

/// A `PJRT_Event` owned by kiln: awaited at most once, destroyed on drop.
pub(crate) struct Event<'a> {
    api: &'a ApiInner,
    raw: NonNull<sys::PJRT_Event>,
}

impl<'a> Event<'a> {
    /// Takes ownership of an event returned by the plugin; `None` for a null event.
    pub(crate) fn new(api: &'a ApiInner, raw: *mut sys::PJRT_Event) -> Option<Event<'a>> {
        NonNull::new(raw).map(|raw| Event { api, raw })
    }

    /// The event, still owned by `self`.
    pub(crate) fn raw(&self) -> NonNull<sys::PJRT_Event> {
        self.raw
    }

    /// The event, now owned by the caller (who must destroy it).
    pub(crate) fn into_raw(self) -> NonNull<sys::PJRT_Event> {
        let raw = self.raw;
        std::mem::forget(self);
        raw
    }

    /// Blocks until the event is ready; an error it carries is reported as a failure of
    /// `call`, the operation the event belongs to.
    ///
    /// Once kiln's FFI kernels are registered, the wait first serves the kernel jobs XLA's
    /// worker threads hand over (see [`handoff`](super::handoff)) until the event is ready.
    pub(crate) fn wait(self, call: &'static str) -> Result<()> {
        // SAFETY: `self.raw` is a live event owned by `self` (destroyed only in Drop).
        unsafe { self.api.await_event(self.raw, call) }
    }
}

impl ApiInner {
    /// [`Event::wait`] on an event owned elsewhere.
    ///
    /// # Safety
    /// `event` must be a live event of this plugin, not destroyed during the call.
    pub(crate) unsafe fn await_event(
        &self,
        event: NonNull<sys::PJRT_Event>,
        call: &'static str,
    ) -> Result<()> {
        if handoff::enabled() {
            // SAFETY: the caller's guarantee.
            unsafe { self.serve_until_ready(event) };
        }
        let mut args = sys::PJRT_Event_Await_Args::new();
        args.event = event.as_ptr();
        // SAFETY: `event` is live (the caller's guarantee).
        let err = unsafe { (self.fns.PJRT_Event_Await)(&mut args) };
        self.check(call, err)
    }

    /// Runs handed-over kernel jobs on this thread until `event` is ready. Returns at once
    /// if it is ready already, or if the plugin cannot report readiness by callback (the
    /// handlers then run their kernels themselves).
    ///
    /// # Safety
    /// `event` must be a live event of this plugin, not destroyed during the call.
    unsafe fn serve_until_ready(&self, event: NonNull<sys::PJRT_Event>) {
        let fns = &self.fns;
        let Some(on_ready) = fns.PJRT_Event_OnReady else {
            return;
        };
        // SAFETY: `event` is live (the caller's guarantee).
        if unsafe { self.event_is_ready(event) } != Some(false) {
            return;
        }
        let flag = Arc::new(ReadyFlag {
            ready: AtomicBool::new(false),
            destroy_error: fns.PJRT_Error_Destroy,
        });
        let user_arg = Arc::into_raw(flag.clone()).cast_mut().cast::<c_void>();
        let mut args = sys::PJRT_Event_OnReady_Args::new();
        args.event = event.as_ptr();
        args.callback = Some(on_ready_callback);
        args.user_arg = user_arg;
        // SAFETY: live event; the callback is a `'static` function; `user_arg` is one
        // reference of `flag`, released by the callback (or below if registration fails).
        let err = unsafe { on_ready(&mut args) };
        if !err.is_null() {
            self.ignore_error("PJRT_Event_OnReady", err);
            // SAFETY: the callback was not registered, so this reference was not handed over.
            drop(unsafe { Arc::from_raw(user_arg.cast::<ReadyFlag>()) });
            return;
        }
        handoff::HANDOFF.serve_until(|| flag.ready.load(Ordering::Acquire));
    }
}

/// What `on_ready_callback` sets, and how it frees the error it is given.
struct ReadyFlag {
    ready: AtomicBool,
    destroy_error: sys::PJRT_Error_Destroy,
}

/// `PJRT_Event_OnReadyCallback` of [`ApiInner::serve_until_ready`]: frees the event's error (the
/// await that follows reports it), marks the flag and wakes the serving threads.
unsafe extern "C" fn on_ready_callback(error: *mut sys::PJRT_Error, user_arg: *mut c_void) {
    // SAFETY: `user_arg` is the `Arc<ReadyFlag>` reference handed over at registration; the
    // plugin calls this exactly once.
    let flag = unsafe { Arc::from_raw(user_arg.cast::<ReadyFlag>()) };
    if !error.is_null() {
        let mut args = sys::PJRT_Error_Destroy_Args::new();
        args.error = error;
        // SAFETY: the callback owns `error` and frees it once, here.
        unsafe { (flag.destroy_error)(&mut args) };
    }
    flag.ready.store(true, Ordering::Release);
    handoff::HANDOFF.notify();
}

impl Drop for Event<'_> {
    fn drop(&mut self) {
        // SAFETY: `self.raw` is owned by this wrapper and destroyed exactly once, here.
        unsafe { self.api.destroy_event(self.raw) };
    }
}

/// Copies a `(pointer, length)` string returned by the plugin.
///
/// # Safety
/// `ptr` must be null or point to `len` readable bytes.
pub(crate) unsafe fn copy_string(ptr: *const std::ffi::c_char, len: usize) -> String {
    if ptr.is_null() || len == 0 {
        return String::new();
    }
    // SAFETY: guaranteed by the caller.
    let bytes = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) };
    String::from_utf8_lossy(bytes).into_owned()
}
