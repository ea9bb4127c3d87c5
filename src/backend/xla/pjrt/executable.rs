//! `PJRT_LoadedExecutable`: a compiled program loaded on a client's devices.

use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use super::api::ApiInner;
use super::buffer::{Buffer, Completion};
use super::client::ClientInner;
use super::handoff::TeamUse;
use super::sys::{self, Args};
use crate::error::{Error, Result};
use smallvec::SmallVec;

/// One replica's buffer pointers for an execution: inline up to 8.
type PtrList<T> = SmallVec<[T; 8]>;
/// Every replica's lists: inline for one replica.
type PtrLists<T> = SmallVec<[PtrList<T>; 1]>;

/// A compiled program, ready to run (`PJRT_LoadedExecutable_Destroy` on drop).
pub struct LoadedExecutable {
    client: Arc<ClientInner>,
    raw: NonNull<sys::PJRT_LoadedExecutable>,
    num_outputs: usize,
    /// The arguments whose addresses key packed weights (see [`Buffer::mark_weight_source`]),
    /// and the arguments the program donates.
    weight_inputs: WeightInputs,
    /// How its kernels use the launching thread's OpenMP team ([`TeamUse`]).
    team: TeamUse,
}

/// Which arguments of an executable read variables whose addresses may key packed weights
/// (`sources`), and which it donates (`donated`); see [`LoadedExecutable::set_weight_inputs`].
#[derive(Clone, Debug, Default)]
pub(crate) struct WeightInputs {
    pub sources: Vec<usize>,
    pub donated: Vec<usize>,
}

// SAFETY: a `PJRT_LoadedExecutable` is not tied to a thread, and `xla::PjRtLoadedExecutable`
// (which the C API wraps) supports concurrent `Execute` calls from several threads.
unsafe impl Send for LoadedExecutable {}
// SAFETY: see `Send`; `&LoadedExecutable` only allows thread-safe PJRT calls.
unsafe impl Sync for LoadedExecutable {}

/// A launch id for one execution, unique in the process (wrapping, never 0).
///
/// XLA's CPU client names each execution's collectives by `RunId(launch_id)`: participants of
/// an all-reduce meet in a process-wide rendezvous keyed by it. With the default 0 for every
/// call, two replicated executions running at once (two threads, even two clients) met in
/// one rendezvous and combined each other's buffers (a crash when their dtypes or sizes
/// differ).
fn next_launch_id() -> std::os::raw::c_int {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(1);
    loop {
        let id = NEXT.fetch_add(1, Ordering::Relaxed) & 0x7fff_ffff;
        if id != 0 {
            return id as std::os::raw::c_int;
        }
    }
}

/// A `PJRT_Executable` obtained from a loaded executable, destroyed on drop.
struct ExecutableRef<'a> {
    api: &'a ApiInner,
    raw: NonNull<sys::PJRT_Executable>,
}

impl Drop for ExecutableRef<'_> {
    fn drop(&mut self) {
        let mut args = sys::PJRT_Executable_Destroy_Args::new();
        args.executable = self.raw.as_ptr();
        // SAFETY: PJRT_LoadedExecutable_GetExecutable returns a new handle that the caller
        // must free; it is owned by this guard and destroyed exactly once, here.
        let err = unsafe { (self.api.fns.PJRT_Executable_Destroy)(&mut args) };
        self.api.ignore_error("PJRT_Executable_Destroy", err);
    }
}

impl LoadedExecutable {
    /// Takes ownership of an executable returned by `call` and reads its output count.
    pub(crate) fn from_raw(
        client: &Arc<ClientInner>,
        raw: *mut sys::PJRT_LoadedExecutable,
        call: &'static str,
    ) -> Result<LoadedExecutable> {
        let raw = NonNull::new(raw).ok_or_else(|| Error::Pjrt {
            call,
            code: "INTERNAL".into(),
            message: "the plugin returned no executable".into(),
        })?;
        // Owned from here on: an error below destroys it.
        let mut exe = LoadedExecutable {
            client: Arc::clone(client),
            raw,
            num_outputs: 0,
            weight_inputs: WeightInputs::default(),
            team: TeamUse::None,
        };
        let inner = exe.executable()?;
        let mut args = sys::PJRT_Executable_NumOutputs_Args::new();
        args.executable = inner.raw.as_ptr();
        // SAFETY: live executable handle, valid args struct.
        let err = unsafe { (inner.api.fns.PJRT_Executable_NumOutputs)(&mut args) };
        inner.api.check("PJRT_Executable_NumOutputs", err)?;
        drop(inner);
        exe.num_outputs = args.num_outputs;
        Ok(exe)
    }

    /// Declares which arguments' addresses may key packed weights and which arguments the
    /// program donates: before each execution the donated ones are forgotten by the packed
    /// weight cache and the sources registered with it (`kernels::weights`).
    pub(crate) fn set_weight_inputs(&mut self, inputs: WeightInputs) {
        self.weight_inputs = inputs;
    }

    /// Declares how the program's kernels use the OpenMP team of the thread that launches it
    /// and then serves them (see `handoff::TeamUse`; [`TeamUse::None`] until set).
    pub(crate) fn set_team_use(&mut self, team: TeamUse) {
        self.team = team;
    }

    fn executable(&self) -> Result<ExecutableRef<'_>> {
        let api = self.client.api();
        let mut args = sys::PJRT_LoadedExecutable_GetExecutable_Args::new();
        args.loaded_executable = self.raw.as_ptr();
        // SAFETY: live loaded executable, valid args struct.
        let err = unsafe { (api.fns.PJRT_LoadedExecutable_GetExecutable)(&mut args) };
        api.check("PJRT_LoadedExecutable_GetExecutable", err)?;
        let raw = NonNull::new(args.executable).ok_or_else(|| Error::Pjrt {
            call: "PJRT_LoadedExecutable_GetExecutable",
            code: "INTERNAL".into(),
            message: "the plugin returned no executable".into(),
        })?;
        Ok(ExecutableRef { api, raw })
    }

    /// The number of outputs per execution (the entry function's results, flattened).
    ///
    /// Read once when the executable is created (`PJRT_Executable_NumOutputs`).
    ///
    /// # Errors
    /// Never fails today; kept fallible for plugins that answer lazily.
    pub fn num_outputs(&self) -> Result<usize> {
        Ok(self.num_outputs)
    }

    /// Runs the executable once on its device (device 0 for a single-replica compile).
    ///
    /// Returns as soon as the work is enqueued: the outputs may still be being computed
    /// (see [`Buffer::ready`]). Inputs that the module donates (`tf.aliasing_output`) are
    /// deleted by PJRT; their [`Buffer`]s remain valid to drop and report
    /// [`Buffer::is_deleted`]. Input buffers may be dropped right after this returns: PJRT
    /// frees their storage only once the executions using them are done.
    ///
    /// # Errors
    /// [`Error::Invalid`] if an argument belongs to another client; [`Error::Pjrt`] if the
    /// plugin rejects the arguments (count, types, deleted buffers) or the launch fails.
    pub fn execute(&self, args: &[&Buffer]) -> Result<Vec<Buffer>> {
        self.execute_one(args, true)
    }

    /// [`LoadedExecutable::execute`] for a caller that waits for the outputs before it drops
    /// any argument: the execution's completion is not recorded on the arguments (no
    /// completion event, no `Arc` a call). Dropping an argument early stays correct, but may
    /// block the dropping thread in the plugin until the execution is done (see
    /// `Buffer`'s `Drop`).
    ///
    /// # Errors
    /// As [`LoadedExecutable::execute`].
    pub fn execute_awaited(&self, args: &[&Buffer]) -> Result<Vec<Buffer>> {
        self.execute_one(args, false)
    }

    fn execute_one(&self, args: &[&Buffer], track: bool) -> Result<Vec<Buffer>> {
        let mut outs = self.execute_lists(&[args], track)?;
        outs.pop().ok_or_else(|| Error::Pjrt {
            call: "PJRT_LoadedExecutable_Execute",
            code: "INTERNAL".into(),
            message: "the plugin returned no output list".into(),
        })
    }

    /// Runs the executable once on each of its replicas' devices: `args[r]` is replica `r`'s
    /// argument list (its buffers on replica `r`'s device, the `r`-th addressable device for a
    /// program compiled with [`compile_options_bytes_for`](super::compile_options_bytes_for));
    /// returns each replica's outputs. Cross-replica ops (`stablehlo.all_reduce`) combine the
    /// replicas' values. Asynchronous and donating like [`LoadedExecutable::execute`].
    ///
    /// # Errors
    /// As [`LoadedExecutable::execute`]; [`Error::Invalid`] if the argument lists differ in
    /// length; [`Error::Pjrt`] if their number is not the executable's replica count or a
    /// buffer is not on its replica's device.
    pub fn execute_replicated(&self, args: &[&[&Buffer]]) -> Result<Vec<Vec<Buffer>>> {
        self.execute_lists(args, true)
    }

    /// [`LoadedExecutable::execute_replicated`], recording the completion on the arguments
    /// if `track` (see [`LoadedExecutable::execute_awaited`]).
    fn execute_lists(&self, args: &[&[&Buffer]], track: bool) -> Result<Vec<Vec<Buffer>>> {
        let num_args = args.first().map_or(0, |a| a.len());
        // Small vectors: a call on one device with a few arguments allocates none of these
        // lists (the LinearModel's replay is a few microseconds, 27 Rust allocations a call
        // before).
        let mut arg_ptrs: PtrLists<*mut sys::PJRT_Buffer> = SmallVec::with_capacity(args.len());
        for (r, list) in args.iter().enumerate() {
            if list.len() != num_args {
                return Err(Error::Invalid(format!(
                    "execute: replica {r} has {} arguments, replica 0 has {num_args}",
                    list.len()
                )));
            }
            let mut ptrs: PtrList<*mut sys::PJRT_Buffer> = SmallVec::with_capacity(list.len());
            for (i, b) in list.iter().enumerate() {
                if !Arc::ptr_eq(b.client(), &self.client) {
                    return Err(Error::Invalid(format!(
                        "execute: argument {i} of replica {r} is a buffer of another PJRT client"
                    )));
                }
                ptrs.push(b.raw());
            }
            arg_ptrs.push(ptrs);
        }
        // Packed weights keyed by a buffer about to be donated are dropped before its memory
        // is written; the variables read in place are registered as sources.
        for list in args {
            for &i in &self.weight_inputs.donated {
                if let Some(b) = list.get(i) {
                    b.forget_weight_source();
                }
            }
            for &i in &self.weight_inputs.sources {
                if let Some(b) = list.get(i) {
                    b.mark_weight_source();
                }
            }
        }
        let arg_lists: SmallVec<[*const *mut sys::PJRT_Buffer; 1]> =
            arg_ptrs.iter().map(|l| l.as_ptr()).collect();
        let mut outputs: PtrLists<*mut sys::PJRT_Buffer> = (0..args.len())
            .map(|_| SmallVec::from_elem(ptr::null_mut(), self.num_outputs))
            .collect();
        let output_lists: SmallVec<[*mut *mut sys::PJRT_Buffer; 1]> =
            outputs.iter_mut().map(|l| l.as_mut_ptr()).collect();

        let api = self.client.api();
        let mut options = sys::PJRT_ExecuteOptions::new();
        options.launch_id = next_launch_id();
        let mut exec = sys::PJRT_LoadedExecutable_Execute_Args::new();
        exec.executable = self.raw.as_ptr();
        exec.options = &mut options;
        exec.argument_lists = arg_lists.as_ptr();
        exec.num_devices = args.len();
        exec.num_args = num_args;
        exec.output_lists = output_lists.as_ptr();
        // Each replica's completion, recorded on its arguments (see `Buffer::used_by`): only
        // needed where dropping a busy argument must not block (kernel handoff), and where
        // the caller may drop one while the execution runs.
        let mut done: SmallVec<[*mut sys::PJRT_Event; 1]> = SmallVec::new();
        if track && super::handoff::enabled() {
            done.resize(args.len(), ptr::null_mut());
            exec.device_complete_events = done.as_mut_ptr();
        }
        // SAFETY: live executable; `num_devices` argument lists of `num_args` live buffers of
        // this client each (borrowed for the call); `num_devices` output lists with room for
        // the executable's `num_outputs` buffers each; room for `num_devices` completion
        // events (owned by kiln afterwards); `options` outlives the call. The lists may be
        // inline in `arg_ptrs` and `outputs`, which are neither moved nor dropped before the
        // call returns (and `outputs` is read only after it).
        let err = super::handoff::launching(self.team, || unsafe {
            (api.fns.PJRT_LoadedExecutable_Execute)(&mut exec)
        });
        for (list, &event) in args.iter().zip(&done) {
            if let Some(c) = Completion::new(&self.client, event) {
                let c = Arc::new(c);
                for b in list.iter() {
                    b.used_by(&c);
                }
            }
        }
        // Take ownership of whatever outputs were written before looking at the error.
        let mut result = Vec::with_capacity(outputs.len());
        let mut missing = 0;
        for list in &outputs {
            let mut bufs = Vec::with_capacity(list.len());
            for &p in list {
                match NonNull::new(p) {
                    Some(p) => bufs.push(Buffer::from_raw(&self.client, p)),
                    None => missing += 1,
                }
            }
            result.push(bufs);
        }
        api.check("PJRT_LoadedExecutable_Execute", err)?;
        if missing > 0 {
            return Err(Error::Pjrt {
                call: "PJRT_LoadedExecutable_Execute",
                code: "INTERNAL".into(),
                message: format!("the plugin returned {missing} null output buffers"),
            });
        }
        Ok(result)
    }

    /// Serializes the compiled executable (`PJRT_Executable_Serialize`), for
    /// [`Client::deserialize_executable`](super::Client::deserialize_executable) with the
    /// same plugin and version.
    ///
    /// # Errors
    /// [`Error::Pjrt`] if the plugin cannot serialize the executable.
    pub fn serialize(&self) -> Result<Vec<u8>> {
        let inner = self.executable()?;
        let api = inner.api;
        let mut args = sys::PJRT_Executable_Serialize_Args::new();
        args.executable = inner.raw.as_ptr();
        // SAFETY: live executable handle, valid args struct.
        let err = unsafe { (api.fns.PJRT_Executable_Serialize)(&mut args) };
        api.check("PJRT_Executable_Serialize", err)?;
        let bytes = if args.serialized_bytes.is_null() || args.serialized_bytes_size == 0 {
            Vec::new()
        } else {
            // SAFETY: the plugin returned `serialized_bytes_size` bytes that live until the
            // deleter is called on `serialized_executable`, which happens after this copy.
            unsafe {
                std::slice::from_raw_parts(
                    args.serialized_bytes.cast::<u8>(),
                    args.serialized_bytes_size,
                )
            }
            .to_vec()
        };
        if let Some(deleter) = args.serialized_executable_deleter {
            // SAFETY: the deleter and its argument come from the same successful call and
            // are called exactly once, after the bytes were copied out.
            unsafe { deleter(args.serialized_executable) };
        }
        Ok(bytes)
    }

    /// The program the plugin actually runs, after its optimization passes
    /// (`PJRT_Executable_OptimizedProgram`): `(format, bytes)`. XLA plugins answer with format
    /// `hlo_with_config`, a serialized `xla.HloModuleProtoWithConfig`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] if the plugin's function table has no
    /// `PJRT_Executable_OptimizedProgram`; [`Error::Pjrt`] if the plugin has it but refuses
    /// (e.g. `UNIMPLEMENTED`).
    pub fn optimized_program(&self) -> Result<(String, Vec<u8>)> {
        let inner = self.executable()?;
        let api = inner.api;
        let f = api
            .fns
            .PJRT_Executable_OptimizedProgram
            .ok_or_else(|| Error::Unsupported {
                backend: "xla".into(),
                what: "the optimized program: this PJRT plugin does not implement \
                   PJRT_Executable_OptimizedProgram"
                    .into(),
            })?;
        let mut program = sys::PJRT_Program::new();
        let mut args = sys::PJRT_Executable_OptimizedProgram_Args::new();
        args.executable = inner.raw.as_ptr();
        args.program = &mut program;
        // SAFETY: live executable handle; `program` outlives both calls. With `code` null the
        // plugin only writes `code_size`, `format` and `format_size`.
        let err = unsafe { f(&mut args) };
        api.check("PJRT_Executable_OptimizedProgram", err)?;
        let mut code = vec![0u8; program.code_size];
        program.code = code.as_mut_ptr().cast();
        // A fresh pointer: `program` was written directly since the first one was taken.
        args.program = &mut program;
        // SAFETY: `code` has `program.code_size` writable bytes, as the first call asked for,
        // and lives until after the call; the plugin writes at most that many.
        let err = unsafe { f(&mut args) };
        api.check("PJRT_Executable_OptimizedProgram", err)?;
        // The plugin may report a smaller size on the second call (the bytes it wrote).
        code.truncate(program.code_size);
        let format = if program.format.is_null() {
            String::new()
        } else {
            // SAFETY: the plugin set `format`/`format_size` to a string it owns, which lives as
            // long as the executable (borrowed here through `inner`).
            unsafe { super::api::copy_string(program.format, program.format_size) }
        };
        Ok((format, code))
    }
}

impl Drop for LoadedExecutable {
    fn drop(&mut self) {
        let api = self.client.api();
        let mut args = sys::PJRT_LoadedExecutable_Destroy_Args::new();
        args.executable = self.raw.as_ptr();
        // SAFETY: the executable is owned by this wrapper and destroyed exactly once, here;
        // its client is kept alive by `self.client` until after this call.
        let err = unsafe { (api.fns.PJRT_LoadedExecutable_Destroy)(&mut args) };
        api.ignore_error("PJRT_LoadedExecutable_Destroy", err);
    }
}

impl fmt::Debug for LoadedExecutable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadedExecutable")
            .field("num_outputs", &self.num_outputs)
            .finish_non_exhaustive()
    }
}
