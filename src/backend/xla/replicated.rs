//! Data parallelism over several devices of one PJRT client: every program runs as N
//! replicas, one per device, and [`crate::ir::Op::AllReduce`] combines their values with XLA's
//! own collective (`stablehlo.all_reduce`).
//!
//! [`Replicated`] is a [`Backend`] whose buffers hold one array per replica
//! ([`ReplicatedBuffer`]). Uploads of whole values ([`Backend::to_device`]: parameters,
//! optimizer state) are copied to every device; batches are split along their first
//! dimension, one shard per device ([`Backend::to_device_shards`]). A
//! [`crate::train::TrainStep`] on a `Replicated` backend is a data-parallel step: see its docs.

use super::{lower, pjrt, XlaBackend, XlaBuffer, XlaExecutable};
use crate::backend::{Backend, HostTensor};
use crate::error::{Error, Result};
use crate::ir::{Graph, TensorType};

/// The XLA backend over the first N addressable devices of its PJRT client, running every
/// program as N data-parallel replicas (replica `r` on addressable device `r`, by an explicit
/// device assignment in the compile options).
///
/// Made by [`XlaBackend::replicated`]. Cheap to clone; shares the client (and its buffers and
/// compiled executables' cache identity) with the backend it was made from.
///
/// ```no_run
/// # use kiln::backend::xla::XlaBackend;
/// # fn main() -> kiln::Result<()> {
/// let xla = XlaBackend::new()?;
/// let two = xla.replicated(2)?; // devices 0 and 1 of the same client
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Replicated {
    base: XlaBackend,
    replicas: usize,
    /// The base's options serialized for the replicas (see [`XlaBackend::options_bytes_for`]).
    option_bytes: super::reductions::CompileOptionBytes,
}

/// A value on every replica's device: `parts()[r]` lives on replica `r`'s device. All parts
/// have the same type (the per-replica type the program sees).
pub struct ReplicatedBuffer {
    parts: Vec<XlaBuffer>,
}

impl ReplicatedBuffer {
    /// The per-replica arrays, in replica order.
    pub fn parts(&self) -> &[XlaBuffer] {
        &self.parts
    }
}

impl XlaBackend {
    /// This backend's client (same plugin, options and devices) running every program as
    /// `replicas` data-parallel replicas on its first `replicas` addressable devices.
    ///
    /// # Errors
    /// [`Error::Invalid`] if `replicas` is 0 or more than the client's addressable devices
    /// (on the CPU plugin, [`XlaBackend::new`] makes one device per CPU, at most 4).
    pub fn replicated(&self, replicas: usize) -> Result<Replicated> {
        let devices = self.client().addressable_device_count();
        if replicas == 0 || replicas > devices {
            return Err(Error::Invalid(format!(
                "{replicas} replicas asked for, the PJRT client ({} plugin {}) has {devices} \
                 addressable device(s)",
                self.platform(),
                self.plugin_path().display()
            )));
        }
        // Replica r on addressable device r, named explicitly where the plugin tells device
        // ids (the default assignment would pick the same devices on a single-process client).
        let ids = self.client().addressable_device_ids()?;
        let devices = ids.as_ref().map(|ids| &ids[..replicas]);
        Ok(Replicated {
            option_bytes: super::reductions::CompileOptionBytes::new(
                &self.options().on_platform(self.platform()),
                |o| pjrt::compile_options_bytes_for(replicas, devices, o),
            ),
            base: self.clone(),
            replicas,
        })
    }
}

impl Replicated {
    /// The single-device backend this one was made from (same client).
    pub fn base(&self) -> &XlaBackend {
        &self.base
    }

    /// Lowers `graph` to the StableHLO text [`Backend::compile`] compiles (as
    /// [`XlaBackend::lower`], for this backend's replica count).
    pub fn lower(&self, graph: &Graph) -> Result<String> {
        let ffi = self.base.effective_ffi();
        // The rewrite is idempotent: a graph the runtime rewrote comes out unchanged.
        let mut g = graph.clone();
        self.base.rewrite(&mut g)?;
        lower::lower_replicated(&g, &ffi, self.replicas)
    }
}

impl Backend for Replicated {
    type Buffer = ReplicatedBuffer;
    type Executable = XlaExecutable;

    fn name(&self) -> &str {
        "xla"
    }

    fn rewrite(&self, graph: &mut Graph) -> Result<()> {
        self.base.rewrite(graph)
    }

    fn compile(&self, graph: &Graph) -> Result<XlaExecutable> {
        graph.verify()?;
        let mlir = self.lower(graph)?;
        let bytes = self.option_bytes.for_graph(self.base.platform(), graph);
        let exe = self.base.client().compile(&mlir, bytes)?;
        Ok(XlaExecutable::new(exe, graph, mlir))
    }

    fn execute(
        &self,
        exe: &XlaExecutable,
        inputs: &[&ReplicatedBuffer],
    ) -> Result<Vec<ReplicatedBuffer>> {
        exe.check_arguments(inputs.len(), |i, name| {
            let parts = &inputs[i].parts;
            if parts.len() != self.replicas {
                return Err(Error::Invalid(format!(
                    "input {i} ({name}) holds {} replica(s), the executable runs {}",
                    parts.len(),
                    self.replicas
                )));
            }
            Ok(&parts[0].ty)
        })?;
        let lists: Vec<Vec<&pjrt::Buffer>> = (0..self.replicas)
            .map(|r| inputs.iter().map(|b| &b.parts[r].buffer).collect())
            .collect();
        let lists: Vec<&[&pjrt::Buffer]> = lists.iter().map(Vec::as_slice).collect();
        let outs = exe.exe.execute_replicated(&lists)?;
        let mut per_output: Vec<Vec<XlaBuffer>> = (0..exe.outputs.len())
            .map(|_| Vec::with_capacity(self.replicas))
            .collect();
        for (r, replica) in outs.into_iter().enumerate() {
            if replica.len() != exe.outputs.len() {
                return Err(Error::Invalid(format!(
                    "replica {r} returned {} outputs, expected {}",
                    replica.len(),
                    exe.outputs.len()
                )));
            }
            for ((buffer, ty), slot) in replica.into_iter().zip(&exe.outputs).zip(&mut per_output) {
                slot.push(XlaBuffer {
                    buffer,
                    ty: ty.clone(),
                });
            }
        }
        Ok(per_output
            .into_iter()
            .map(|parts| ReplicatedBuffer { parts })
            .collect())
    }

    /// Copies `t` to every replica's device.
    fn to_device(&self, t: &HostTensor) -> Result<ReplicatedBuffer> {
        let parts = (0..self.replicas)
            .map(|r| self.base.upload_to(t, r))
            .collect::<Result<_>>()?;
        Ok(ReplicatedBuffer { parts })
    }

    /// Replica 0's value (every replica's, for a replicated value).
    fn to_host(&self, b: &ReplicatedBuffer) -> Result<HostTensor> {
        let part = &b.parts[0];
        let mut data = vec![0u8; part.ty.size_in_bytes()];
        part.buffer.to_host(&mut data)?;
        HostTensor::from_bytes(part.ty.clone(), data)
    }

    fn buffer_type(&self, b: &ReplicatedBuffer) -> Result<TensorType> {
        Ok(b.parts[0].ty.clone())
    }

    fn sync(&self, b: &ReplicatedBuffer) -> Result<()> {
        b.parts.iter().try_for_each(|p| p.buffer.ready())
    }

    /// Whether every replica's array was donated; an error if only some were (every replica
    /// runs the same program, so donation is all or nothing).
    fn is_donated(&self, b: &ReplicatedBuffer) -> Result<bool> {
        let deleted = b
            .parts
            .iter()
            .map(|p| p.buffer.is_deleted())
            .collect::<Result<Vec<bool>>>()?;
        match (deleted.iter().all(|&d| d), deleted.iter().any(|&d| d)) {
            (true, _) => Ok(true),
            (false, false) => Ok(false),
            (false, true) => Err(Error::Internal(format!(
                "a buffer was donated on some replicas only: {deleted:?}"
            ))),
        }
    }

    fn serialize_executable(&self, exe: &XlaExecutable) -> Result<Option<Vec<u8>>> {
        Ok(Some(self.base.serialize(exe)?))
    }

    fn deserialize_executable(&self, graph: &Graph, bytes: &[u8]) -> Result<Option<XlaExecutable>> {
        Ok(Some(self.base.deserialize(graph, bytes)?))
    }

    fn cache_key(&self) -> String {
        format!("{}/replicas{}", self.base.cache_key(), self.replicas)
    }

    fn instance_id(&self) -> u64 {
        self.base.instance_id()
    }

    fn replicas(&self) -> usize {
        self.replicas
    }

    fn to_device_shards(&self, shards: &[HostTensor]) -> Result<ReplicatedBuffer> {
        if shards.len() != self.replicas {
            return Err(Error::Invalid(format!(
                "{} shards for {} replicas",
                shards.len(),
                self.replicas
            )));
        }
        if let Some((r, s)) = shards
            .iter()
            .enumerate()
            .find(|(_, s)| s.ty() != shards[0].ty())
        {
            return Err(Error::Invalid(format!(
                "shard {r} is {}, shard 0 is {}",
                s.ty(),
                shards[0].ty()
            )));
        }
        let parts = shards
            .iter()
            .enumerate()
            .map(|(r, s)| self.base.upload_to(s, r))
            .collect::<Result<_>>()?;
        Ok(ReplicatedBuffer { parts })
    }

    fn to_host_shards(&self, b: &ReplicatedBuffer) -> Result<Vec<HostTensor>> {
        b.parts
            .iter()
            .map(|part| {
                let mut data = vec![0u8; part.ty.size_in_bytes()];
                part.buffer.to_host(&mut data)?;
                HostTensor::from_bytes(part.ty.clone(), data)
            })
            .collect()
    }
}
