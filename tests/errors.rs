//! Errors are `Err` values with useful messages, never panics.

use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::XlaBackend;
use kiln::backend::{Backend, HostTensor};
use kiln::ir::{BinaryOp, Graph, InputKind, Op, UnaryOp};
use kiln::{compile, trace, DType, Error, Tensor, TensorType};
use std::cell::RefCell;

fn f32t(shape: &[usize]) -> TensorType {
    TensorType::new(DType::F32, shape)
}

fn type_error(e: &Error) -> (&str, &str, &str) {
    match e {
        Error::Type {
            op,
            message,
            operands,
        } => (op.as_str(), message.as_str(), operands.as_str()),
        other => panic!("expected Error::Type, got {other:?}"),
    }
}

#[test]
fn matmul_shape_mismatch_at_trace_time_names_op_and_shapes() {
    let e = trace(&[f32t(&[2, 3]), f32t(&[4, 5])], |xs| {
        Ok(vec![xs[0].matmul(&xs[1])?])
    })
    .unwrap_err();
    let (op, _, operands) = type_error(&e);
    assert_eq!(op, "matmul");
    assert!(
        operands.contains("f32[2,3]") && operands.contains("f32[4,5]"),
        "{e}"
    );
    let msg = e.to_string();
    assert!(msg.contains("matmul") && msg.contains("f32[2,3]") && msg.contains("f32[4,5]"));
    // Eagerly: the same error.
    let a = Tensor::randn(&[2, 3], 0).unwrap();
    let b = Tensor::randn(&[4, 5], 1).unwrap();
    let e2 = a.matmul(&b).unwrap_err();
    assert_eq!(e2.to_string(), msg);
}

#[test]
fn incompatible_broadcast_names_op_and_shapes() {
    let e = trace(&[f32t(&[2, 3]), f32t(&[4])], |xs| {
        Ok(vec![xs[0].add(&xs[1])?])
    })
    .unwrap_err();
    let (op, message, operands) = type_error(&e);
    assert_eq!(op, "add");
    assert!(message.contains("broadcast"), "{e}");
    assert!(
        operands.contains("f32[2,3]") && operands.contains("f32[4]"),
        "{e}"
    );
    // Eagerly, and for comparisons and select too.
    let a = Tensor::randn(&[2, 3], 0).unwrap();
    let b = Tensor::randn(&[4], 1).unwrap();
    assert_eq!(a.add(&b).unwrap_err().to_string(), e.to_string());
    let e = a.lt(&b).unwrap_err().to_string();
    assert!(e.contains("lt") && e.contains("f32[2,3]"), "{e}");
    let c = a.gt(&a).unwrap();
    let e = c.select(&a, &b).unwrap_err().to_string();
    assert!(e.contains("select") && e.contains("f32[4]"), "{e}");
}

#[test]
fn dtype_mismatch_is_a_type_error() {
    let e = trace(&[f32t(&[3]), TensorType::new(DType::I32, [3])], |xs| {
        Ok(vec![xs[0].mul(&xs[1])?])
    })
    .unwrap_err();
    let (op, message, operands) = type_error(&e);
    assert_eq!(op, "mul");
    assert!(message.contains("dtype"), "{e}");
    assert!(
        operands.contains("f32[3]") && operands.contains("i32[3]"),
        "{e}"
    );
    // Ops that do not accept a dtype say so.
    let e = trace(&[TensorType::new(DType::I32, [3])], |xs| {
        Ok(vec![xs[0].exp()?])
    })
    .unwrap_err();
    let (op, message, _) = type_error(&e);
    assert_eq!(op, "exp");
    assert!(message.contains("i32"), "{e}");
}

#[test]
fn graph_add_rejects_bad_operands() {
    let mut g = Graph::new();
    let a = g.add_input(InputKind::Data, "a", f32t(&[2, 3]));
    let b = g.add_input(InputKind::Data, "b", f32t(&[3, 2]));
    let e = g.add(Op::Binary(BinaryOp::Add), &[a, b]).unwrap_err();
    assert!(matches!(e, Error::Type { .. }), "{e:?}");
    let e = g.add(Op::Unary(UnaryOp::Exp), &[a, b]).unwrap_err();
    assert!(e.to_string().contains("expects 1 operand"), "{e}");
    let idx = g.add_input(InputKind::Data, "i", f32t(&[2]));
    let e = g.add(Op::Take { axis: 0 }, &[a, idx]).unwrap_err();
    assert!(e.to_string().contains("indices"), "{e}");
}

#[test]
fn missing_plugin_is_a_plugin_error() {
    let e = XlaBackend::from_plugin("/nonexistent.so").err().unwrap();
    match &e {
        Error::Plugin { path, message } => {
            assert_eq!(path.to_str(), Some("/nonexistent.so"));
            assert!(!message.is_empty());
        }
        other => panic!("expected Error::Plugin, got {other:?}"),
    }
    assert!(e.to_string().contains("/nonexistent.so"), "{e}");
}

#[test]
fn a_file_that_is_not_a_shared_library_is_a_plugin_error() {
    let dir = std::env::temp_dir().join(format!("kiln-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("not_a_plugin.so");
    std::fs::write(&path, b"this is not an ELF file\n").unwrap();
    let e = XlaBackend::from_plugin(&path).err().unwrap();
    assert!(matches!(e, Error::Plugin { .. }), "{e:?}");
    assert!(e.to_string().contains("not_a_plugin.so"), "{e}");
    // A directory is not a plugin either.
    let e = XlaBackend::from_plugin(&dir).err().unwrap();
    assert!(matches!(e, Error::Plugin { .. }), "{e:?}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_shared_library_without_get_pjrt_api_is_a_plugin_error() {
    // Any loadable library that is not a PJRT plugin: libm from the C runtime.
    let candidates = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "/lib64/libm.so.6",
        "/lib/aarch64-linux-gnu/libm.so.6",
    ];
    let Some(lib) = candidates.iter().find(|p| std::path::Path::new(p).exists()) else {
        eprintln!("no libm found; skipped");
        return;
    };
    let e = XlaBackend::from_plugin(lib).err().unwrap();
    match &e {
        Error::Plugin { message, .. } => assert!(message.contains("GetPjrtApi"), "{message}"),
        other => panic!("expected Error::Plugin, got {other:?}"),
    }
}

#[test]
fn stablehlo_the_plugin_rejects_is_a_pjrt_error_with_its_message() {
    let xla = XlaBackend::new().unwrap();
    let e = xla.compile_mlir("module { garbage").err().unwrap();
    // Only the given text is parsed (it once read past the end: "garbagestablehlo.maximum").
    assert!(
        e.to_string().contains("garbage") && !e.to_string().contains("garbagestablehlo"),
        "{e}"
    );
    match &e {
        Error::Pjrt { call, message, .. } => {
            assert!(call.contains("Compile"), "{call}");
            // The plugin's parser diagnostic, with its position.
            assert!(message.contains("error"), "{message}");
            assert!(message.contains("-:1:"), "{message}");
        }
        other => panic!("expected Error::Pjrt, got {other:?}"),
    }
    // A well-formed module with a type error is rejected by the verifier, also with its text.
    let bad = r#"module {
  func.func public @main(%a: tensor<2xf32>, %b: tensor<3xf32>) -> tensor<2xf32> {
    %0 = "stablehlo.add"(%a, %b) : (tensor<2xf32>, tensor<3xf32>) -> tensor<2xf32>
    "func.return"(%0) : (tensor<2xf32>) -> ()
  }
}"#;
    let e = xla.compile_mlir(bad).err().unwrap();
    assert!(matches!(e, Error::Pjrt { .. }), "{e:?}");
    assert!(e.to_string().contains("stablehlo.add"), "{e}");
}

/// The plugin's MLIR lexer wants a NUL after the text: `compile_mlir` must not let it read the
/// bytes that follow a `&str` in memory.
#[test]
fn compile_mlir_parses_exactly_the_given_text() {
    let xla = XlaBackend::new().unwrap();
    let good = r#"module {
  func.func public @main(%a: tensor<2xf32>) -> tensor<2xf32> {
    %0 = "stablehlo.negate"(%a) : (tensor<2xf32>) -> tensor<2xf32>
    "func.return"(%0) : (tensor<2xf32>) -> ()
  }
}"#;
    let buf = format!("{good} trailing garbage that is not MLIR {{ (");
    xla.compile_mlir(&buf[..good.len()]).unwrap();
    // An identifier at the end of the text must end there: before the fix the lexer went on
    // into the following bytes and reported `garbageXYZ`.
    let buf = String::from("module { garbageXYZ");
    let e = xla
        .compile_mlir(&buf[.."module { garbage".len()])
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("garbage") && !e.to_string().contains("XYZ"),
        "{e}"
    );
}

#[test]
fn a_new_signature_recompiles_instead_of_failing() {
    for xla in [true, false] {
        let f = |xs: &[Tensor]| Ok(vec![xs[0].mul_scalar(2.0)?]);
        let a = Tensor::from_slice(&[3], &[1.0f32, 2.0, 3.0]).unwrap();
        let b = Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
        let c = Tensor::from_slice(&[3], &[1.0f64, 2.0, 3.0]).unwrap();
        let (ra, rb, rc, stats) = if xla {
            let mut cf = compile(XlaBackend::new().unwrap(), f);
            (
                cf.run(std::slice::from_ref(&a)).unwrap(),
                cf.run(std::slice::from_ref(&b)).unwrap(),
                cf.run(std::slice::from_ref(&c)).unwrap(),
                cf.stats(),
            )
        } else {
            let mut cf = compile(EagerBackend::new(), f);
            (
                cf.run(std::slice::from_ref(&a)).unwrap(),
                cf.run(std::slice::from_ref(&b)).unwrap(),
                cf.run(std::slice::from_ref(&c)).unwrap(),
                cf.stats(),
            )
        };
        assert_eq!(ra[0].to_f64_vec().unwrap(), vec![2.0, 4.0, 6.0]);
        assert_eq!(rb[0].to_f64_vec().unwrap(), vec![2.0, 4.0, 6.0, 8.0]);
        assert_eq!(rc[0].dtype(), DType::F64);
        assert_eq!(rc[0].to_f64_vec().unwrap(), vec![2.0, 4.0, 6.0]);
        assert_eq!((stats.traces, stats.compiles), (3, 3));
    }
}

fn exp_graph() -> Graph {
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", f32t(&[2, 3]));
    let y = g.add(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
    g.set_outputs(vec![y]).unwrap();
    g
}

fn execute_with<B: Backend>(b: &B) {
    let exe = b.compile(&exp_graph()).unwrap();
    let good = b
        .to_device(&HostTensor::from_slice(&[2, 3], &[0.0f32; 6]).unwrap())
        .unwrap();
    assert!(b.execute(&exe, &[&good]).is_ok());
    // Wrong shape, wrong dtype: InputMismatch naming the input and both types.
    let shape = b
        .to_device(&HostTensor::from_slice(&[3, 2], &[0.0f32; 6]).unwrap())
        .unwrap();
    let dtype = b
        .to_device(&HostTensor::from_slice(&[2, 3], &[0.0f64; 6]).unwrap())
        .unwrap();
    for (buf, got) in [(&shape, "f32[3,2]"), (&dtype, "f64[2,3]")] {
        match b.execute(&exe, &[buf]).err().unwrap() {
            Error::InputMismatch {
                index,
                name,
                expected,
                got: g,
            } => {
                assert_eq!((index, name.as_str()), (0, "x"));
                assert_eq!((expected.as_str(), g.as_str()), ("f32[2,3]", got));
            }
            other => panic!("{}: expected InputMismatch, got {other:?}", b.name()),
        }
    }
    // Wrong number of inputs.
    assert!(b.execute(&exe, &[]).is_err());
    assert!(b.execute(&exe, &[&good, &good]).is_err());
}

#[test]
fn executing_with_a_wrong_buffer_type_is_an_input_mismatch() {
    execute_with(&XlaBackend::new().unwrap());
    execute_with(&EagerBackend::new());
}

#[test]
fn a_traced_tensor_used_after_its_trace_is_a_trace_error() {
    let escaped: RefCell<Option<Tensor>> = RefCell::new(None);
    trace(&[f32t(&[3])], |xs| {
        let y = xs[0].exp()?;
        *escaped.borrow_mut() = Some(y.clone());
        Ok(vec![y])
    })
    .unwrap();
    let t = escaped.into_inner().unwrap();
    assert!(t.is_traced());
    // Eagerly: it has no value.
    for e in [
        t.exp().unwrap_err(),
        t.to_host().unwrap_err(),
        t.add(&Tensor::randn(&[3], 0).unwrap()).unwrap_err(),
    ] {
        assert!(matches!(e, Error::Trace(_)), "{e:?}");
    }
    // In another trace: it belongs to a finished one.
    let e = trace(&[f32t(&[3])], |xs| Ok(vec![xs[0].add(&t)?])).unwrap_err();
    match &e {
        Error::Trace(m) => assert!(m.contains("another trace") || m.contains("finished"), "{m}"),
        other => panic!("expected Error::Trace, got {other:?}"),
    }
}

#[test]
fn impossible_reshapes_and_bad_dims_are_errors() {
    let x = Tensor::randn(&[2, 3], 0).unwrap();
    for shape in [&[4, -1][..], &[7], &[-1, -1], &[0, -1], &[2, 2]] {
        let e = x.reshape(shape).unwrap_err();
        assert!(e.to_string().contains("reshape"), "{e}");
        let e = trace(&[f32t(&[2, 3])], |xs| Ok(vec![xs[0].reshape(shape)?])).unwrap_err();
        assert!(e.to_string().contains("reshape"), "{e}");
    }
    assert!(x.squeeze(0).is_err());
    assert!(x.unsqueeze(5).is_err());
    assert!(x.transpose(0, 2).is_err());
    assert!(x.sum(&[2], false).is_err());
    assert!(x.softmax(-3).is_err());
    assert!(x.slice(2, 0, 1, 1).is_err());
    assert!(Tensor::cat(&[x.clone(), Tensor::randn(&[3, 3], 1).unwrap()], 1).is_err());
    assert!(Tensor::cat(&[], 0).is_err());
    assert!(x.linear(&Tensor::randn(&[4, 5], 1).unwrap(), None).is_err());
    assert!(x.dropout(1.5, true).is_err());
    assert!(Tensor::scalar(1.0, DType::F32).unwrap().matmul(&x).is_err());
}

/// A libtorch failure inside the eager interpreter keeps its variant (`Torch`) under a layer
/// that names the op, and `root` reaches it.
#[test]
fn an_eager_op_failure_names_the_op_and_keeps_the_torch_error() {
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", f32t(&[2, 3]));
    let y = g
        .add(Op::Reshape(kiln::ir::Shape::from(vec![6])), &[x])
        .unwrap();
    g.set_outputs(vec![y]).unwrap();
    let be = EagerBackend::new();
    let exe = be.compile(&g).unwrap();
    // `run_tch` takes raw tch tensors (no buffer type check): a wrong size fails in libtorch.
    let bad = tch::Tensor::zeros([5], (tch::Kind::Float, tch::Device::Cpu));
    let err = be.run_tch(&exe, &[&bad]).unwrap_err();
    match &err {
        Error::AtOp { op, source, .. } => {
            assert_eq!(op, "reshape");
            assert!(matches!(**source, Error::Torch(_)), "{source:?}");
        }
        other => panic!("expected AtOp, got {other:?}"),
    }
    assert!(matches!(err.root(), Error::Torch(_)));
    assert!(err.to_string().contains("reshape"), "{err}");
}

/// A broken invariant is reported as such, never as a caller error.
#[test]
fn internal_errors_say_they_are_bugs() {
    let e = Error::Internal("an output was routed twice".into());
    assert!(e.to_string().contains("kiln bug"), "{e}");
}
