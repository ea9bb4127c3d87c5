//! Training: one step = forward (train mode), the model's loss, backward, SGD update.
//! Eager steps use libtorch autograd; compiled steps are kiln training steps, split or fused.

use super::registry::BackendEntry;
use super::runner::{Contender, Workload};
use super::{BenchOptions, TrainGraphs, Variant};
use crate::backend::{Backend, HostTensor};
use crate::compile::TraceMode;
use crate::error::{Error, Result};
use crate::zoo::Model;
use std::rc::Rc;

pub(crate) struct TrainWorkload {
    model: Rc<dyn Model>,
    lr: f64,
    /// The initial value of every variable, restored before each contender's warm-up.
    snapshot: Vec<(String, HostTensor)>,
}

impl TrainWorkload {
    pub(crate) fn new(model: Rc<dyn Model>, opts: &BenchOptions) -> Result<Self> {
        let snapshot = model
            .store()
            .vars()
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_host()?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(TrainWorkload {
            model,
            lr: opts.lr,
            snapshot,
        })
    }
}

impl Workload for TrainWorkload {
    fn eager(&self) -> Result<Box<dyn Contender>> {
        TrainFactory::eager(self.model.clone(), self.lr)
    }

    fn compiled(&self, backend: &BackendEntry, variant: &Variant) -> Result<Box<dyn Contender>> {
        let graphs = variant.graphs.unwrap_or(TrainGraphs::Split);
        backend
            .imp()
            .training(self.model.clone(), graphs, variant.mode, self.lr)
    }

    fn reset(&self) -> Result<()> {
        let store = self.model.store();
        for (name, value) in &self.snapshot {
            store.set(name, value)?;
        }
        Ok(())
    }

    fn compare_each_call(&self) -> bool {
        false
    }
}

/// Builds training contenders.
pub(crate) struct TrainFactory;

impl TrainFactory {
    pub(crate) fn eager(model: Rc<dyn Model>, lr: f64) -> Result<Box<dyn Contender>> {
        let _ = (model, lr);
        Err(not_yet())
    }

    pub(crate) fn compiled<B: Backend>(
        backend: B,
        model: Rc<dyn Model>,
        graphs: TrainGraphs,
        mode: TraceMode,
        lr: f64,
    ) -> Result<Box<dyn Contender>> {
        let _ = (backend, model, graphs, mode, lr);
        Err(not_yet())
    }
}

fn not_yet() -> Error {
    Error::Invalid("training benchmarks need kiln::train, which this build does not have".into())
}
