//! The XLA backend: lowers graphs to StableHLO text and compiles them with a PJRT plugin.
//!
//! The plugin is a shared library exporting `GetPjrtApi` (PJRT C API). It is found, in order,
//! from: the path given to [`XlaBackend::from_plugin`], the `KILN_PJRT_PLUGIN` environment
//! variable, and the CPU plugin that `scripts/bootstrap.sh` installed into the checkout (baked in
//! at build time through `.cargo/config.toml`). Any plugin with the same C API works, including
//! GPU ones; nothing here assumes a CPU.

pub mod autotune;
pub mod conv;
mod hlo;
pub mod kernels;
pub mod lower;
mod materialize;
pub mod pjrt;
pub mod reductions;
mod replicated;

pub use autotune::{Autotune, Lowering, NodeChoice};
pub use conv::{ConvLowering, ConvRule, ConvStrategy};
pub use kernels::FfiMode;
pub use pjrt::OptionValue;
pub use replicated::{Replicated, ReplicatedBuffer};

use crate::backend::{Backend, HostTensor};
use crate::error::{Error, Result};
use crate::ir::{DType, Fingerprint, Graph, InputKind, NodeId, TensorType};
use crate::passes::{
    im2col_nodes, Pass, ScaleScatterUpdates, StripBarriers, StripStopGradients, WidenHalf,
};
use autotune::{Caps, GraphChoice, Source, Tuner, Variant};
use parking_lot::Mutex;
use pjrt::handoff::TeamUse;
use smallvec::SmallVec;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// The plugin path kiln uses when none is given explicitly.
///
/// `KILN_PJRT_PLUGIN` if set, else the plugin installed by the bootstrap (if this crate was built
/// inside a bootstrapped checkout).
pub fn default_plugin_path() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("KILN_PJRT_PLUGIN") {
        return Ok(PathBuf::from(p));
    }
    match option_env!("KILN_DEFAULT_PJRT_PLUGIN") {
        Some(p) => Ok(PathBuf::from(p)),
        None => Err(Error::Plugin {
            path: PathBuf::new(),
            message: "no PJRT plugin configured: set KILN_PJRT_PLUGIN to a plugin .so \
                      (e.g. xla_cpu_pjrt.so from the xla-cpu-pjrt wheel) or run scripts/bootstrap.sh"
                .into(),
        }),
    }
}

fn element_type(d: DType) -> pjrt::ElementType {
    match d {
        DType::Bool => pjrt::ElementType::Pred,
        DType::U32 => pjrt::ElementType::U32,
        DType::I32 => pjrt::ElementType::S32,
        DType::I64 => pjrt::ElementType::S64,
        DType::F32 => pjrt::ElementType::F32,
        DType::F64 => pjrt::ElementType::F64,
        DType::BF16 => pjrt::ElementType::BF16,
        DType::F16 => pjrt::ElementType::F16,
    }
}

/// A buffer on the PJRT device, with its kiln type.
pub struct XlaBuffer {
    buffer: pjrt::Buffer,
    ty: TensorType,
}

impl XlaBuffer {
    /// The PJRT buffer.
    pub fn raw(&self) -> &pjrt::Buffer {
        &self.buffer
    }

    /// Has PJRT deleted this buffer (because it was donated to an execution)?
    pub fn is_deleted(&self) -> Result<bool> {
        self.buffer.is_deleted()
    }
}

/// A compiled graph.
pub struct XlaExecutable {
    exe: pjrt::LoadedExecutable,
    inputs: Vec<(String, TensorType)>,
    outputs: Vec<TensorType>,
    /// Which outputs the direct read applies to as plain arrays
    /// ([`pjrt::Buffer::is_plain_array`]), learnt from the first execution's outputs.
    plain_outputs: OnceLock<Box<[bool]>>,
    mlir: String,
}

impl XlaExecutable {
    /// Checks `count` arguments against the executable's inputs, in order: `type_of(i,
    /// name)` is argument `i`'s type (or an error about that argument of its own).
    fn check_arguments<'a>(
        &self,
        count: usize,
        type_of: impl Fn(usize, &str) -> Result<&'a TensorType>,
    ) -> Result<()> {
        if count != self.inputs.len() {
            return Err(Error::Invalid(format!(
                "executable has {} inputs, got {count}",
                self.inputs.len()
            )));
        }
        for (i, (name, ty)) in self.inputs.iter().enumerate() {
            let got = type_of(i, name)?;
            if got != ty {
                return Err(Error::InputMismatch {
                    index: i,
                    name: name.clone(),
                    expected: ty.to_string(),
                    got: got.to_string(),
                });
            }
        }
        Ok(())
    }

    fn new(mut exe: pjrt::LoadedExecutable, graph: &Graph, mlir: String) -> Self {
        exe.set_weight_inputs(weight_inputs(graph));
        exe.set_team_use(team_use(graph));
        XlaExecutable {
            exe,
            inputs: graph
                .inputs()
                .iter()
                .map(|i| (i.name.clone(), i.ty.clone()))
                .collect(),
            outputs: graph.output_types(),
            plain_outputs: OnceLock::new(),
            mlir,
        }
    }

    /// The StableHLO text this executable was compiled from.
    pub fn mlir(&self) -> &str {
        &self.mlir
    }

    /// The PJRT executable.
    pub fn raw(&self) -> &pjrt::LoadedExecutable {
        &self.exe
    }

    /// The plugin's optimized program as a serialized `xla.HloModuleProto` (what XLA's own
    /// tools read), from `PJRT_Executable_OptimizedProgram`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] if the plugin does not implement
    /// `PJRT_Executable_OptimizedProgram` or answers in a format other than HLO;
    /// [`Error::Pjrt`] if it refuses.
    pub fn optimized_hlo_proto(&self) -> Result<Vec<u8>> {
        let (format, code) = self.exe.optimized_program()?;
        hlo::module_bytes(&format, &code)
    }

    /// The plugin's optimized program in HLO text syntax: the module after XLA's passes
    /// (fusions, layouts, the custom calls it kept), as kiln prints it from
    /// [`XlaExecutable::optimized_hlo_proto`] (structure, shapes, layouts, operands and the
    /// ops' attributes; sharding and frontend attributes are left out).
    ///
    /// # Errors
    /// As [`XlaExecutable::optimized_hlo_proto`].
    pub fn optimized_hlo(&self) -> Result<String> {
        hlo::module_text(&self.optimized_hlo_proto()?)
    }
}

/// How the XLA backend compiles: XLA debug options passed to the plugin with every compile,
/// and the lowering strategy for convolutions.
///
/// [`XlaOptions::default`] holds the defaults measured best on the CPU plugin (see
/// `examples/conv_profile.rs`); [`XlaOptions::plain`] is the plugin's own behaviour (no
/// overrides, every convolution a `stablehlo.convolution`). Both parts are in the backend's
/// [`cache_key`](Backend::cache_key), so executables cached on disk under other options are
/// never reused.
///
/// ```no_run
/// # use kiln::backend::xla::{XlaBackend, XlaOptions, ConvStrategy, OptionValue};
/// # fn main() -> kiln::Result<()> {
/// let backend = XlaBackend::new()?.with_options(
///     XlaOptions::default()
///         .debug_option("xla_cpu_enable_fast_math", OptionValue::Bool(false))
///         .conv(ConvStrategy::Direct),
/// );
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct XlaOptions {
    /// XLA `DebugOptions` overrides by field name (`xla_cpu_*`, ...), sent as
    /// `CompileOptionsProto.env_option_overrides`. A name the plugin's XLA does not know makes
    /// every compile fail with the plugin's message. Later entries win. On the CPU plugin
    /// kiln adds its own defaults where these do not set the option
    /// ([`XlaOptions::on_platform`]: XNNPACK off), and a graph whose reductions all run along
    /// short rows also gets XLA's tree-reduction pass disabled ([`reductions`]) unless these
    /// set `xla_disable_hlo_passes` themselves.
    pub debug_options: Vec<(String, OptionValue)>,
    /// Which lowering each convolution gets (when `ffi` does not hand it to libtorch).
    pub conv: ConvStrategy,
    /// Which convolutions and dots run as libtorch kernels inside the executable
    /// ([`kernels`]); ignored (pure XLA) when the plugin cannot run them.
    pub ffi: FfiMode,
    /// Whether each convolution's and dot's lowering is chosen by timing the candidates
    /// ([`autotune`]) or by the rules of `conv` and `ffi`. Measurement only chooses where the
    /// options leave a choice: not under [`FfiMode::All`], and between XLA and im2col only
    /// under [`ConvStrategy::Auto`].
    pub autotune: Autotune,
}

impl Default for XlaOptions {
    /// The measured defaults: no debug option overrides (a backend adds its platform's,
    /// [`XlaOptions::on_platform`]), [`ConvStrategy::Auto`] and
    /// [`FfiMode::Auto`] (libtorch kernels for the convolutions and dots where the
    /// measurements favour them; pure XLA on a plugin that cannot run them), and
    /// [`Autotune::default`] (off unless `KILN_AUTOTUNE=on`: the rules decide).
    ///
    /// On the CPU plugin (xla-cpu-pjrt 0.0.1) none of `xla_cpu_use_xnnpack` (true/false),
    /// `xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY`,
    /// `xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_DOT`, `xla_cpu_use_onednn`
    /// (with or without `xla_cpu_experimental_onednn_fusion_type`), `xla_cpu_enable_fast_math`,
    /// `xla_cpu_prefer_vector_width=512`, `xla_cpu_experimental_ynn_fusion_type` or
    /// `xla_cpu_multi_thread_eigen=false` made resnet18's convolutions faster, direct or im2col
    /// (same or up to 1.4× slower); `xla_cpu_use_thunk_runtime` no longer exists in it. Its
    /// products are another matter: see [`XlaOptions::on_platform`].
    fn default() -> Self {
        XlaOptions {
            debug_options: Vec::new(),
            conv: ConvStrategy::Auto,
            ffi: FfiMode::Auto,
            autotune: Autotune::default(),
        }
    }
}

impl XlaOptions {
    /// The plugin's own lowering: no overrides, every convolution direct, no libtorch
    /// kernels (a backend still adds its platform's defaults, [`XlaOptions::on_platform`]).
    pub fn plain() -> Self {
        XlaOptions {
            debug_options: Vec::new(),
            conv: ConvStrategy::Direct,
            ffi: FfiMode::Off,
            autotune: Autotune::off(),
        }
    }

    /// Sets how lowerings are chosen: by measurement or by rule ([`Autotune`]).
    pub fn autotune(mut self, autotune: Autotune) -> Self {
        self.autotune = autotune;
        self
    }

    /// Sets which convolutions and dots run as libtorch kernels ([`FfiMode`]).
    pub fn ffi(mut self, mode: FfiMode) -> Self {
        self.ffi = mode;
        self
    }

    /// Adds (or replaces) one debug option override.
    pub fn debug_option(mut self, name: impl Into<String>, value: OptionValue) -> Self {
        let name = name.into();
        self.debug_options.retain(|(n, _)| *n != name);
        self.debug_options.push((name, value));
        self
    }

    /// Sets the convolution lowering strategy.
    pub fn conv(mut self, strategy: ConvStrategy) -> Self {
        self.conv = strategy;
        self
    }

    /// The serialized `CompileOptionsProto` of these options' debug options as they stand
    /// (a backend compiles with [`XlaOptions::on_platform`]'s).
    pub fn compile_options_bytes(&self) -> Vec<u8> {
        pjrt::compile_options_bytes_with(&self.debug_options)
    }

    /// These options with kiln's defaults for a plugin of `platform` added where the debug
    /// options do not set them; what an [`XlaBackend`] compiles with. On `"cpu"`:
    /// `xla_cpu_use_xnnpack = false`, so that XLA runs its products with its own (Eigen)
    /// kernels, not XNNPACK's.
    ///
    /// Why: xla-cpu-pjrt 0.0.1 runs a product through XNNPACK by building an XNNPACK
    /// runtime that packs the right operand as constant weights, and builds it again
    /// whenever that operand's buffer changes: every step of a training program, whose
    /// weights are new buffers each step. In vit's fused training step (`perf`, 60 steps)
    /// XNNPACK's weight packing (`xnn_pack_f32_gemm_gio_w`) took 13.6 % of all samples
    /// against 20.7 % in its matrix kernel. One process alternating blocks of 3 steps, 10
    /// rounds, median ms, XNNPACK on / off, 2-vCPU AMD EPYC Zen 4; "on" timed first in each
    /// round: vit fused 58.6 / 48.9, split 51.8 / 46.4; bert fused 67.9 / 51.7, split 66.5 /
    /// 65.0; mobilenet_v2 fused 37.2 / 34.4, squeezenet1_1 14.7 / 12.9, resnet18 72.6 /
    /// 72.8; "off" first (the second place in a round gains 2–8 % by itself, measured with
    /// the same options twice): vit fused 57.5 / 50.1, split 47.5 / 47.6; bert fused 52.3 /
    /// 43.6, split 52.9 / 53.2. So fused steps gain 13–24 %, split steps little. Inference,
    /// "on" first, blocks of 3 calls: bert 12.56 / 12.37, vit 13.50 / 13.01, resnet18 14.65
    /// / 14.26, mobilenet_v2 5.77 / 5.73.
    pub fn on_platform(&self, platform: &str) -> XlaOptions {
        let mut o = self.clone();
        if platform == "cpu" && !self.sets(CPU_XNNPACK_OPTION) {
            o.debug_options
                .insert(0, (CPU_XNNPACK_OPTION.into(), OptionValue::Bool(false)));
        }
        o
    }

    /// Do the debug options set the option `name`?
    fn sets(&self, name: &str) -> bool {
        self.debug_options.iter().any(|(n, _)| n == name)
    }

    /// The options a CPU graph whose reductions are all short rows compiles with
    /// ([`reductions::flat_reductions_pay`]): these plus XLA's tree-reduction pass disabled,
    /// unless `xla_disable_hlo_passes` is already set here (the caller's choice stands).
    pub fn flat_reduction_options(&self) -> XlaOptions {
        let mut o = self.clone();
        if !self.sets("xla_disable_hlo_passes") {
            o.debug_options.push((
                "xla_disable_hlo_passes".into(),
                OptionValue::Str(reductions::TREE_REDUCTION_PASS.into()),
            ));
        }
        o
    }
}

/// The XLA CPU debug option that runs products through XNNPACK (see
/// [`XlaOptions::on_platform`]).
const CPU_XNNPACK_OPTION: &str = "xla_cpu_use_xnnpack";

static NEXT_CLIENT_ID: AtomicU64 = AtomicU64::new(1);

/// The XLA backend over one PJRT client (device 0). Cheap to clone; thread-safe.
#[derive(Clone)]
pub struct XlaBackend {
    inner: Arc<Inner>,
    options: Arc<XlaOptions>,
    /// `options` serialized, as given and for graphs that compile without tree reductions on
    /// the CPU plugin ([`XlaBackend::options_bytes_for`]).
    option_bytes: reductions::CompileOptionBytes,
}

struct Inner {
    client: pjrt::Client,
    /// Process-unique: executables compiled by one client cannot run another's buffers.
    id: u64,
    api: pjrt::Api,
    /// Whether kiln's FFI kernels run on this plugin: registered and checked by compiling and
    /// running a self-test graph, once (`Err` holds the reason they do not).
    ffi: OnceLock<std::result::Result<(), String>>,
    plugin: PathBuf,
    platform: String,
    platform_version: String,
    api_version: (i32, i32),
    /// Autotune's choices (shared by every options set: keys include the compile options).
    tuner: Mutex<Tuner>,
    /// [`Backend::graph_cache_key`] by graph fingerprint and [`Backend::cache_key`]: choices
    /// never change within a process once made, so neither does a graph's key.
    graph_keys: Mutex<HashMap<(Fingerprint, String), String>>,
    /// Under autotune, each graph's rewrite by its fingerprint and [`Backend::cache_key`].
    rewrites: Mutex<HashMap<(Fingerprint, String), Graph>>,
}

/// The plugin's client, but never with more CPU devices than the process has CPUs.
///
/// Why: the CPU plugin (`xla-cpu-pjrt` 0.0.1 and later XLA alike) creates 4 devices unless
/// told otherwise, and sizes its intra-op thread pool to the larger of the CPU count and
/// the device count; on 2 vCPUs that is 4 XLA worker threads on 2 CPUs (and 4 on one CPU
/// under `--threads 1`), preempting one another in every parallel loop. Measured on a
/// 2-vCPU Zen 2, bert inference in a loop of 400 calls, median ms: 16.0 and 15.8 with the
/// plugin's 4 devices, 13.4 with 2 and 13.5-13.7 with 1 (eager: 15.0).
///
/// So when `options` leave `cpu_device_count` to the plugin and a CPU client comes out with
/// more devices than `cpus`, it is made again with `cpu_device_count = cpus` (at least 1).
/// Explicit options are kept as given (e.g. 8 devices to try data parallelism on a small
/// machine); other platforms are left alone.
fn cpu_client_within_cpus(
    api: &pjrt::Api,
    options: &[(String, pjrt::NamedValue)],
    cpus: Option<usize>,
) -> Result<pjrt::Client> {
    let client = pjrt::Client::with_options(api, options)?;
    let Some(cpus) = cpus else {
        return Ok(client);
    };
    let chosen = options.iter().any(|(name, _)| name == "cpu_device_count");
    if chosen || client.addressable_device_count() <= cpus || client.platform_name()? != "cpu" {
        return Ok(client);
    }
    drop(client);
    let mut options = options.to_vec();
    options.push((
        "cpu_device_count".to_string(),
        pjrt::NamedValue::Int(cpus.max(1) as i64),
    ));
    pjrt::Client::with_options(api, &options)
}

/// Sets `TF_CPP_MIN_LOG_LEVEL=1` where the user has not set it. The CPU plugin logs every
/// create option it reads at INFO level to stderr ("cpu_device_count set via create_options:
/// 2", after a line saying its logging is not initialized). Its logging (TSL's) honours this
/// variable, read when the plugin is loaded; 1 keeps warnings and errors. Once per process:
/// changing the environment races with C code reading it on other threads, so it is done
/// at most once, before the first plugin loads.
fn quiet_plugin_info_logs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        const VAR: &str = "TF_CPP_MIN_LOG_LEVEL";
        if std::env::var_os(VAR).is_none() {
            std::env::set_var(VAR, "1");
        }
    });
}

impl XlaBackend {
    /// [`Backend::execute`], or [`Backend::execute_awaited`] if `awaited`.
    fn execute_checked(
        &self,
        exe: &XlaExecutable,
        inputs: &[&XlaBuffer],
        awaited: bool,
    ) -> Result<Vec<XlaBuffer>> {
        exe.check_arguments(inputs.len(), |i, _| Ok(&inputs[i].ty))?;
        let raw: SmallVec<[&pjrt::Buffer; 8]> = inputs.iter().map(|b| &b.buffer).collect();
        let outs = if awaited {
            exe.exe.execute_awaited(&raw)?
        } else {
            exe.exe.execute(&raw)?
        };
        if outs.len() != exe.outputs.len() {
            return Err(Error::Invalid(format!(
                "executable returned {} outputs, expected {}",
                outs.len(),
                exe.outputs.len()
            )));
        }
        let plain = exe.plain_outputs.get_or_init(|| {
            outs.iter()
                .zip(&exe.outputs)
                .map(|(b, ty)| b.is_plain_array(ty.shape.dims(), ty.dtype.size_in_bytes()))
                .collect()
        });
        Ok(outs
            .into_iter()
            .zip(&exe.outputs)
            .zip(plain.iter())
            .map(|((mut buffer, ty), &plain)| {
                if plain {
                    buffer.mark_plain();
                }
                XlaBuffer {
                    buffer,
                    ty: ty.clone(),
                }
            })
            .collect())
    }

    /// [`Backend::tensor_to_device`], or with `lend` [`Backend::lend_to_device`].
    fn upload_tensor(&self, t: &crate::Tensor, lend: bool) -> Result<XlaBuffer> {
        let ty = t.ty();
        if ty.dtype != DType::U32 {
            let tt = t.as_tch()?;
            if tt.device() == tch::Device::Cpu
                && tt.kind() == crate::backend::eager::kind_of(ty.dtype)
                && tt.is_contiguous()
            {
                let dims: SmallVec<[i64; 8]> = ty.shape.dims().iter().map(|&d| d as i64).collect();
                let client = &self.inner.client;
                let et = element_type(ty.dtype);
                let buffer = if lend {
                    client.lend_tch(tt, et, &dims, 0)?
                } else {
                    client.buffer_from_tch(tt, et, &dims, 0)?
                };
                return Ok(XlaBuffer {
                    buffer,
                    ty: ty.clone(),
                });
            }
        }
        self.to_device(&t.to_host()?)
    }

    /// Copies `t` to addressable device `device` of this backend's client.
    pub(crate) fn upload_to(&self, t: &HostTensor, device: usize) -> Result<XlaBuffer> {
        let ty = t.ty().clone();
        let dims: Vec<i64> = ty.shape.to_i64();
        let buffer =
            self.inner
                .client
                .buffer_from_host(t.bytes(), element_type(ty.dtype), &dims, device)?;
        Ok(XlaBuffer { buffer, ty })
    }

    /// The backend on the default plugin (see [`default_plugin_path`]). On a CPU plugin, its
    /// client has one device per CPU the process may use, at most the plugin's default (4):
    /// the plugin runs at least one worker thread per device.
    pub fn new() -> Result<Self> {
        Self::from_plugin(default_plugin_path()?)
    }

    /// The backend on the plugin at `path` (a CPU plugin's devices as in [`XlaBackend::new`]).
    pub fn from_plugin(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_plugin_with(path, &[])
    }

    /// The backend on the plugin at `path`, its client created with plugin-specific options
    /// ([`pjrt::Client::with_options`]). Without `cpu_device_count` among them, a CPU client
    /// gets at most one device per CPU (see [`XlaBackend::new`]); with it, that many, e.g.
    /// more CPU devices for [`XlaBackend::replicated`]:
    ///
    /// ```no_run
    /// # use kiln::backend::xla::{default_plugin_path, pjrt::NamedValue, XlaBackend};
    /// # fn main() -> kiln::Result<()> {
    /// let opts = [("cpu_device_count".to_string(), NamedValue::Int(8))];
    /// let eight = XlaBackend::from_plugin_with(default_plugin_path()?, &opts)?.replicated(8)?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn from_plugin_with(
        path: impl AsRef<Path>,
        options: &[(String, pjrt::NamedValue)],
    ) -> Result<Self> {
        let path = path.as_ref();
        quiet_plugin_info_logs();
        let api = pjrt::Api::load(path)?;
        let client = cpu_client_within_cpus(&api, options, kernels::process_cpus())?;
        let platform = client.platform_name()?;
        let option_bytes = reductions::CompileOptionBytes::new(
            &XlaOptions::default().on_platform(&platform),
            pjrt::compile_options_bytes_with,
        );
        let platform_version = client.platform_version()?;
        let api_version = api.version();
        Ok(XlaBackend {
            inner: Arc::new(Inner {
                client,
                id: NEXT_CLIENT_ID.fetch_add(1, Ordering::Relaxed),
                api,
                ffi: OnceLock::new(),
                plugin: path.to_path_buf(),
                platform,
                platform_version,
                api_version,
                tuner: Mutex::new(Tuner::default()),
                graph_keys: Mutex::new(HashMap::new()),
                rewrites: Mutex::new(HashMap::new()),
            }),
            option_bytes,
            options: Arc::new(XlaOptions::default()),
        })
    }

    /// The same backend (same client, devices and buffers) compiling with `options`.
    pub fn with_options(&self, options: XlaOptions) -> Self {
        XlaBackend {
            inner: self.inner.clone(),
            option_bytes: reductions::CompileOptionBytes::new(
                &options.on_platform(&self.inner.platform),
                pjrt::compile_options_bytes_with,
            ),
            options: Arc::new(options),
        }
    }

    /// Does this backend lower to kiln's kernels (the plugin runs them and the options allow
    /// them)? Then the lowering may also emit kiln's own calls (ordering, identity).
    fn has_kernels(&self) -> bool {
        self.effective_ffi() != FfiMode::Off
    }

    /// The options this backend compiles with.
    pub fn options(&self) -> &XlaOptions {
        &self.options
    }

    /// Lowers `graph` to the StableHLO text [`Backend::compile`] compiles.
    ///
    /// The graph may be rewritten ([`Backend::rewrite`], as kiln's runtime does before
    /// fingerprinting) or not: a graph this backend did not rewrite is rewritten here on a
    /// copy first. The rewrite is idempotent, so both give the same text. Convolutions and
    /// dots become calls to kiln's libtorch kernels where their chosen lowering is
    /// [`Lowering::Ffi`] (see [`XlaBackend::choices`]).
    pub fn lower(&self, graph: &Graph) -> Result<String> {
        // As `rewrite` does: the ordering call is one of the kernels, and the kernels'
        // patterns are written over graphs without stop-gradients.
        let kernels = self.has_kernels();
        let strip = |op: &crate::ir::Op| match op {
            crate::ir::Op::Barrier => !kernels,
            crate::ir::Op::StopGradient => true,
            _ => false,
        };
        if graph
            .petgraph()
            .node_indices()
            .any(|id| strip(&graph.node(id).op))
        {
            let mut g = graph.clone();
            crate::passes::bypass(&mut g, strip)?;
            return self.lower(&g);
        }
        let tuning = self.autotuning();
        let variant = match tuning.then(|| self.rewritten_variant(&graph.fingerprint())) {
            Some(Some(v)) => v,
            Some(None) => {
                let mut g = graph.clone();
                self.rewrite(&mut g)?;
                let v = self
                    .rewritten_variant(&g.fingerprint())
                    .unwrap_or(Variant::Tuned);
                let choices = self.variant_choices(&g, v, &|_| false)?;
                return lower::lower_with(&g, &chosen_kernels(&choices, self.has_kernels()));
            }
            None => Variant::Rule,
        };
        let choices = self.variant_choices(graph, variant, &|_| false)?;
        let widen = graph
            .petgraph()
            .node_indices()
            .any(|id| WidenHalf::picks(graph, id));
        if widen || choices.iter().any(|c| c.1 == Lowering::Im2col) {
            let mut g = graph.clone();
            WidenHalf.run(&mut g)?;
            self.apply_variant(&mut g, variant, &|_| false)?;
            let choices = self.variant_choices(&g, variant, &|_| false)?;
            lower::lower_with(&g, &chosen_kernels(&choices, self.has_kernels()))
        } else {
            lower::lower_with(graph, &chosen_kernels(&choices, self.has_kernels()))
        }
    }

    /// The variant a graph with fingerprint `fp` was rewritten under by this backend (its
    /// client, under these options; under autotune).
    fn rewritten_variant(&self, fp: &Fingerprint) -> Option<Variant> {
        let key = (*fp, self.cache_key());
        self.inner.tuner.lock().rewritten.get(&key).copied()
    }

    /// The directory autotune's choices are stored in, if any.
    fn tune_dir(&self) -> Option<&Path> {
        let s = &self.options.autotune;
        s.dir.as_deref().filter(|_| s.enabled)
    }

    /// What the options leave to choose on this plugin.
    fn caps(&self) -> Caps {
        Caps {
            ffi: self.effective_ffi(),
            conv: self.options.conv.clone(),
        }
    }

    /// Are lowerings chosen by measurement (autotune on, and the options leave a choice)?
    pub fn autotuning(&self) -> bool {
        self.options.autotune.enabled && self.caps().tunable()
    }

    /// The lowering of every convolution and dot of `graph` (by node, in topological order):
    /// measured ([`autotune`]; measuring the sites not measured before, within the autotune
    /// budget) or by rule.
    ///
    /// These are the per-node choices; under autotune the rewrite then checks whole graphs
    /// and may use the rule's or pure XLA's choices instead (see
    /// [`XlaBackend::autotune_graph_report`]).
    pub fn choices(&self, graph: &Graph) -> Result<Vec<(NodeId, Lowering)>> {
        let v = if self.autotuning() {
            Variant::Tuned
        } else {
            Variant::Rule
        };
        Ok(self
            .variant_choices(graph, v, &|_| false)?
            .into_iter()
            .map(|(n, l, _)| (n, l))
            .collect())
    }

    /// The choices of `variant` for `graph`'s nodes, with site keys, adding the nodes
    /// `report` accepts to the autotune report.
    fn variant_choices(
        &self,
        graph: &Graph,
        variant: Variant,
        report: &dyn Fn(NodeId) -> bool,
    ) -> Result<Vec<autotune::Chosen>> {
        // The FFI self-test compiles and runs a graph: before taking the tuner's lock.
        let mut caps = self.caps();
        let mut settings = self.options.autotune.clone();
        match variant {
            Variant::Tuned => {}
            Variant::Rule => settings.enabled = false,
            Variant::PureXla => {
                settings.enabled = false;
                caps.ffi = FfiMode::Off;
            }
        }
        let settings = &settings;
        // Only measured choices need the context (keys); the rule runs on every traced call.
        let context = if settings.enabled && caps.tunable() {
            autotune::context(&self.plugin_id(), self.option_bytes.usual())
        } else {
            String::new()
        };
        let mut tuner = self.inner.tuner.lock();
        let dir = self.tune_dir();
        if let Some(d) = dir {
            tuner.load(d);
        }
        let reps = settings.reps.max(1);
        let mut timer = |g: &Graph, node: NodeId, l: Lowering, cap: f64| {
            self.time_lowering(g, node, l, reps, cap)
        };
        let choices = tuner.choose(graph, &caps, settings, &context, &mut timer, report)?;
        if let Some(d) = dir {
            tuner.save(d);
        }
        Ok(choices)
    }

    /// Rewrites the convolutions `variant` lowers as im2col, then chooses for the dots that
    /// makes (reporting the nodes `report` accepts).
    fn apply_variant(
        &self,
        graph: &mut Graph,
        variant: Variant,
        report: &dyn Fn(NodeId) -> bool,
    ) -> Result<()> {
        let choices = self.variant_choices(graph, variant, &|_| false)?;
        let im2col: Vec<NodeId> = choices
            .iter()
            .filter(|c| c.1 == Lowering::Im2col)
            .map(|c| c.0)
            .collect();
        if im2col_nodes(graph, &im2col)? {
            self.variant_choices(graph, variant, report)?;
        }
        Ok(())
    }

    /// Under autotune, which set of choices `graph` (not yet rewritten) is compiled with:
    /// the measured per-node choices, unless the whole graph runs faster under the rule's or
    /// pure XLA's (timed here when the sets differ and the graph is new).
    fn graph_variant(&self, graph: &Graph) -> Result<Variant> {
        let fp = graph.fingerprint();
        // Report each graph's choices once, not on every traced call.
        let first = self.inner.tuner.lock().reported.insert(fp);
        let tuned = self.variant_choices(graph, Variant::Tuned, &|_| first)?;
        let rule = self.variant_choices(graph, Variant::Rule, &|_| false)?;
        let pure = self.variant_choices(graph, Variant::PureXla, &|_| false)?;
        let plain = |c: &[autotune::Chosen]| -> Vec<(NodeId, Lowering)> {
            c.iter().map(|x| (x.0, x.1)).collect()
        };
        let mut distinct: Vec<(Variant, Vec<(NodeId, Lowering)>)> = Vec::new();
        for (v, c) in [
            (Variant::Tuned, plain(&tuned)),
            (Variant::Rule, plain(&rule)),
            (Variant::PureXla, plain(&pure)),
        ] {
            if !distinct.iter().any(|d| d.1 == c) {
                distinct.push((v, c));
            }
        }
        if distinct.len() == 1 || !self.options.autotune.check_graphs {
            return Ok(Variant::Tuned);
        }
        let mut h = blake3::Hasher::new();
        h.update(b"kiln-autotune-graph-v1\0");
        h.update(autotune::context(&self.plugin_id(), self.option_bytes.usual()).as_bytes());
        h.update(&fp.0);
        for (v, c) in &distinct {
            h.update(v.name().as_bytes());
            for (n, l) in c {
                h.update(&n.index().to_le_bytes());
                h.update(l.name().as_bytes());
            }
        }
        let key = *h.finalize().as_bytes();
        let nodes = tuned.len();
        {
            let mut t = self.inner.tuner.lock();
            if let Some(dir) = self.tune_dir() {
                t.load(dir);
            }
            if let Some(c) = t.graphs.get(&key).cloned() {
                if first {
                    t.graph_report.push(GraphChoice {
                        source: Source::Cached,
                        ..c.clone()
                    });
                }
                return Ok(c.variant);
            }
        }
        let started = std::time::Instant::now();
        let millis = self.time_variants(graph, &distinct)?;
        let variant = autotune::decide_variant(&millis).unwrap_or(Variant::Tuned);
        let mut t = self.inner.tuner.lock();
        t.spent += started.elapsed();
        t.record_graph(
            key,
            GraphChoice {
                nodes,
                variant,
                source: Source::Measured,
                millis,
            },
        );
        if let Some(dir) = self.tune_dir() {
            t.save(dir);
        }
        Ok(variant)
    }

    /// Compiles `graph` under each variant and times them interleaved in rotating order: ms
    /// per run, median of [`Autotune::reps`] to [`WHOLE_GRAPH_ROUNDS`] rounds (about a second
    /// per variant) after a warm-up (a variant that fails to compile or run is infinitely
    /// slow).
    fn time_variants(
        &self,
        graph: &Graph,
        variants: &[(Variant, Vec<(NodeId, Lowering)>)],
    ) -> Result<Vec<(Variant, f64)>> {
        let mut exes = Vec::new();
        for (v, _) in variants {
            let built = (|| -> Result<pjrt::LoadedExecutable> {
                let mut g = graph.clone();
                self.apply_variant(&mut g, *v, &|_| false)?;
                let choices = self.variant_choices(&g, *v, &|_| false)?;
                let mut exe = self.compile_mlir(&lower::lower_with(
                    &g,
                    &chosen_kernels(&choices, self.has_kernels()),
                )?)?;
                // As a compiled function's executable: frozen variables key packed weights,
                // which later runs reuse (else every run would pack them afresh).
                exe.set_weight_inputs(weight_inputs(&g));
                exe.set_team_use(team_use(&g));
                Ok(exe)
            })();
            match built {
                Ok(e) => exes.push((*v, Some(e))),
                Err(e) => {
                    log::info!(target: "kiln::autotune", "variant {v} failed to compile: {e}");
                    exes.push((*v, None));
                }
            }
        }
        let inputs: Vec<HostTensor> = graph
            .inputs()
            .iter()
            .enumerate()
            .map(|(i, inp)| match inp.ty.dtype {
                DType::F32 | DType::F64 => autotune::random_input(&inp.ty, i as u64 + 1),
                _ => HostTensor::from_bytes(inp.ty.clone(), vec![0u8; inp.ty.size_in_bytes()]),
            })
            .collect::<Result<_>>()?;
        let donating = !graph.aliases().is_empty();
        let shared: Vec<XlaBuffer> = if donating {
            Vec::new()
        } else {
            inputs
                .iter()
                .map(|h| self.to_device(h))
                .collect::<Result<_>>()?
        };
        let run = |exe: &pjrt::LoadedExecutable| -> Result<f64> {
            // Donated inputs are consumed: fresh copies for every run.
            let fresh: Vec<XlaBuffer> = if donating {
                inputs
                    .iter()
                    .map(|h| self.to_device(h))
                    .collect::<Result<_>>()?
            } else {
                Vec::new()
            };
            let bufs = if donating { &fresh } else { &shared };
            for b in bufs {
                b.buffer.ready()?;
            }
            let raw: Vec<&pjrt::Buffer> = bufs.iter().map(|b| &b.buffer).collect();
            let t = std::time::Instant::now();
            for o in exe.execute(&raw)? {
                o.ready()?;
            }
            Ok(t.elapsed().as_secs_f64() * 1e3)
        };
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); exes.len()];
        // Cheap graphs get more rounds (up to WHOLE_GRAPH_ROUNDS, about a second per variant):
        // whole-model times on a shared machine vary by ±15 %.
        let mut rounds = self.options.autotune.reps.max(1);
        let mut round = 0;
        while round <= rounds {
            let n = exes.len();
            for k in 0..n {
                // Rotating order: a run after one with libtorch kernels can pay for their
                // threads winding down.
                let i = (round + k) % n;
                let (v, exe) = &mut exes[i];
                let Some(e) = exe else { continue };
                match run(e) {
                    // Round 0 warms up, and sizes the number of rounds.
                    Ok(t) if round == 0 => {
                        let fit = (WHOLE_GRAPH_SECONDS * 1e3 / t.max(1e-3)) as usize;
                        rounds = rounds.max(fit.min(WHOLE_GRAPH_ROUNDS));
                    }
                    Ok(t) => times[i].push(t),
                    Err(err) => {
                        log::info!(target: "kiln::autotune", "variant {v} failed to run: {err}");
                        *exe = None;
                    }
                }
            }
            round += 1;
        }
        Ok(exes
            .iter()
            .zip(times)
            .map(|((v, e), mut t)| {
                if e.is_none() || t.is_empty() {
                    return (*v, f64::INFINITY);
                }
                t.sort_by(f64::total_cmp);
                (*v, t[t.len() / 2])
            })
            .collect())
    }

    /// The plugin's identity in autotune keys.
    fn plugin_id(&self) -> String {
        format!(
            "{}/{}/pjrt{}.{}",
            self.inner.platform,
            self.inner.platform_version,
            self.inner.api_version.0,
            self.inner.api_version.1
        )
    }

    /// The whole-graph checks made under autotune (by rewrites on this backend's client),
    /// in order: which set of choices each graph was compiled with, and the ms per run
    /// measured for each distinct set.
    pub fn autotune_graph_report(&self) -> Vec<GraphChoice> {
        self.inner.tuner.lock().graph_report.clone()
    }

    /// Times `micro` (a site cut out by autotune, `node` its convolution or dot) lowered as
    /// `lowering`: µs per call, median of up to `reps` runs after two warm-ups, stopping early
    /// once the best of at least two runs takes more than `cap` µs.
    fn time_lowering(
        &self,
        micro: &Graph,
        node: NodeId,
        lowering: Lowering,
        reps: usize,
        cap: f64,
    ) -> Result<f64> {
        let mut g = micro.clone();
        let mut ffi = HashSet::new();
        match lowering {
            Lowering::Xla => {}
            Lowering::Im2col => {
                im2col_nodes(&mut g, &[node])?;
            }
            Lowering::Ffi => {
                ffi.insert(node);
            }
        }
        let selection = ChosenKernels {
            nodes: ffi,
            kernels: self.has_kernels(),
        };
        let mlir = lower::lower_with(&g, &selection)?;
        let exe = self.compile_mlir(&mlir)?;
        let bufs: Vec<XlaBuffer> = g
            .inputs()
            .iter()
            .enumerate()
            .map(|(i, inp)| self.to_device(&autotune::random_input(&inp.ty, i as u64 + 1)?))
            .collect::<Result<_>>()?;
        let raw: Vec<&pjrt::Buffer> = bufs.iter().map(|b| &b.buffer).collect();
        let run = || -> Result<f64> {
            let t = std::time::Instant::now();
            for o in exe.execute(&raw)? {
                o.ready()?;
            }
            Ok(t.elapsed().as_secs_f64() * 1e6)
        };
        // Two warm-ups: XLA may run the first calls on different worker threads, each of
        // which sets up libtorch's threads on its first kernel.
        run()?;
        run()?;
        let mut ts = Vec::with_capacity(reps);
        for _ in 0..reps {
            ts.push(run()?);
            // A clear loser stops early: its best of two runs (robust to one disturbed run)
            // is already past the cap.
            if ts.len() >= 2 && ts.iter().copied().fold(f64::INFINITY, f64::min) > cap {
                break;
            }
        }
        ts.sort_by(f64::total_cmp);
        Ok(ts[ts.len() / 2])
    }

    /// Every choice made for the graphs this backend's client rewrote so far (all options
    /// sets), in order: node, op, shapes, chosen lowering, where the choice came from and
    /// the µs measured per candidate. Set `KILN_AUTOTUNE_LOG=1` to see them printed as they
    /// are made.
    pub fn autotune_report(&self) -> Vec<NodeChoice> {
        self.inner.tuner.lock().report.clone()
    }

    /// Clears [`XlaBackend::autotune_report`], [`XlaBackend::autotune_graph_report`] and
    /// [`XlaBackend::autotune_time`] (the choices themselves are kept, and a graph already
    /// rewritten by this client under these options is not chosen for, nor reported, again).
    pub fn clear_autotune_report(&self) {
        let mut t = self.inner.tuner.lock();
        t.report.clear();
        t.graph_report.clear();
        t.reported.clear();
        t.spent = std::time::Duration::ZERO;
    }

    /// The time spent measuring candidates (compiling and running them) by this backend's
    /// client since it was created or [`XlaBackend::clear_autotune_report`] was called.
    pub fn autotune_time(&self) -> std::time::Duration {
        self.inner.tuner.lock().spent
    }

    /// The FFI mode lowering uses: the options' mode if the plugin runs kiln's kernels, else
    /// [`FfiMode::Off`] (the reason is logged once, at `warn` level).
    pub fn effective_ffi(&self) -> FfiMode {
        if self.options.ffi == FfiMode::Off {
            return FfiMode::Off;
        }
        match self.ffi_status() {
            Ok(()) => self.options.ffi,
            Err(_) => FfiMode::Off,
        }
    }

    /// Whether kiln's libtorch kernels run inside this plugin's executables, and if not why.
    ///
    /// The first call registers the kernels with the plugin's PJRT FFI extension and compiles
    /// and runs a self-test graph (a convolution and a dot through the kernels, checked
    /// against libtorch); the outcome is kept for the backend's lifetime. Needs a CPU plugin
    /// (the kernels read and write host memory) with the FFI extension.
    pub fn ffi_status(&self) -> std::result::Result<(), String> {
        self.inner
            .ffi
            .get_or_init(|| {
                let r = kernels::enable(self);
                if let Err(why) = &r {
                    log::warn!(
                        "kiln: libtorch kernels disabled for PJRT plugin {}: {why}; convolutions \
                         and dots are lowered to XLA",
                        self.inner.plugin.display()
                    );
                }
                r
            })
            .clone()
    }

    /// The platform name reported by the plugin (`"cpu"`, `"cuda"`, ...).
    pub fn platform(&self) -> &str {
        &self.inner.platform
    }

    /// The platform version reported by the plugin (e.g. the XLA CPU client's version string).
    pub fn platform_version(&self) -> &str {
        &self.inner.platform_version
    }

    /// The plugin's PJRT C API version.
    pub fn api_version(&self) -> (i32, i32) {
        self.inner.api_version
    }

    /// The plugin path.
    pub fn plugin_path(&self) -> &Path {
        &self.inner.plugin
    }

    /// The PJRT client.
    pub fn client(&self) -> &pjrt::Client {
        &self.inner.client
    }

    /// Compiles StableHLO text directly (for tools and tests; [`Backend::compile`] lowers a
    /// graph first).
    pub fn compile_mlir(&self, mlir: &str) -> Result<pjrt::LoadedExecutable> {
        self.inner.client.compile(mlir, self.option_bytes.usual())
    }

    /// The serialized compile options for `graph`: this backend's options, with XLA's tree
    /// reductions disabled on the CPU plugin where [`reductions::flat_reductions_pay`] says
    /// so (see the `reductions` module for why and what it measured).
    pub fn options_bytes_for(&self, graph: &Graph) -> &[u8] {
        self.option_bytes.for_graph(&self.inner.platform, graph)
    }

    /// Serializes a compiled executable (for on-disk caches).
    pub fn serialize(&self, exe: &XlaExecutable) -> Result<Vec<u8>> {
        exe.exe.serialize()
    }

    /// Loads an executable serialized by [`XlaBackend::serialize`] for a graph with the same
    /// signature as `graph`.
    pub fn deserialize(&self, graph: &Graph, bytes: &[u8]) -> Result<XlaExecutable> {
        // Executables compiled with libtorch kernels need them registered before loading.
        self.effective_ffi();
        let exe = self.inner.client.deserialize_executable(bytes)?;
        let n = exe.num_outputs()?;
        if n != graph.outputs().len() {
            return Err(Error::Invalid(format!(
                "deserialized executable has {n} outputs, graph has {}",
                graph.outputs().len()
            )));
        }
        Ok(XlaExecutable::new(exe, graph, String::new()))
    }
}

impl Backend for XlaBackend {
    type Buffer = XlaBuffer;
    type Executable = XlaExecutable;

    fn name(&self) -> &str {
        "xla"
    }

    /// Chooses every convolution's and dot's lowering and rewrites the convolutions whose
    /// choice is im2col ([`im2col_nodes`]); the dots that makes are then chosen for too, so
    /// that compiling measures nothing more.
    ///
    /// Under the rule that is all. Under autotune the choices are first made node by node
    /// (measured, [`autotune`]); then, if they differ from the rule's and from pure XLA's,
    /// the whole graph is compiled and timed under each distinct set of choices (interleaved
    /// runs, median) and the fastest set is used: per-node timings miss what happens between
    /// nodes (fusion, libtorch kernels slowed down inside large executables). That decision
    /// is cached like the per-node ones.
    ///
    /// First, 16-bit float sums and transcendental functions that XLA:CPU would compute in the
    /// narrow type are made to compute in f32 ([`WidenHalf`]).
    /// A `Linear` weight (`[out, in]`, every use the right operand of a product contracting
    /// its dim 1, none of them handed to a libtorch kernel): XLA's dot reads it 1.5–1.8×
    /// faster stored `[in, out]` (`[256, 256]·[768, 256]ᵀ` 1.74 ms vs 1.10 ms, `[256,
    /// 1024]·[256, 1024]ᵀ` 1.87 vs 1.06 ms on the Zen 4; Eigen repacks the transposed
    /// operand on every call). f32 and f64 only.
    fn prefers_transposed(&self, graph: &Graph, input: usize) -> bool {
        let Some(inp) = graph.inputs().get(input) else {
            return false;
        };
        let w = graph.node(inp.node);
        if w.ty.shape.rank() != 2 || !matches!(w.ty.dtype, DType::F32 | DType::F64) {
            return false;
        }
        let users = graph.users(inp.node);
        let ffi = self.effective_ffi();
        !users.is_empty()
            && !graph.outputs().contains(&inp.node)
            && users.iter().all(|&u| {
                let n = graph.node(u);
                match &n.op {
                    crate::ir::Op::DotGeneral(d) => {
                        n.operands[..] == [n.operands[0], inp.node]
                            && n.operands[0] != inp.node
                            && d.rhs_batch.is_empty()
                            && d.rhs_contract == [1]
                            && !ffi.dot(d, &graph.node(n.operands[0]).ty, &w.ty)
                            && !ffi.packs_linear(graph, u)
                    }
                    _ => false,
                }
            })
    }

    fn rewrite(&self, graph: &mut Graph) -> Result<()> {
        // Graphs reach the backend differentiated (or never to be): a stop-gradient is the
        // identity, and the kernels' patterns (a softmax's maximum) are written without them.
        StripStopGradients.run(graph)?;
        WidenHalf.run(graph)?;
        // Lets XLA update an embedding in place under plain SGD (see the pass).
        ScaleScatterUpdates.run(graph)?;
        // The ordering barriers lower to one of kiln's kernels; without them, no order.
        if !self.has_kernels() {
            StripBarriers.run(graph)?;
        }
        if !self.autotuning() {
            return self.apply_variant(graph, Variant::Rule, &|_| false);
        }
        // Choices never change once made in a process, so neither does a graph's rewrite:
        // trace-every-time calls pay a fingerprint and a copy, not the choosing again.
        let memo = (graph.fingerprint(), self.cache_key());
        if let Some(done) = self.inner.rewrites.lock().get(&memo) {
            *graph = done.clone();
            return Ok(());
        }
        let first = !self.inner.tuner.lock().reported.contains(&memo.0);
        let variant = self.graph_variant(graph)?;
        // Report the products of im2col rewrites once too (nodes that are new).
        let before: HashSet<NodeId> = graph.petgraph().node_indices().collect();
        self.apply_variant(graph, variant, &|n| first && !before.contains(&n))?;
        let fp = graph.fingerprint();
        let key = (fp, self.cache_key());
        self.inner.tuner.lock().rewritten.insert(key, variant);
        self.inner.rewrites.lock().insert(memo, graph.clone());
        Ok(())
    }

    /// Under autotune, the variant and a digest of the choices `graph`'s nodes got (site
    /// keys and lowerings): an executable compiled under other choices is not reused. Empty
    /// under the rule, whose choices follow from [`Backend::cache_key`].
    fn graph_cache_key(&self, graph: &Graph, fp: &Fingerprint) -> Result<String> {
        if !self.autotuning() {
            return Ok(String::new());
        }
        let memo = (*fp, self.cache_key());
        if let Some(k) = self.inner.graph_keys.lock().get(&memo) {
            return Ok(k.clone());
        }
        let (g, variant) = match self.rewritten_variant(fp) {
            Some(v) => (std::borrow::Cow::Borrowed(graph), v),
            None => {
                // Not a graph this client rewrote: key what compiling it will build.
                let mut g = graph.clone();
                self.rewrite(&mut g)?;
                let v = self
                    .rewritten_variant(&g.fingerprint())
                    .unwrap_or(Variant::Tuned);
                (std::borrow::Cow::Owned(g), v)
            }
        };
        let keyed: Vec<([u8; 32], Lowering)> = self
            .variant_choices(&g, variant, &|_| false)?
            .into_iter()
            .filter_map(|(_, l, k)| k.map(|k| (k, l)))
            .collect();
        let key = format!("{variant}:{}", autotune::choices_digest(&keyed));
        self.inner.graph_keys.lock().insert(memo, key.clone());
        Ok(key)
    }

    fn compile(&self, graph: &Graph) -> Result<XlaExecutable> {
        graph.verify()?;
        let mlir = self.lower(graph)?;
        let exe = self
            .inner
            .client
            .compile(&mlir, self.options_bytes_for(graph))?;
        Ok(XlaExecutable::new(exe, graph, mlir))
    }

    fn execute(&self, exe: &XlaExecutable, inputs: &[&XlaBuffer]) -> Result<Vec<XlaBuffer>> {
        self.execute_checked(exe, inputs, false)
    }

    /// Without recording the execution's completion on the inputs
    /// ([`pjrt::LoadedExecutable::execute_awaited`]): LinearModel replays, 8 alternating
    /// process pairs of 100,000 calls, median 8.4 → 7.7 µs a call.
    fn execute_awaited(
        &self,
        exe: &XlaExecutable,
        inputs: &[&XlaBuffer],
    ) -> Result<Vec<XlaBuffer>> {
        self.execute_checked(exe, inputs, true)
    }

    fn to_device(&self, t: &HostTensor) -> Result<XlaBuffer> {
        self.upload_to(t, 0)
    }

    /// Straight from the tensor's memory when it is a contiguous CPU tensor of the element
    /// type ([`pjrt::Client::buffer_from_tch`]): no host copy first. `u32` values (held as
    /// `i64` by eager tensors) and other tensors go through [`HostTensor`].
    fn tensor_to_device(&self, t: &crate::Tensor) -> Result<XlaBuffer> {
        self.upload_tensor(t, false)
    }

    /// The tensor's memory as the buffer's storage where the plugin allows it
    /// ([`pjrt::Client::lend_tch`]; the CPU plugin does), else as
    /// [`Backend::tensor_to_device`].
    fn lend_to_device(&self, t: &crate::Tensor) -> Result<XlaBuffer> {
        self.upload_tensor(t, true)
    }

    /// Where the buffer's storage is the tensor's memory (the plugin took it without a copy).
    fn lends_in_place(&self, b: &XlaBuffer, t: &crate::Tensor) -> bool {
        let Ok(tt) = t.as_tch() else {
            return false;
        };
        b.ty == *t.ty()
            && tt.numel() > 0
            && b.buffer.storage_address() == Some(tt.data_ptr() as usize)
    }

    fn to_host(&self, b: &XlaBuffer) -> Result<HostTensor> {
        let mut data = vec![0u8; b.ty.size_in_bytes()];
        b.buffer.to_host(&mut data)?;
        HostTensor::from_bytes(b.ty.clone(), data)
    }

    /// Straight into the tensor's memory (see [`pjrt::Buffer::to_tch`]); `u32` values, which
    /// kiln's eager tensors hold as `i64`, go through the host tensor.
    fn to_tensor(&self, b: &XlaBuffer) -> Result<crate::Tensor> {
        if b.ty.dtype == DType::U32 {
            return crate::Tensor::from_host(&self.to_host(b)?);
        }
        let kind = crate::backend::eager::kind_of(b.ty.dtype);
        let t = b.buffer.to_tch_shaped(kind, b.ty.shape.dims())?;
        Ok(crate::Tensor::from_tch_with_type(t, b.ty.clone()))
    }

    /// [`Backend::to_tensor`] with fewer plugin calls for an execution's output: the
    /// layout, type and dims of each of an executable's outputs are checked once, on its
    /// first execution, and the owned buffer is read without an external reference.
    fn to_tensor_owned(&self, b: XlaBuffer) -> Result<crate::Tensor> {
        if b.ty.dtype == DType::U32 {
            return self.to_tensor(&b);
        }
        let kind = crate::backend::eager::kind_of(b.ty.dtype);
        let t = b.buffer.into_tch_plain(kind, b.ty.shape.dims())?;
        Ok(crate::Tensor::from_tch_with_type(t, b.ty))
    }

    fn buffer_type(&self, b: &XlaBuffer) -> Result<TensorType> {
        Ok(b.ty.clone())
    }

    fn sync(&self, b: &XlaBuffer) -> Result<()> {
        b.buffer.ready()
    }

    /// The buffer's ready event, asked without waiting: the CPU plugin runs a program of few
    /// flops on the calling thread inside `Execute`, whose results are then ready.
    fn is_computed(&self, b: &XlaBuffer) -> bool {
        b.buffer.is_ready_now()
    }

    fn is_donated(&self, b: &XlaBuffer) -> Result<bool> {
        b.buffer.is_deleted()
    }

    /// The StableHLO kiln emitted (`stablehlo`; lowered again from `graph` for an executable
    /// loaded from the on-disk cache, which does not keep it) and the plugin's optimized HLO
    /// (`optimized_hlo`, [`XlaExecutable::optimized_hlo`]).
    fn stages(&self, graph: &Graph, exe: &XlaExecutable) -> Vec<crate::inspect::Stage> {
        let mlir = if exe.mlir.is_empty() {
            self.lower(graph)
        } else {
            Ok(exe.mlir.clone())
        };
        vec![
            crate::inspect::Stage::new("stablehlo", "stablehlo.mlir", mlir),
            crate::inspect::Stage::new("optimized_hlo", "optimized.hlo.txt", exe.optimized_hlo()),
        ]
    }

    fn serialize_executable(&self, exe: &XlaExecutable) -> Result<Option<Vec<u8>>> {
        Ok(Some(self.serialize(exe)?))
    }

    fn deserialize_executable(&self, graph: &Graph, bytes: &[u8]) -> Result<Option<XlaExecutable>> {
        Ok(Some(self.deserialize(graph, bytes)?))
    }

    fn cache_key(&self) -> String {
        format!(
            "xla/{}/{}/pjrt{}.{}/opts{:02x?}/conv-{}/ffi-{}/flat-rows{}/{}",
            self.inner.platform,
            self.inner.platform_version,
            self.inner.api_version.0,
            self.inner.api_version.1,
            self.option_bytes.usual(),
            self.options.conv.key(),
            self.effective_ffi().key(),
            reductions::FLAT_REDUCTION_MAX,
            if self.autotuning() {
                self.options.autotune.key()
            } else {
                "rule".into()
            }
        )
    }

    fn instance_id(&self) -> u64 {
        self.inner.id
    }
}

/// The most rounds the whole-graph check times each variant for.
const WHOLE_GRAPH_ROUNDS: usize = 25;
/// About how long (s) the whole-graph check times each variant for, within
/// [`Autotune::reps`]..=[`WHOLE_GRAPH_ROUNDS`] rounds.
const WHOLE_GRAPH_SECONDS: f64 = 1.0;

/// Which inputs of `graph` may key packed weights (its variables read in place, if it has a
/// convolution the packed kernel can run; see `kernels::weights`) and which it donates.
fn weight_inputs(graph: &Graph) -> pjrt::WeightInputs {
    let donated: Vec<usize> = graph.aliases().iter().map(|&(i, _)| i).collect();
    let packs = graph.petgraph().node_indices().any(|id| {
        kernels::packed_conv(graph, id).is_some() || kernels::packed_linear(graph, id).is_some()
    });
    let sources = if packs {
        graph
            .inputs()
            .iter()
            .enumerate()
            .filter(|(i, inp)| {
                matches!(inp.kind, InputKind::Parameter | InputKind::Buffer)
                    && !inp.updated_between_calls
                    && !donated.contains(i)
            })
            .map(|(i, _)| i)
            .collect()
    } else {
        Vec::new()
    };
    pjrt::WeightInputs { sources, donated }
}

/// How a program's kernels use the OpenMP team of the thread that launches it and serves
/// them: a training program's kernels (one that computes gradients,
/// [`kernels::computes_gradients`]) let it pause when idle under [`kernels::IdlePause::Training`],
/// other programs' kernels keep it spinning, and a program without convolutions or products
/// has no kernels to say anything of.
pub(crate) fn team_use(graph: &Graph) -> TeamUse {
    if kernels::products(graph).next().is_none() {
        TeamUse::None
    } else if kernels::computes_gradients(graph) {
        TeamUse::Pausing
    } else {
        TeamUse::Spinning
    }
}

/// The nodes chosen for libtorch kernels, as the lowering's selection; `kernels` says whether
/// kiln's kernels are in the plugin (so that the lowering may also emit its own calls, the
/// ordering and identity calls).
fn chosen_kernels(choices: &[autotune::Chosen], kernels: bool) -> ChosenKernels {
    ChosenKernels {
        nodes: choices
            .iter()
            .filter(|c| c.1 == Lowering::Ffi)
            .map(|c| c.0)
            .collect(),
        kernels,
    }
}

/// The selection [`chosen_kernels`] makes: which nodes are kernels, and whether the plugin has
/// them.
struct ChosenKernels {
    nodes: HashSet<NodeId>,
    kernels: bool,
}

impl kernels::FfiSelect for ChosenKernels {
    fn picks(&self, _g: &Graph, id: NodeId) -> bool {
        self.nodes.contains(&id)
    }

    fn orders(&self) -> bool {
        self.kernels
    }
}

#[cfg(test)]
mod tests {
    use super::{
        cpu_client_within_cpus, default_plugin_path, pjrt, OptionValue, XlaBackend, XlaOptions,
        CPU_XNNPACK_OPTION,
    };
    use crate::backend::Backend;

    /// On the CPU plugin XNNPACK is off unless the options say otherwise; elsewhere nothing
    /// is added; the executables' cache key follows the options compiled with.
    #[test]
    fn cpu_options_turn_xnnpack_off_unless_set() -> crate::Result<()> {
        let xnn = |o: &XlaOptions| -> Vec<OptionValue> {
            o.debug_options
                .iter()
                .filter(|(n, _)| n == CPU_XNNPACK_OPTION)
                .map(|(_, v)| v.clone())
                .collect()
        };
        let plain = XlaOptions::default();
        assert_eq!(xnn(&plain.on_platform("cpu")), [OptionValue::Bool(false)]);
        assert!(xnn(&plain.on_platform("cuda")).is_empty());
        let on = plain.debug_option(CPU_XNNPACK_OPTION, OptionValue::Bool(true));
        assert_eq!(xnn(&on.on_platform("cpu")), [OptionValue::Bool(true)]);
        let be = XlaBackend::new()?;
        if be.platform() == "cpu" {
            let with_xnn = be.with_options(on);
            assert_ne!(be.cache_key(), with_xnn.cache_key());
            assert_eq!(
                be.cache_key(),
                be.with_options(XlaOptions::default()).cache_key()
            );
        }
        Ok(())
    }

    /// The CPU plugin's own default (4 devices) is cut to the process's CPUs, never raised,
    /// and an explicit `cpu_device_count` is kept whatever the CPUs.
    #[test]
    fn cpu_clients_get_at_most_one_device_per_cpu() -> crate::Result<()> {
        let api = pjrt::Api::load(&default_plugin_path()?)?;
        // xla-cpu-pjrt 0.0.1 makes 4; the checks below hold for any default.
        let plugin_default = pjrt::Client::new(&api)?.addressable_device_count();
        let devices = |opts: &[(String, pjrt::NamedValue)], cpus| -> crate::Result<usize> {
            Ok(cpu_client_within_cpus(&api, opts, cpus)?.addressable_device_count())
        };
        for cpus in [1, 2, 64] {
            assert_eq!(
                devices(&[], Some(cpus))?,
                cpus.min(plugin_default),
                "{cpus} CPUs"
            );
        }
        assert_eq!(devices(&[], None)?, plugin_default);
        let eight = [("cpu_device_count".to_string(), pjrt::NamedValue::Int(8))];
        assert_eq!(devices(&eight, Some(2))?, 8);
        Ok(())
    }
}
