//! `--only path:FILE,class:NAME`: benchmark a model defined in a Rust file outside kiln.
//!
//! # The file
//!
//! A Rust source file (no `fn main`, no `//!` inner doc comments) that defines a type `NAME`
//! implementing [`kiln::zoo::Model`] and a constructor
//! `fn new(store: &kiln::nn::ParamStore) -> kiln::Result<NAME>` that creates its parameters in
//! `store` (seeded by `--seed`). torchbench.py's example `LinearModel`:
//!
//! ```ignore
//! use kiln::nn::{Linear, Module, ParamStore, Sequential};
//! use kiln::zoo::Model;
//! use kiln::{Result, Tensor};
//!
//! pub struct LinearModel {
//!     store: ParamStore,
//!     layers: Sequential,
//! }
//!
//! impl LinearModel {
//!     pub fn new(store: &ParamStore) -> Result<Self> {
//!         let p = store.root().sub("layers");
//!         let layers = Sequential::new()
//!             .add(Linear::new(&p.sub(0), 10, 10, true)?)
//!             .add(Linear::new(&p.sub(1), 10, 10, true)?);
//!         Ok(LinearModel { store: store.clone(), layers })
//!     }
//! }
//!
//! impl Model for LinearModel {
//!     fn name(&self) -> &str { "LinearModel" }
//!     fn store(&self) -> &ParamStore { &self.store }
//!     fn example_inputs(&self, batch: usize, seed: u64) -> Result<Vec<Tensor>> {
//!         Ok(vec![Tensor::randn(&[batch, 10], seed)?])
//!     }
//!     fn forward(&self, inputs: &[Tensor], train: bool) -> Result<Tensor> {
//!         self.layers.forward_t(&inputs[0], train)
//!     }
//! }
//! ```
//!
//! # How it runs
//!
//! The harness checks that the file exists and defines `NAME`, then writes a scratch crate
//! under `<target dir>/kiln-user-models/<hash>/` whose `main.rs` `include!`s the file (by its
//! absolute path; a relative `FILE` is resolved against the current directory) and calls
//! [`crate::cli::user_main`]. The crate depends on `kiln` and `kiln-bench` by path, in kiln's
//! workspace as found when the harness runs ([`Workspace::locate`]: `--workspace DIR`, else
//! `$KILN_BENCH_WORKSPACE`, else above the running binary or the current directory). It builds
//! that crate with cargo, sharing the workspace's target directory and lock file, and runs it
//! with the remaining flags. A compile error in the file is reported with the compiler's
//! message.
//!
//! Build cost: kiln's dependencies (libtorch bindings included) are reused as they are. kiln
//! and kiln-bench themselves are compiled once more the first time any user model is built
//! (about a minute on 2 cores): cargo keys a path dependency's build by the workspace it is
//! built from, and every scratch crate shares that second build. After that, a new or edited
//! model file costs a few seconds. cargo runs in the workspace's root, so its
//! `.cargo/config.toml` applies as it does to the workspace's own builds: a `LIBTORCH` exported
//! when the workspace was built must be exported for the harness too (another value rebuilds
//! the libtorch bindings, minutes).

use crate::error::{Error, Result};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

/// What `--only` selects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSpec {
    /// Zoo models by name: `--only resnet18,bert`.
    Zoo(Vec<String>),
    /// A model in a user's file: `--only path:FILE,class:NAME`.
    User(UserModelSpec),
}

/// A model type `class` defined in the Rust file `path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserModelSpec {
    /// The file, as given (possibly relative).
    pub path: PathBuf,
    /// The type's name.
    pub class: String,
}

fn is_ident(s: &str) -> bool {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) if c == '_' || c.is_alphabetic() => {}
        _ => return false,
    }
    s != "_" && chars.all(|c| c == '_' || c.is_alphanumeric())
}

const SYNTAX: &str = "expected --only NAME[,NAME...] or --only path:FILE,class:NAME";

impl ModelSpec {
    /// Parses the value of `--only`: `NAME[,NAME...]`, `path:FILE,class:NAME` or
    /// `class:NAME,path:FILE`.
    pub fn parse(s: &str) -> Result<ModelSpec> {
        let s = s.trim();
        let user = |path: &str, class: &str| -> Result<ModelSpec> {
            let (path, class) = (path.trim(), class.trim());
            if path.is_empty() {
                return Err(Error::Invalid(format!("{SYNTAX}: the path is empty")));
            }
            if !is_ident(class) {
                return Err(Error::Invalid(format!(
                    "{SYNTAX}: class {class:?} is not a Rust type name"
                )));
            }
            Ok(ModelSpec::User(UserModelSpec {
                path: PathBuf::from(path),
                class: class.to_string(),
            }))
        };
        if let Some(rest) = s.strip_prefix("path:") {
            // The path may contain commas: split at the last ",class:".
            return match rest.rfind(",class:") {
                Some(i) => user(&rest[..i], &rest[i + ",class:".len()..]),
                None => Err(Error::Invalid(format!(
                    "{SYNTAX}: `path:` needs `,class:NAME` after the file"
                ))),
            };
        }
        if let Some(rest) = s.strip_prefix("class:") {
            return match rest.find(",path:") {
                Some(i) => user(&rest[i + ",path:".len()..], &rest[..i]),
                None => Err(Error::Invalid(format!(
                    "{SYNTAX}: `class:` needs `,path:FILE`"
                ))),
            };
        }
        let names: Vec<String> = s
            .split(',')
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty())
            .collect();
        if names.is_empty() {
            return Err(Error::Invalid(format!("{SYNTAX}: no model named")));
        }
        if let Some(bad) = names.iter().find(|n| n.contains(':')) {
            return Err(Error::Invalid(format!(
                "{SYNTAX}: {bad:?} (a user model is `path:FILE,class:NAME`, alone)"
            )));
        }
        Ok(ModelSpec::Zoo(names))
    }
}

/// The type names a Rust file defines (`struct`, `enum`, `type`, `union`), found by a scan of
/// its text that skips comments and string literals.
pub fn defined_types(source: &str) -> Vec<String> {
    let tokens = tokens(source);
    let mut out = Vec::new();
    for w in tokens.windows(2) {
        if matches!(w[0].as_str(), "struct" | "enum" | "type" | "union") && is_ident(&w[1]) {
            out.push(w[1].clone());
        }
    }
    out
}

/// Does the file contain `impl ... Model for NAME` (possibly with a path: `zoo::Model`)?
pub fn implements_model(source: &str, class: &str) -> bool {
    let t = tokens(source);
    t.windows(3)
        .any(|w| w[0] == "Model" && w[1] == "for" && w[2] == class)
}

/// Identifier-like tokens of Rust source, outside comments, strings and char literals.
fn tokens(src: &str) -> Vec<String> {
    let b: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == '/' && b.get(i + 1) == Some(&'/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && b.get(i + 1) == Some(&'*') {
            let mut depth = 1;
            i += 2;
            while i < b.len() && depth > 0 {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                } else {
                    i += 1;
                }
            }
        } else if c == '"' {
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
        } else if c == '_' || c.is_alphabetic() {
            let start = i;
            while i < b.len() && (b[i] == '_' || b[i].is_alphanumeric()) {
                i += 1;
            }
            let word: String = b[start..i].iter().collect();
            // Raw strings r"..." / r#"..."#: skip their body.
            if (word == "r" || word == "br") && i < b.len() && (b[i] == '"' || b[i] == '#') {
                let mut hashes = 0;
                while i < b.len() && b[i] == '#' {
                    hashes += 1;
                    i += 1;
                }
                if i < b.len() && b[i] == '"' {
                    i += 1;
                    'raw: while i < b.len() {
                        if b[i] == '"' && (0..hashes).all(|k| b.get(i + 1 + k) == Some(&'#')) {
                            i += 1 + hashes;
                            break 'raw;
                        }
                        i += 1;
                    }
                }
                continue;
            }
            out.push(word);
        } else if c == '\'' {
            // A char literal ('a', '\n') or a lifetime ('a): skip a literal's body only.
            if b.get(i + 2) == Some(&'\'') {
                i += 3;
            } else if b.get(i + 1) == Some(&'\\') {
                i += 2;
                while i < b.len() && b[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    out
}

impl UserModelSpec {
    /// The file's absolute path (a relative one is resolved against the current directory).
    pub fn absolute_path(&self) -> Result<PathBuf> {
        absolute(&self.path)
    }

    /// Checks that the file exists and defines the class; returns its absolute path.
    pub fn check(&self) -> Result<PathBuf> {
        let path = self.absolute_path()?;
        if !path.exists() {
            return Err(Error::Invalid(format!(
                "--only path: {} does not exist (given as {:?}; relative paths are resolved \
                 against the current directory {})",
                path.display(),
                self.path,
                std::env::current_dir()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default()
            )));
        }
        if !path.is_file() {
            return Err(Error::Invalid(format!(
                "--only path: {} is not a file",
                path.display()
            )));
        }
        if path.to_str().is_none() {
            return Err(Error::Invalid(format!(
                "--only path: {} is not valid UTF-8, which include!() needs",
                path.display()
            )));
        }
        let source = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let types = defined_types(&source);
        if !types.iter().any(|t| t == &self.class) {
            let found = if types.is_empty() {
                "it defines no struct or enum".to_string()
            } else {
                format!("types defined there: {}", types.join(", "))
            };
            return Err(Error::Invalid(format!(
                "--only class:{}: no `struct {}` (or enum/type) in {}; {found}",
                self.class,
                self.class,
                path.display()
            )));
        }
        Ok(path)
    }
}

/// Removes `--only VALUE` / `--only=VALUE` from command-line arguments (the rest is forwarded
/// to the scratch binary).
pub fn forward_args(args: &[OsString]) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut skip = false;
    for a in args {
        if skip {
            skip = false;
            continue;
        }
        match a.to_str() {
            Some("--only") => skip = true,
            Some(s) if s.starts_with("--only=") => {}
            _ => out.push(a.clone()),
        }
    }
    out
}

/// The environment variable naming kiln's workspace, for a binary that does not sit in the
/// workspace's target directory (the `--workspace` flag takes precedence).
pub const WORKSPACE_ENV: &str = "KILN_BENCH_WORKSPACE";

/// kiln's workspace, found when the harness runs (not where it was built): scratch crates
/// depend on its `kiln` and `kiln-bench` by path and copy its lock file and profiles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workspace {
    /// The root directory: kiln's `Cargo.toml`, with `kiln-bench/` inside.
    pub root: PathBuf,
}

/// Is `manifest` (a `Cargo.toml`'s text) the manifest of the package `kiln`?
fn is_kiln_manifest(manifest: &str) -> bool {
    let mut in_package = false;
    for line in manifest.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            in_package = t == "[package]";
        } else if in_package {
            if let Some((key, value)) = t.split_once('=') {
                if key.trim() == "name" {
                    return value.trim() == "\"kiln\"";
                }
            }
        }
    }
    false
}

impl Workspace {
    /// Is `dir` the root of kiln's workspace (kiln's manifest, and `kiln-bench/Cargo.toml`)?
    pub fn is_root(dir: &Path) -> bool {
        dir.join("kiln-bench").join("Cargo.toml").is_file()
            && std::fs::read_to_string(dir.join("Cargo.toml")).is_ok_and(|m| is_kiln_manifest(&m))
    }

    /// The workspace at `dir`, or an error saying what is missing there.
    pub fn at(dir: &Path) -> Result<Workspace> {
        let abs = absolute(dir)?;
        if Self::is_root(&abs) {
            Ok(Workspace { root: abs })
        } else {
            Err(Error::Invalid(format!(
                "{} is not kiln's workspace: it needs kiln's Cargo.toml and kiln-bench/Cargo.toml",
                abs.display()
            )))
        }
    }

    /// Finds the workspace: `explicit` (the `--workspace` flag), else `$KILN_BENCH_WORKSPACE`,
    /// else the nearest ancestor of the running binary (`<workspace>/target/release/...`), else
    /// of the current directory.
    pub fn locate(explicit: Option<&Path>) -> Result<Workspace> {
        if let Some(dir) = explicit {
            return Self::at(dir)
                .map_err(|e| Error::Invalid(format!("--workspace {}: {e}", dir.display())));
        }
        if let Some(dir) = std::env::var_os(WORKSPACE_ENV) {
            let dir = PathBuf::from(dir);
            return Self::at(&dir)
                .map_err(|e| Error::Invalid(format!("{WORKSPACE_ENV}={}: {e}", dir.display())));
        }
        let exe = std::env::current_exe().ok();
        let cwd = std::env::current_dir().ok();
        for start in exe.iter().chain(cwd.iter()) {
            let start = start.canonicalize().unwrap_or_else(|_| start.clone());
            if let Some(root) = start.ancestors().find(|d| Self::is_root(d)) {
                return Ok(Workspace {
                    root: root.to_path_buf(),
                });
            }
        }
        let shown = |p: Option<PathBuf>| {
            p.map(|p| p.display().to_string())
                .unwrap_or_else(|| "?".into())
        };
        Err(Error::Invalid(format!(
            "cannot find kiln's workspace (the directory with kiln's Cargo.toml and \
             kiln-bench/), which user models are built against: it is not above the running \
             binary ({}) nor the current directory ({}); pass --workspace DIR or set \
             {WORKSPACE_ENV}=DIR",
            shown(exe),
            shown(cwd)
        )))
    }

    /// The `kiln-bench` crate's directory.
    pub fn bench_dir(&self) -> PathBuf {
        self.root.join("kiln-bench")
    }

    /// The cargo target directory to share: `CARGO_TARGET_DIR`, else the one the running
    /// binary was built in (found from its path), else the workspace's `target/`.
    pub fn target_dir(&self) -> PathBuf {
        if let Some(d) = std::env::var_os("CARGO_TARGET_DIR") {
            let d = PathBuf::from(d);
            if d.is_absolute() {
                return d;
            }
            if let Ok(cwd) = std::env::current_dir() {
                return cwd.join(d);
            }
        }
        if let Ok(exe) = std::env::current_exe() {
            for dir in exe.ancestors().skip(1) {
                if dir.join("CACHEDIR.TAG").exists() && dir.join("release").is_dir() {
                    return dir.to_path_buf();
                }
            }
        }
        self.root.join("target")
    }
}

/// `p` made absolute against the current directory (and canonical where it exists).
fn absolute(p: &Path) -> Result<PathBuf> {
    let p = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| Error::io(".", e))?
            .join(p)
    };
    Ok(p.canonicalize().unwrap_or(p))
}

/// The scratch crate for `spec` (not yet written).
#[derive(Clone, Debug)]
pub struct ScratchCrate {
    /// The crate's directory.
    pub dir: PathBuf,
    /// The shared target directory.
    pub target_dir: PathBuf,
    /// The package (and binary) name.
    pub package: String,
    /// The user's file, absolute.
    pub source: PathBuf,
    /// The type to benchmark.
    pub class: String,
    /// kiln's workspace, whose `kiln` and `kiln-bench` the crate depends on.
    pub workspace: Workspace,
}

impl ScratchCrate {
    /// Lays out the scratch crate of a checked spec (see [`UserModelSpec::check`]) in the
    /// target directory `workspace` shares.
    pub fn new(source: PathBuf, class: &str, workspace: &Workspace) -> Self {
        let target_dir = workspace.target_dir();
        let mut h = blake3::Hasher::new();
        // The crate's layout changed when the harness left kiln: new directories, so that no
        // older scratch crate's lock file is reused.
        h.update(b"kiln-bench\0");
        h.update(source.to_string_lossy().as_bytes());
        h.update(b"\0");
        h.update(class.as_bytes());
        h.update(b"\0");
        h.update(workspace.root.to_string_lossy().as_bytes());
        let hex = h.finalize().to_hex();
        let short = &hex.as_str()[..16];
        ScratchCrate {
            dir: target_dir.join("kiln-user-models").join(short),
            package: format!("kiln-user-model-{short}"),
            target_dir,
            source,
            class: class.to_string(),
            workspace: workspace.clone(),
        }
    }

    /// The binary cargo builds.
    pub fn binary(&self) -> PathBuf {
        self.target_dir.join("release").join(&self.package)
    }

    fn manifest(&self) -> String {
        let kiln_manifest =
            std::fs::read_to_string(self.workspace.root.join("Cargo.toml")).unwrap_or_default();
        format!(
            "# Generated by kiln's benchmark harness for {source}, class {class}. Do not edit.\n\
             [package]\n\
             name = \"{package}\"\n\
             version = \"0.0.0\"\n\
             edition = \"2021\"\n\
             publish = false\n\
             build = \"build.rs\"\n\n\
             [[bin]]\n\
             name = \"{package}\"\n\
             path = \"main.rs\"\n\n\
             [dependencies]\n\
             kiln = {{ path = {kiln:?} }}\n\
             kiln-bench = {{ path = {bench:?} }}\n\
             tch = \"0.26\"\n\n\
             # Its own workspace, whatever encloses the target directory.\n\
             [workspace]\n\n\
             {profiles}",
            source = self.source.display(),
            class = self.class,
            package = self.package,
            kiln = self.workspace.root.to_string_lossy(),
            bench = self.workspace.bench_dir().to_string_lossy(),
            profiles = profile_sections(&kiln_manifest),
        )
    }

    fn main_rs(&self) -> String {
        format!(
            "// Generated by kiln's benchmark harness. Do not edit.\n\
             #![allow(dead_code, unused_imports)]\n\n\
             include!({source:?});\n\n\
             fn main() -> std::process::ExitCode {{\n    \
                 kiln_bench::cli::user_main(\"{class}\", |store: &kiln::nn::ParamStore| -> kiln::Result<Box<dyn kiln::zoo::Model>> {{\n        \
                     Ok(Box::new({class}::new(store)?))\n    \
                 }})\n\
             }}\n",
            source = self.source.to_string_lossy(),
            class = self.class,
        )
    }

    fn build_rs() -> String {
        // libtorch's lib/ on the binary's rpath, as kiln's own build.rs does for its binaries.
        "fn main() {\n    \
             println!(\"cargo:rerun-if-env-changed=LIBTORCH\");\n    \
             if let Some(dir) = std::env::var_os(\"LIBTORCH\") {\n        \
                 let lib = std::path::PathBuf::from(dir).join(\"lib\");\n        \
                 let lib = lib.canonicalize().unwrap_or(lib);\n        \
                 println!(\"cargo:rustc-link-arg=-Wl,-rpath,{}\", lib.display());\n    \
             }\n\
         }\n"
        .to_string()
    }

    /// Writes the crate's files (only those that changed, so cargo's fingerprints hold).
    pub fn write(&self) -> Result<()> {
        std::fs::create_dir_all(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        let write = |name: &str, text: String| -> Result<()> {
            let p = self.dir.join(name);
            if std::fs::read_to_string(&p).ok().as_deref() != Some(text.as_str()) {
                std::fs::write(&p, text).map_err(|e| Error::io(&p, e))?;
            }
            Ok(())
        };
        write("Cargo.toml", self.manifest())?;
        write("main.rs", self.main_rs())?;
        write("build.rs", Self::build_rs())?;
        // The workspace's lock file pins the same dependency versions kiln was built with.
        let lock = self.dir.join("Cargo.lock");
        if !lock.exists() {
            let kiln_lock = self.workspace.root.join("Cargo.lock");
            if kiln_lock.exists() {
                std::fs::copy(&kiln_lock, &lock).map_err(|e| Error::io(&lock, e))?;
            }
        }
        Ok(())
    }

    /// Builds the crate with cargo (release). On failure the error holds the compiler's
    /// diagnostics.
    pub fn build(&self) -> Result<PathBuf> {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
        let mut cmd = Command::new(&cargo);
        cmd.arg("build")
            .arg("--release")
            .arg("--manifest-path")
            .arg(self.dir.join("Cargo.toml"))
            // From the workspace, so that its `.cargo/config.toml` (LIBTORCH and the PJRT
            // plugin) applies as it did to the workspace's own build, and cargo reuses the
            // compiled torch-sys instead of rebuilding it. Variables set in the environment win,
            // as they do there.
            .current_dir(&self.workspace.root)
            .env("CARGO_TARGET_DIR", &self.target_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // The diagnostics are shown as the compiler prints them: in colour on a terminal.
        if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            cmd.arg("--color").arg("always");
        }
        let out = cmd.output().map_err(|e| {
            Error::Invalid(format!(
                "could not run cargo ({}) to build the user model: {e}",
                PathBuf::from(&cargo).display()
            ))
        })?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let source = std::fs::read_to_string(&self.source).unwrap_or_default();
            let hint = if implements_model(&source, &self.class) {
                String::new()
            } else {
                format!(
                    "\nhint: {} has no `impl Model for {}`; the type must implement \
                     kiln::zoo::Model and have `fn new(store: &kiln::nn::ParamStore) -> \
                     kiln::Result<Self>`",
                    self.source.display(),
                    self.class
                )
            };
            return Err(Error::Invalid(format!(
                "compiling {} (class {}) failed; the compiler says:\n{}{hint}",
                self.source.display(),
                self.class,
                compiler_messages(&stderr)
            )));
        }
        Ok(self.binary())
    }
}

/// cargo's output without its progress lines: the compiler's diagnostics.
fn compiler_messages(stderr: &str) -> String {
    let progress = [
        "Compiling ",
        "Blocking ",
        "Building ",
        "Finished ",
        "Locking ",
        "Adding ",
        "Updating ",
        "Downloading ",
        "Downloaded ",
    ];
    stderr
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            !progress.iter().any(|p| t.starts_with(p))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The `[profile...]` sections of a manifest (copied so the scratch crate compiles kiln with
/// the same settings, which keeps the shared build).
fn profile_sections(manifest: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in manifest.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            inside = t.starts_with("[profile");
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Checks, builds (against `workspace`) and runs a user model with `args` (the harness's
/// flags without `--only`). Progress of the build goes to stderr; the benchmark's output is the
/// child's.
pub fn run_user_model(
    spec: &UserModelSpec,
    workspace: &Workspace,
    args: &[OsString],
) -> Result<ExitStatus> {
    let source = spec.check()?;
    let krate = ScratchCrate::new(source, &spec.class, workspace);
    krate.write()?;
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message(format!(
        "building {} from {} (scratch crate {})",
        spec.class,
        krate.source.display(),
        krate.dir.display()
    ));
    if spinner.is_hidden() {
        eprintln!(
            "building {} from {} (scratch crate {})",
            spec.class,
            krate.source.display(),
            krate.dir.display()
        );
    }
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    let built = krate.build();
    spinner.finish_and_clear();
    let binary = built?;
    Command::new(&binary)
        .args(args)
        .status()
        .map_err(|e| Error::Invalid(format!("could not run {}: {e}", binary.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_zoo_names() {
        assert_eq!(
            ModelSpec::parse("resnet18, bert").unwrap(),
            ModelSpec::Zoo(vec!["resnet18".into(), "bert".into()])
        );
        assert!(ModelSpec::parse(" , ").is_err());
        assert!(ModelSpec::parse("resnet18,path:x.rs").is_err());
    }

    #[test]
    fn parse_user_model() {
        let want = ModelSpec::User(UserModelSpec {
            path: "/tmp/models, v2/m.rs".into(),
            class: "LinearModel".into(),
        });
        assert_eq!(
            ModelSpec::parse("path:/tmp/models, v2/m.rs,class:LinearModel").unwrap(),
            want
        );
        assert_eq!(
            ModelSpec::parse("class:LinearModel,path:/tmp/models, v2/m.rs").unwrap(),
            want
        );
        let rel = ModelSpec::parse("path:models/m.rs,class:M").unwrap();
        assert_eq!(
            rel,
            ModelSpec::User(UserModelSpec {
                path: "models/m.rs".into(),
                class: "M".into()
            })
        );
    }

    #[test]
    fn parse_errors_say_the_syntax() {
        for bad in [
            "path:/x.rs",
            "path:,class:M",
            "path:/x.rs,class:",
            "path:/x.rs,class:Not-A-Type",
            "path:/x.rs,class:M\"); evil(\"",
            "class:M",
        ] {
            let e = ModelSpec::parse(bad).unwrap_err().to_string();
            assert!(e.contains("path:FILE,class:NAME"), "{bad}: {e}");
        }
    }

    #[test]
    fn forward_args_drops_only() {
        let a: Vec<OsString> = ["--repeat", "3", "--only", "path:x,class:Y", "--training"]
            .iter()
            .map(OsString::from)
            .collect();
        assert_eq!(forward_args(&a), vec!["--repeat", "3", "--training"]);
        let b: Vec<OsString> = ["--only=path:x,class:Y", "--csv", "o.csv"]
            .iter()
            .map(OsString::from)
            .collect();
        assert_eq!(forward_args(&b), vec!["--csv", "o.csv"]);
    }

    #[test]
    fn finds_types_outside_comments_and_strings() {
        let src = r##"
            // struct Commented;
            /* struct Blocked; /* nested struct Deeper; */ */
            const S: &str = "struct InString";
            const R: &str = r#"struct InRaw"#;
            fn f<'a>(x: &'a str) -> char { 'x' }
            pub struct LinearModel { a: u32 }
            enum Kind { A }
            impl kiln::zoo::Model for LinearModel {}
        "##;
        assert_eq!(defined_types(src), vec!["LinearModel", "Kind"]);
        assert!(implements_model(src, "LinearModel"));
        assert!(!implements_model(src, "Kind"));
    }

    #[test]
    fn check_reports_missing_file_and_class() {
        let dir = std::env::temp_dir().join(format!("kiln-user-spec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = UserModelSpec {
            path: dir.join("nope.rs"),
            class: "M".into(),
        };
        let e = missing.check().unwrap_err().to_string();
        assert!(e.contains("does not exist"), "{e}");
        let file = dir.join("m.rs");
        std::fs::write(&file, "pub struct Other;\n").unwrap();
        let wrong = UserModelSpec {
            path: file.clone(),
            class: "M".into(),
        };
        let e = wrong.check().unwrap_err().to_string();
        assert!(e.contains("no `struct M`") && e.contains("Other"), "{e}");
        let ok = UserModelSpec {
            path: file.clone(),
            class: "Other".into(),
        };
        assert_eq!(ok.check().unwrap(), file.canonicalize().unwrap());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn profiles_are_copied() {
        let m = "[package]\nname = \"x\"\n[profile.dev]\nopt-level = 1\n\n[dependencies]\na = \"1\"\n[profile.release]\nlto = true\n";
        assert_eq!(
            profile_sections(m),
            "[profile.dev]\nopt-level = 1\n\n[profile.release]\nlto = true\n"
        );
    }
}
