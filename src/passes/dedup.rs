//! Output dedup: an executable never returns the same value twice, nor an input unchanged
//! (the `Deduper` and `DumbReturnHandler` of torch_xla's dynamo bridge). The caller restores
//! the original outputs from the returned [`OutputSource`] map.

use crate::error::Result;
use crate::ir::{Graph, Op};

/// Where an original output of a graph comes from after [`dedup_outputs`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputSource {
    /// The executable's `j`-th output.
    Output(usize),
    /// The graph's `i`-th input, returned unchanged (never sent through the executable).
    Input(usize),
}

/// Rewrites `graph`'s outputs so each value is returned once and no input is returned; returns,
/// for each original output, where to find it. Donation aliases follow their outputs; an alias
/// whose output disappears is dropped.
pub fn dedup_outputs(graph: &mut Graph) -> Result<Vec<OutputSource>> {
    let old = graph.outputs().to_vec();
    let mut new_outputs = Vec::new();
    let mut map = Vec::with_capacity(old.len());
    let mut new_pos_of_old = vec![None; old.len()];
    for (k, &o) in old.iter().enumerate() {
        if let Op::Input(i) = graph.node(o).op {
            map.push(OutputSource::Input(i));
            continue;
        }
        match new_outputs.iter().position(|&n| n == o) {
            Some(j) => map.push(OutputSource::Output(j)),
            None => {
                new_pos_of_old[k] = Some(new_outputs.len());
                map.push(OutputSource::Output(new_outputs.len()));
                new_outputs.push(o);
            }
        }
    }
    let aliases: Vec<(usize, usize)> = graph
        .aliases()
        .iter()
        .filter_map(|&(i, o)| new_pos_of_old[o].map(|n| (i, n)))
        .collect();
    graph.set_outputs(new_outputs)?;
    graph.set_aliases(aliases);
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, InputKind, TensorType, UnaryOp};

    #[test]
    fn removes_duplicates_and_forwarded_inputs() {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [3]));
        let y = g.add_input(InputKind::Data, "y", TensorType::new(DType::F32, [3]));
        let e = g.add(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
        let l = g.add(Op::Unary(UnaryOp::Log), &[y]).unwrap();
        g.set_outputs(vec![e, y, e, l, x]).unwrap();
        g.add_alias(1, 3).unwrap();
        let map = dedup_outputs(&mut g).unwrap();
        assert_eq!(
            map,
            vec![
                OutputSource::Output(0),
                OutputSource::Input(1),
                OutputSource::Output(0),
                OutputSource::Output(1),
                OutputSource::Input(0)
            ]
        );
        assert_eq!(g.outputs(), &[e, l]);
        assert_eq!(g.aliases(), &[(1, 1)]);
        g.verify().unwrap();
    }
}
