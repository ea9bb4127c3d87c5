//! Every stage of compilation, as text: what kiln traced, what it handed the backend, and what
//! the backend made of it (JAX's `Traced → Lowered → Compiled`, each with `as_text()`).
//!
//! An [`Inspection`] describes one compiled program (one executable): its prepared graph
//! ([`Graph`]'s text form and Graphviz DOT) and the views only its backend has
//! ([`Backend::stages`]; on XLA the StableHLO kiln emitted and the plugin's optimized HLO).
//! [`crate::CompiledFn::inspect`] gives the one program of a function for given inputs,
//! [`crate::train::TrainStep::inspect`] the forward, backward and optimizer programs of a
//! training step (or its one fused program).
//!
//! `KILN_DUMP=DIR` writes every stage of every program a runtime compiles or loads into
//! `DIR`, once per program and process, as `DIR/<fingerprint>.graph.txt`, `.dot`,
//! `.stablehlo.mlir`, `.optimized.hlo.txt` (the fingerprint is the compile-cache key), for bug
//! reports. A directory that cannot be written is logged as a warning and never fails the
//! compile; [`dump`] is the same with an explicit directory and errors.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ir::{Fingerprint, Graph};
use parking_lot::Mutex;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// One text view of a compiled program.
#[derive(Debug)]
pub struct Stage {
    /// What it is: `graph`, `dot`, or a backend's (`stablehlo`, `optimized_hlo`).
    pub name: &'static str,
    /// The file name extension a dump gives it (`graph.txt`, `dot`, `stablehlo.mlir`,
    /// `optimized.hlo.txt`).
    pub extension: &'static str,
    /// The text, or why the backend cannot produce it (e.g. a PJRT plugin without
    /// `PJRT_Executable_OptimizedProgram`).
    pub text: Result<String>,
}

impl Stage {
    /// A stage with its text (or error).
    pub fn new(name: &'static str, extension: &'static str, text: Result<String>) -> Self {
        Stage {
            name,
            extension,
            text,
        }
    }
}

/// Every stage of one compiled program, from the traced graph to the backend's last form.
#[derive(Debug)]
pub struct Inspection {
    name: String,
    backend: String,
    fingerprint: Fingerprint,
    graph: Graph,
    stages: Vec<Stage>,
}

impl Inspection {
    /// Describes `exe`, compiled by `backend` from `graph` (whose fingerprint is `fingerprint`);
    /// `name` says which program it is (`function`, `forward`, `backward`, `optimizer`,
    /// `fused`).
    pub fn new<B: Backend>(
        backend: &B,
        name: &str,
        graph: &Graph,
        fingerprint: Fingerprint,
        exe: &B::Executable,
    ) -> Self {
        let mut stages = vec![
            Stage::new("graph", "graph.txt", Ok(graph.to_string())),
            Stage::new("dot", "dot", Ok(graph.to_dot())),
        ];
        stages.extend(backend.stages(graph, exe));
        Inspection {
            name: name.to_string(),
            backend: backend.name().to_string(),
            fingerprint,
            graph: graph.clone(),
            stages,
        }
    }

    /// Which program this is (`function`, `forward`, `backward`, `optimizer`, `fused`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The graph's fingerprint (the compile-cache key, and the dump's file name).
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// The graph that was compiled: traced, simplified and rewritten for the backend.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Every stage, in pipeline order: `graph`, `dot`, then the backend's.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// The names of the stages, in order.
    pub fn stage_names(&self) -> Vec<&'static str> {
        self.stages.iter().map(|s| s.name).collect()
    }

    /// The text of stage `name` (`graph`, `dot`, `stablehlo`, `optimized_hlo`, ...).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a stage this backend does not have (the message lists those it
    /// has); [`Error::Unsupported`] carrying the backend's reason for a stage it could not
    /// produce (the original error is in [`Stage::text`]).
    pub fn text(&self, name: &str) -> Result<&str> {
        let stage = self.stages.iter().find(|s| s.name == name).ok_or_else(|| {
            Error::Invalid(format!(
                "no stage {name:?} for a {} program; its stages are {:?}",
                self.backend,
                self.stage_names()
            ))
        })?;
        match &stage.text {
            Ok(t) => Ok(t),
            Err(e) => Err(Error::Unsupported {
                backend: self.backend.clone(),
                what: format!("stage {name}: {e}"),
            }),
        }
    }

    /// Writes each stage that has a text to `dir/<fingerprint>.<extension>` (creating `dir`);
    /// returns the files written. Stages the backend could not produce are skipped.
    ///
    /// # Errors
    /// [`Error::Io`] naming the directory or file that could not be written.
    pub fn write_to(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut written = Vec::new();
        for s in &self.stages {
            if let Ok(text) = &s.text {
                let path = dir.join(format!("{}.{}", self.fingerprint, s.extension));
                std::fs::write(&path, text).map_err(|source| Error::Io {
                    path: path.clone(),
                    source,
                })?;
                written.push(path);
            }
        }
        Ok(written)
    }
}

/// The directory `KILN_DUMP` names, if it is set (and neither empty nor `off`).
pub fn dump_dir() -> Option<PathBuf> {
    match std::env::var_os("KILN_DUMP") {
        Some(d) if !d.is_empty() && d != "off" => Some(PathBuf::from(d)),
        _ => None,
    }
}

/// Writes every stage of `exe` (compiled by `backend` from `graph`) to `dir`, as
/// [`Inspection::write_to`] does; stages the backend could not produce are logged at `info`
/// level. Returns the files written.
///
/// # Errors
/// [`Error::Io`] if `dir` or a file in it cannot be written.
pub fn dump<B: Backend>(
    backend: &B,
    dir: &Path,
    graph: &Graph,
    fingerprint: Fingerprint,
    exe: &B::Executable,
) -> Result<Vec<PathBuf>> {
    let inspection = Inspection::new(backend, "program", graph, fingerprint, exe);
    for s in inspection.stages() {
        if let Err(e) = &s.text {
            log::info!("kiln: KILN_DUMP: no {} for {fingerprint}: {e}", s.name);
        }
    }
    inspection.write_to(dir)
}

/// Programs already dumped in this process: (directory, fingerprint, backend cache key).
static DUMPED: Mutex<Option<HashSet<(PathBuf, Fingerprint, String)>>> = Mutex::new(None);

/// Dumps `exe` to `KILN_DUMP`'s directory if it is set and this program was not dumped there
/// yet. Never fails: a directory that cannot be written is a logged warning.
pub(crate) fn dump_if_enabled<B: Backend>(
    backend: &B,
    graph: &Graph,
    fingerprint: Fingerprint,
    exe: &B::Executable,
) {
    let Some(dir) = dump_dir() else {
        return;
    };
    let key = (dir.clone(), fingerprint, backend.cache_key());
    if !DUMPED.lock().get_or_insert_with(HashSet::new).insert(key) {
        return;
    }
    if let Err(e) = dump(backend, &dir, graph, fingerprint, exe) {
        log::warn!("kiln: KILN_DUMP={}: {e}", dir.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::eager::EagerBackend;
    use crate::ir::{BinaryOp, DType, InputKind, Op, TensorType};

    fn graph() -> Graph {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, [2, 3]);
        let a = g.add_input(InputKind::Data, "a", ty.clone());
        let b = g.add_input(InputKind::Data, "b", ty);
        let s = g.add(Op::Binary(BinaryOp::Add), &[a, b]).unwrap();
        g.set_outputs(vec![s]).unwrap();
        g
    }

    #[test]
    fn eager_programs_have_the_graph_stages_only() {
        let backend = EagerBackend::new();
        let g = graph();
        let exe = backend.compile(&g).unwrap();
        let i = Inspection::new(&backend, "function", &g, g.fingerprint(), &exe);
        assert_eq!(i.stage_names(), vec!["graph", "dot"]);
        assert!(i.text("graph").unwrap().contains("add(%0, %1)"));
        assert!(i.text("dot").unwrap().starts_with("digraph"));
        let err = i.text("stablehlo").unwrap_err().to_string();
        assert!(
            err.contains("\"stablehlo\"") && err.contains("[\"graph\", \"dot\"]"),
            "{err}"
        );
    }

    #[test]
    fn dump_writes_one_file_per_stage_and_reports_an_unwritable_dir() {
        let backend = EagerBackend::new();
        let g = graph();
        let exe = backend.compile(&g).unwrap();
        let dir = std::env::temp_dir().join(format!("kiln-dump-test-{}", std::process::id()));
        let files = dump(&backend, &dir, &g, g.fingerprint(), &exe).unwrap();
        let fp = g.fingerprint().to_hex();
        assert_eq!(
            files,
            vec![
                dir.join(format!("{fp}.graph.txt")),
                dir.join(format!("{fp}.dot"))
            ]
        );
        assert_eq!(std::fs::read_to_string(&files[0]).unwrap(), g.to_string());
        // A path below a regular file cannot be a directory: an Io error naming it.
        let blocked = files[0].join("sub");
        let err = dump(&backend, &blocked, &g, g.fingerprint(), &exe).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
