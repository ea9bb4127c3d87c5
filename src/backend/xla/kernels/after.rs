//! The ordering call: [`Op::Barrier`](crate::ir::Op::Barrier) under the kernels.
//!
//! XLA's CPU compiler drops `stablehlo.optimization_barrier` early (its expander replaces the
//! barrier by its operands), so the order it states is lost before copy insertion. A custom
//! call is opaque to XLA: `kiln_after_v1(x, deps...)` yields `x`, in `x`'s own buffer
//! (`output_operand_aliases`), and runs after every operand is computed. Its handler does
//! nothing (or copies, if XLA ever gives the result its own buffer).

use crate::backend::xla::pjrt::ffi::{Call, FfiKernel};
use crate::error::Result;

/// The custom call target of the ordering call.
pub const AFTER_TARGET: &str = "kiln_after_v1";

/// The handler of [`AFTER_TARGET`].
pub(crate) struct AfterKernel;

impl FfiKernel for AfterKernel {
    const TARGET: &'static str = AFTER_TARGET;

    fn run(call: &Call<'_>) -> Result<()> {
        if call.num_rets() != 1 || call.num_args() == 0 {
            return Err(crate::error::Error::Invalid(format!(
                "expects 1 result and at least 1 operand, got {} and {}",
                call.num_rets(),
                call.num_args()
            )));
        }
        call.forward_operand(0, 0)
    }
}
