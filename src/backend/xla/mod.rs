//! The XLA backend: lowers graphs to StableHLO text and compiles them with a PJRT plugin.
//!
//! The plugin is a shared library exporting `GetPjrtApi` (PJRT C API). It is found, in order,
//! from: the path given to [`XlaBackend::from_plugin`], the `KILN_PJRT_PLUGIN` environment
//! variable, and the CPU plugin that `scripts/bootstrap.sh` installed into the checkout (baked in
//! at build time through `.cargo/config.toml`). Any plugin with the same C API works, including
//! GPU ones; nothing here assumes a CPU.

pub mod conv;
pub mod kernels;
pub mod lower;
pub mod pjrt;

pub use conv::{ConvLowering, ConvRule, ConvStrategy};
pub use kernels::FfiMode;
pub use pjrt::OptionValue;

use crate::backend::{Backend, HostTensor};
use crate::error::{Error, Result};
use crate::ir::{ConvAttrs, DType, Graph, Op, TensorType};
use crate::passes::{Im2col, Pass};
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
    mlir: String,
}

impl XlaExecutable {
    fn new(exe: pjrt::LoadedExecutable, graph: &Graph, mlir: String) -> Self {
        XlaExecutable {
            exe,
            inputs: graph
                .inputs()
                .iter()
                .map(|i| (i.name.clone(), i.ty.clone()))
                .collect(),
            outputs: graph.output_types(),
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
    /// every compile fail with the plugin's message. Later entries win.
    pub debug_options: Vec<(String, OptionValue)>,
    /// Which lowering each convolution gets (when `ffi` does not hand it to libtorch).
    pub conv: ConvStrategy,
    /// Which convolutions and dots run as libtorch kernels inside the executable
    /// ([`kernels`]); ignored (pure XLA) when the plugin cannot run them.
    pub ffi: FfiMode,
}

impl Default for XlaOptions {
    /// The measured defaults: no debug option overrides and [`ConvStrategy::Auto`].
    ///
    /// On the CPU plugin (xla-cpu-pjrt 0.0.1) none of `xla_cpu_use_xnnpack` (true/false),
    /// `xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY`,
    /// `xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_DOT`, `xla_cpu_use_onednn`
    /// (with or without `xla_cpu_experimental_onednn_fusion_type`), `xla_cpu_enable_fast_math`,
    /// `xla_cpu_prefer_vector_width=512`, `xla_cpu_experimental_ynn_fusion_type` or
    /// `xla_cpu_multi_thread_eigen=false` made resnet18's convolutions faster, direct or im2col
    /// (same or up to 1.4× slower); `xla_cpu_use_thunk_runtime` no longer exists in it.
    fn default() -> Self {
        XlaOptions {
            debug_options: Vec::new(),
            conv: ConvStrategy::Auto,
            ffi: FfiMode::Off,
        }
    }
}

impl XlaOptions {
    /// The plugin's own behaviour: no overrides, every convolution direct, no libtorch
    /// kernels.
    pub fn plain() -> Self {
        XlaOptions {
            debug_options: Vec::new(),
            conv: ConvStrategy::Direct,
            ffi: FfiMode::Off,
        }
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

    /// The serialized `CompileOptionsProto` these options compile with.
    pub fn compile_options_bytes(&self) -> Vec<u8> {
        pjrt::compile_options_bytes_with(&self.debug_options)
    }
}

static NEXT_CLIENT_ID: AtomicU64 = AtomicU64::new(1);

/// The XLA backend over one PJRT client (device 0). Cheap to clone; thread-safe.
#[derive(Clone)]
pub struct XlaBackend {
    inner: Arc<Inner>,
    options: Arc<XlaOptions>,
    option_bytes: Arc<Vec<u8>>,
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
}

impl XlaBackend {
    /// The backend on the default plugin (see [`default_plugin_path`]).
    pub fn new() -> Result<Self> {
        Self::from_plugin(default_plugin_path()?)
    }

    /// The backend on the plugin at `path`.
    pub fn from_plugin(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let api = pjrt::Api::load(path)?;
        let client = pjrt::Client::new(&api)?;
        let platform = client.platform_name()?;
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
            }),
            options: Arc::new(XlaOptions::default()),
            option_bytes: Arc::new(XlaOptions::default().compile_options_bytes()),
        })
    }

    /// The same backend (same client, devices and buffers) compiling with `options`.
    pub fn with_options(&self, options: XlaOptions) -> Self {
        XlaBackend {
            inner: self.inner.clone(),
            option_bytes: Arc::new(options.compile_options_bytes()),
            options: Arc::new(options),
        }
    }

    /// The options this backend compiles with.
    pub fn options(&self) -> &XlaOptions {
        &self.options
    }

    /// Lowers `graph` to the StableHLO text [`Backend::compile`] compiles.
    ///
    /// The graph may be rewritten ([`Backend::rewrite`], as kiln's runtime does before
    /// fingerprinting) or not: a convolution this backend's [`ConvStrategy`] sends to im2col
    /// is rewritten here on a copy first. The rewrite is idempotent, so both give the same text.
    /// Convolutions and dots become calls to kiln's libtorch kernels where the options' FFI
    /// mode picks them and the plugin runs them ([`XlaBackend::effective_ffi`]).
    pub fn lower(&self, graph: &Graph) -> Result<String> {
        let ffi = self.effective_ffi();
        if self.needs_rewrite(graph) {
            let mut g = graph.clone();
            self.rewrite(&mut g)?;
            lower::lower_with_ffi(&g, ffi)
        } else {
            lower::lower_with_ffi(graph, ffi)
        }
    }

    /// Does `graph` hold a convolution the strategy lowers as im2col?
    fn needs_rewrite(&self, graph: &Graph) -> bool {
        let picks = self.im2col_picks();
        graph.petgraph().node_weights().any(|n| match &n.op {
            Op::Conv(c) => picks(
                c,
                &graph.node(n.operands[0]).ty,
                &graph.node(n.operands[1]).ty,
            ),
            _ => false,
        })
    }

    /// The [`Im2col`] pass's selection: the convolutions the strategy lowers as im2col.
    fn im2col_picks(&self) -> impl Fn(&ConvAttrs, &TensorType, &TensorType) -> bool + '_ {
        |c, x, w| self.options.conv.choose(c, x, w) == ConvLowering::Im2col
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
        self.inner.client.compile(mlir, &self.option_bytes)
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

    /// Rewrites the convolutions this backend's [`ConvStrategy`] lowers as im2col
    /// ([`Im2col`]).
    fn rewrite(&self, graph: &mut Graph) -> Result<()> {
        Im2col::new(self.im2col_picks()).run(graph)?;
        Ok(())
    }

    fn compile(&self, graph: &Graph) -> Result<XlaExecutable> {
        graph.verify()?;
        let mlir = self.lower(graph)?;
        let exe = self.compile_mlir(&mlir)?;
        Ok(XlaExecutable::new(exe, graph, mlir))
    }

    fn execute(&self, exe: &XlaExecutable, inputs: &[&XlaBuffer]) -> Result<Vec<XlaBuffer>> {
        if inputs.len() != exe.inputs.len() {
            return Err(Error::Invalid(format!(
                "executable has {} inputs, got {}",
                exe.inputs.len(),
                inputs.len()
            )));
        }
        for (i, (b, (name, ty))) in inputs.iter().zip(&exe.inputs).enumerate() {
            if &b.ty != ty {
                return Err(Error::InputMismatch {
                    index: i,
                    name: name.clone(),
                    expected: ty.to_string(),
                    got: b.ty.to_string(),
                });
            }
        }
        let raw: Vec<&pjrt::Buffer> = inputs.iter().map(|b| &b.buffer).collect();
        let outs = exe.exe.execute(&raw)?;
        if outs.len() != exe.outputs.len() {
            return Err(Error::Invalid(format!(
                "executable returned {} outputs, expected {}",
                outs.len(),
                exe.outputs.len()
            )));
        }
        Ok(outs
            .into_iter()
            .zip(&exe.outputs)
            .map(|(buffer, ty)| XlaBuffer {
                buffer,
                ty: ty.clone(),
            })
            .collect())
    }

    fn to_device(&self, t: &HostTensor) -> Result<XlaBuffer> {
        let ty = t.ty().clone();
        let dims: Vec<i64> = ty.shape.to_i64();
        let buffer =
            self.inner
                .client
                .buffer_from_host(t.bytes(), element_type(ty.dtype), &dims, 0)?;
        Ok(XlaBuffer { buffer, ty })
    }

    fn to_host(&self, b: &XlaBuffer) -> Result<HostTensor> {
        let mut data = vec![0u8; b.ty.size_in_bytes()];
        b.buffer.to_host(&mut data)?;
        HostTensor::from_bytes(b.ty.clone(), data)
    }

    fn buffer_type(&self, b: &XlaBuffer) -> Result<TensorType> {
        Ok(b.ty.clone())
    }

    fn sync(&self, b: &XlaBuffer) -> Result<()> {
        b.buffer.ready()
    }

    fn is_donated(&self, b: &XlaBuffer) -> Result<bool> {
        b.buffer.is_deleted()
    }

    fn serialize_executable(&self, exe: &XlaExecutable) -> Result<Option<Vec<u8>>> {
        Ok(Some(self.serialize(exe)?))
    }

    fn deserialize_executable(&self, graph: &Graph, bytes: &[u8]) -> Result<Option<XlaExecutable>> {
        Ok(Some(self.deserialize(graph, bytes)?))
    }

    fn cache_key(&self) -> String {
        format!(
            "xla/{}/{}/pjrt{}.{}/opts{:02x?}/conv-{}/ffi-{}",
            self.inner.platform,
            self.inner.platform_version,
            self.inner.api_version.0,
            self.inner.api_version.1,
            self.option_bytes,
            self.options.conv.key(),
            self.effective_ffi().key()
        )
    }

    fn instance_id(&self) -> u64 {
        self.inner.id
    }
}
