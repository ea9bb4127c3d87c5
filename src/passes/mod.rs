//! Graph-to-graph passes. Each does one thing and is tested alone; [`run_passes`] composes them
//! to a fixpoint (luminal's `Looped` compilers, without the tuples).

mod barrier;
mod cast;
mod cse;
mod dce;
mod dedup;
mod im2col;
mod scatter;
mod stop_gradient;
mod widen;

pub use barrier::StripBarriers;
pub use cast::{autocast_graph, cast_graph};
pub use cse::Cse;
pub use dce::Dce;
pub use dedup::{dedup_outputs, OutputSource};
pub use im2col::{im2col, im2col_graph, im2col_nodes, is_full_window, Im2col};
pub use scatter::ScaleScatterUpdates;
pub use stop_gradient::StripStopGradients;
pub use widen::WidenHalf;

use crate::error::Result;
use crate::ir::{Graph, Op};

/// A graph rewrite.
pub trait Pass {
    /// Name, for logs.
    fn name(&self) -> &'static str;
    /// Rewrites `graph` in place; returns whether anything changed.
    fn run(&self, graph: &mut Graph) -> Result<bool>;
}

/// Runs `passes` in order, repeatedly, until none changes the graph (at most `max_rounds`).
pub fn run_passes(graph: &mut Graph, passes: &[&dyn Pass], max_rounds: usize) -> Result<()> {
    for _ in 0..max_rounds {
        let mut changed = false;
        for p in passes {
            changed |= p.run(graph)?;
        }
        if !changed {
            break;
        }
    }
    Ok(())
}

/// Replaces every node whose op `is` by its first operand (for ops whose value is that
/// operand's: an ordering barrier, a stop-gradient); returns whether any was.
pub(crate) fn bypass(graph: &mut Graph, is: impl Fn(&Op) -> bool) -> Result<bool> {
    let mut changed = false;
    for id in graph.topo_order() {
        if is(&graph.node(id).op) {
            let value = graph.node(id).operands[0];
            graph.replace_uses(id, value)?;
            graph.remove_unused(id);
            changed = true;
        }
    }
    Ok(changed)
}

/// The standard clean-up: CSE then DCE, to a fixpoint.
pub fn simplify(graph: &mut Graph) -> Result<()> {
    run_passes(graph, &[&Cse, &Dce], 4)
}
