//! The executable cache: in memory by graph fingerprint and backend, optionally persisted on
//! disk.

use super::Metrics;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ir::{Fingerprint, Graph};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

const MAGIC: &[u8; 8] = b"KILNEXE1";

/// Compiled executables keyed by graph fingerprint and backend, shareable between compiled
/// functions, train steps and threads (clones share the same entries).
///
/// An entry belongs to the backend that compiled it: its key is the graph fingerprint, the
/// backend's [`Backend::cache_key`] (platform, plugin version, compile options) and its
/// [`Backend::instance_id`] (the PJRT client), so backends with other options, or on another
/// client, sharing one cache compile their own executables.
///
/// With a directory ([`ExecutableCache::with_dir`]) executables are also written to disk
/// (where the backend can serialize them: XLA via `PJRT_Executable_Serialize`) and loaded by
/// later processes instead of compiling. An entry's file name is a hash of the graph
/// fingerprint and [`Backend::cache_key`] (platform, plugin version, compile options); its
/// content carries a checksum, so a truncated or corrupt file is detected, recompiled and
/// rewritten, never trusted. A directory that cannot be written (read-only, full) only costs
/// the cache: the executable is used, and a warning is logged through the `log` crate.
pub struct ExecutableCache<B: Backend> {
    entries: Arc<Mutex<HashMap<EntryKey, Arc<B::Executable>>>>,
    dir: Option<PathBuf>,
}

impl<B: Backend> Clone for ExecutableCache<B> {
    fn clone(&self) -> Self {
        ExecutableCache {
            entries: self.entries.clone(),
            dir: self.dir.clone(),
        }
    }
}

impl<B: Backend> Default for ExecutableCache<B> {
    fn default() -> Self {
        Self::in_memory()
    }
}

impl<B: Backend> ExecutableCache<B> {
    /// A cache that lives only in memory.
    pub fn in_memory() -> Self {
        ExecutableCache {
            entries: Arc::new(Mutex::new(HashMap::new())),
            dir: None,
        }
    }

    /// A cache persisted under `dir` (created if missing).
    pub fn with_dir(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        Ok(ExecutableCache {
            entries: Arc::new(Mutex::new(HashMap::new())),
            dir: Some(dir),
        })
    }

    /// The cache configured by the environment: on disk under `KILN_CACHE_DIR` when it is set
    /// (and not `off`), otherwise in memory. The directory is created on first write; an
    /// unusable directory is reported then, as an [`Error::Io`] naming it.
    pub fn from_env() -> Self {
        match std::env::var_os("KILN_CACHE_DIR") {
            Some(d) if d != "off" && !d.is_empty() => ExecutableCache {
                entries: Arc::new(Mutex::new(HashMap::new())),
                dir: Some(PathBuf::from(d)),
            },
            _ => Self::in_memory(),
        }
    }

    /// The disk directory, if any.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// Number of executables in memory.
    pub fn len(&self) -> usize {
        self.entries.lock().len()
    }

    /// No executables in memory?
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The file an executable for `fp` on `backend` is stored in.
    ///
    /// `graph` is the graph whose fingerprint is `fp`; its [`Backend::graph_cache_key`] is part
    /// of the key.
    pub fn entry_path(
        &self,
        backend: &B,
        graph: &Graph,
        fp: &Fingerprint,
    ) -> Result<Option<PathBuf>> {
        Ok(self.path_of(&EntryKey::new(backend, graph, fp)?))
    }

    fn path_of(&self, key: &EntryKey) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        let name = blake3::Hash::from(key.code).to_hex();
        Some(dir.join(format!("{}.kxe", &name[..32])))
    }

    /// The executable for `graph` (whose fingerprint is `fp`): from memory, else from disk, else
    /// compiled (and then stored).
    pub fn get_or_compile(
        &self,
        backend: &B,
        graph: &Graph,
        fp: Fingerprint,
        metrics: &Metrics,
    ) -> Result<Arc<B::Executable>> {
        let key = EntryKey::new(backend, graph, &fp)?;
        if let Some(e) = self.entries.lock().get(&key) {
            metrics.cache_hit();
            return Ok(e.clone());
        }
        metrics.cache_miss();
        let path = self.path_of(&key);
        if let Some(p) = &path {
            match read_entry(p) {
                Ok(Some(bytes)) => match backend.deserialize_executable(graph, &bytes) {
                    Ok(Some(exe)) => {
                        metrics.disk_hit();
                        let exe = Arc::new(exe);
                        self.entries.lock().insert(key, exe.clone());
                        return Ok(exe);
                    }
                    Ok(None) => {}
                    Err(_) => metrics.disk_reject(),
                },
                Ok(None) => {}
                Err(_) => metrics.disk_reject(),
            }
        }
        let t0 = Instant::now();
        let exe = Arc::new(backend.compile(graph)?);
        metrics.compiled(t0.elapsed());
        if let Some(p) = &path {
            // The executable is good whatever happens to its copy on disk.
            match backend
                .serialize_executable(&exe)
                .and_then(|b| b.map(|b| write_entry(p, &b)).transpose())
            {
                Ok(Some(())) => metrics.disk_write(),
                Ok(None) => {}
                Err(e) => log::warn!("kiln: executable not cached on disk: {e}"),
            }
        }
        // Another thread may have compiled the same graph meanwhile: keep the first.
        let mut entries = self.entries.lock();
        Ok(entries.entry(key).or_insert(exe).clone())
    }
}

/// What an executable is cached under.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct EntryKey {
    /// Hash of the graph fingerprint, [`Backend::cache_key`] and [`Backend::graph_cache_key`]:
    /// what the compiled code depends on (and the on-disk file name).
    code: [u8; 32],
    /// [`Backend::instance_id`]: which device context the loaded executable belongs to.
    instance: u64,
}

impl EntryKey {
    fn new<B: Backend>(backend: &B, graph: &Graph, fp: &Fingerprint) -> Result<Self> {
        let mut h = blake3::Hasher::new();
        h.update(&fp.0);
        h.update(backend.cache_key().as_bytes());
        let per_graph = backend.graph_cache_key(graph, fp)?;
        if !per_graph.is_empty() {
            // Keys of backends without per-graph parts stay what they were.
            h.update(b"\0");
            h.update(per_graph.as_bytes());
        }
        Ok(EntryKey {
            code: *h.finalize().as_bytes(),
            instance: backend.instance_id(),
        })
    }
}

/// `Ok(None)`: no entry. `Err`: an entry that is not valid (truncated, corrupt).
fn read_entry(path: &Path) -> Result<Option<Vec<u8>>> {
    let data = match std::fs::read(path) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(path, e)),
    };
    let bad = |m: &str| Error::Format {
        path: path.to_path_buf(),
        message: m.to_string(),
    };
    if data.len() < 48 || &data[..8] != MAGIC {
        return Err(bad("not a kiln executable cache entry"));
    }
    let len = u64::from_le_bytes(data[8..16].try_into().map_err(|_| bad("header"))?) as usize;
    let payload = &data[48..];
    if payload.len() != len {
        return Err(bad("truncated"));
    }
    if blake3::hash(payload).as_bytes() != &data[16..48] {
        return Err(bad("checksum mismatch"));
    }
    Ok(Some(payload.to_vec()))
}

/// Writes atomically (temp file + rename) so a crash never leaves a half-written entry under
/// the final name.
fn write_entry(path: &Path, payload: &[u8]) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    let mut data = Vec::with_capacity(48 + payload.len());
    data.extend_from_slice(MAGIC);
    data.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    data.extend_from_slice(blake3::hash(payload).as_bytes());
    data.extend_from_slice(payload);
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    // A failed write (e.g. a full disk) must not leave its partial file behind.
    let written = std::fs::write(&tmp, &data)
        .map_err(|e| Error::io(&tmp, e))
        .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e)));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}
