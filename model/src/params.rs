//! Named parameters: every module lists its tensors under the reference `state_dict` keys, so
//! import/export, optimizer state and parameter groups all work by name in one fixed order.

use burn::tensor::{Tensor, backend::Backend};
use nsactor_kernels::{GemmRows, SnnOps};

/// Reads parameters in declaration order.
pub trait ParamVisitor<B: Backend> {
    fn visit<const D: usize>(&mut self, name: &str, param: &Tensor<B, D>);
}

/// Replaces parameters in declaration order.
pub trait ParamMapper<B: Backend> {
    fn map<const D: usize>(&mut self, name: &str, param: Tensor<B, D>) -> Tensor<B, D>;
}

/// A module with named parameters.
pub trait Params<B: Backend> {
    fn visit_params<V: ParamVisitor<B>>(&self, prefix: &str, v: &mut V);
    fn map_params<M: ParamMapper<B>>(&mut self, prefix: &str, m: &mut M);
}

/// Implements [`Params`] for a struct from its tensor fields and sub-module fields; the names are
/// the field names, so fields must equal checkpoint keys.
macro_rules! impl_params {
    ($ty:ident { tensors: [$($t:ident),* $(,)?], modules: [$($m:ident),* $(,)?] }) => {
        impl_params!($ty { tensors: [$($t),*], modules: [$($m),*], derived: [] });
    };
    ($ty:ident {
        tensors: [$($t:ident),* $(,)?],
        modules: [$($m:ident),* $(,)?],
        derived: [$($d:ident),* $(,)?]
    }) => {
        impl<B: burn::tensor::backend::Backend> $crate::params::Params<B> for $ty<B> {
            fn visit_params<V: $crate::params::ParamVisitor<B>>(&self, prefix: &str, v: &mut V) {
                $( v.visit(&format!("{prefix}{}", stringify!($t)), &self.$t); )*
                $( self.$m.visit_params(&format!("{prefix}{}.", stringify!($m)), v); )*
            }
            fn map_params<M: $crate::params::ParamMapper<B>>(&mut self, prefix: &str, m: &mut M) {
                $( self.$t = m.map(&format!("{prefix}{}", stringify!($t)), self.$t.clone()); )*
                $( self.$m.map_params(&format!("{prefix}{}.", stringify!($m)), m); )*
                // Tensors derived from the old parameters are stale now.
                $( self.$d = $crate::params::Derived::default(); )*
            }
        }
    };
}
pub(crate) use impl_params;

/// Largest `TK·B` of an untracked pass outside a decoding server's that counts as a decoding
/// pass ([`decoding_pass`]): a step of up to 256 sessions at K = 16. Above it (the pipeline's
/// untracked forward in training) each projection is its own GEMM and the training forward's
/// kernels run.
pub const MERGED_GEMM_ROWS: usize = 4096;

/// Whether a pass over `rows = TK·B` rows on `device` is a decoding pass: untracked, on a
/// backend that merges small GEMMs ([`SnnOps::merges_small_gemms`]: the CUDA backend, where
/// host time per call sets a decoding step's speed), and either a decoding server's pass
/// (inside [`nsactor_kernels::decoding_gemms`]) of any length or at most [`MERGED_GEMM_ROWS`]
/// rows. Decoding passes merge the projections that share an input into one GEMM, read its
/// column slices in place and run the decoding kernels. Every pass of a session, a prompt's
/// 1,024-token prefill as much as a one-token step, so runs the same kernels, and its GEMMs the
/// same batch-invariant ones (in pieces of 4,096 rows on CUDA). Until s47 passes past 4,096
/// frame rows ran the training forward's kernels with tuned GEMMs, and a prompt's logits
/// depended on how its passes were cut (11 of 6,291,456 logits equal at 1,024 tokens, issue 60).
///
/// [`SnnOps::merges_small_gemms`]: nsactor_kernels::GemmOps::merges_small_gemms
pub fn decoding_pass<B: SnnOps>(rows: usize, device: &B::Device) -> bool {
    B::merges_small_gemms()
        && !B::ad_enabled(device)
        && (rows <= MERGED_GEMM_ROWS || nsactor_kernels::gemm_rows() != GemmRows::Other)
}

/// A tensor derived from a module's parameters (weights concatenated for one GEMM), computed on
/// first use and dropped when [`Params::map_params`] replaces the parameters; a clone starts
/// empty. Only untracked passes use it: autodiff must see the parameters themselves.
#[derive(Debug)]
pub struct Derived<B: Backend>(std::sync::OnceLock<Tensor<B, 2>>);

impl<B: Backend> Default for Derived<B> {
    fn default() -> Self {
        Derived(std::sync::OnceLock::new())
    }
}

impl<B: Backend> Clone for Derived<B> {
    fn clone(&self) -> Self {
        Derived::default()
    }
}

impl<B: Backend> Derived<B> {
    /// The derived tensor, computed by `f` the first time.
    pub fn get_or_init(&self, f: impl FnOnce() -> Tensor<B, 2>) -> Tensor<B, 2> {
        self.0.get_or_init(f).clone()
    }

    pub fn is_computed(&self) -> bool {
        self.0.get().is_some()
    }
}

/// Bias-free or biased linear map with PyTorch's `(out, in)` weight layout.
#[derive(Debug, Clone)]
pub struct Linear<B: Backend> {
    pub weight: Tensor<B, 2>,
    pub bias: Option<Tensor<B, 1>>,
    /// `Wᵀ` as the GEMM reads it ([`nsactor_kernels::gemm_operand`]: the bf16 copy on CUDA in
    /// bf16 precision), for untracked passes: decoding rounds each weight once per parameter
    /// update instead of once per token.
    pub operand: Derived<B>,
}

/// Whether untracked passes keep each weight as the GEMM reads it ([`Linear::operand`]):
/// `NSACTOR_WEIGHT_OPERANDS=per-call` makes them round it on every call instead (A/B runs).
pub fn reuse_operands() -> bool {
    static REUSE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *REUSE.get_or_init(|| std::env::var("NSACTOR_WEIGHT_OPERANDS").as_deref() != Ok("per-call"))
}

/// What untracked passes keep of a weight `w` (transposed, concatenated): `w` as the GEMM
/// reads it, or `w` itself when [`reuse_operands`] is off (then every call rounds it).
pub(crate) fn as_operand<B: SnnOps>(w: Tensor<B, 2>) -> Tensor<B, 2> {
    if reuse_operands() {
        nsactor_kernels::gemm_operand(w)
    } else {
        w
    }
}

impl<B: Backend> Linear<B> {
    pub fn new(weight: Tensor<B, 2>, bias: Option<Tensor<B, 1>>) -> Self {
        Linear {
            weight,
            bias,
            operand: Derived::default(),
        }
    }
}

impl<B: SnnOps> Linear<B> {
    /// `Wᵀ` as an untracked pass's GEMM reads it, made once per parameter update.
    fn untracked_operand(&self) -> Tensor<B, 2> {
        self.operand
            .get_or_init(|| as_operand(self.weight.clone().transpose()))
    }

    /// `w̄` `[1, in]`: for each input channel, the mean over the output channels of `Wᵀ` as an
    /// untracked pass's GEMM reads it (after its rounding), in f32. `x·w̄ᵀ` is then the mean of
    /// `x·Wᵀ` over its output channels up to f32 summation order (bias not included).
    pub fn operand_row_means(&self) -> Tensor<B, 2> {
        let w = self.untracked_operand().cast(burn::tensor::DType::F32);
        let [inputs, _] = w.dims();
        w.mean_dim(1).reshape([1, inputs])
    }

    /// `forward(x) + c` as one GEMM that adds `c` itself ([`nsactor_kernels::matmul_add`]; in
    /// an untracked pass `c` may be a column slice of a wider product; under autodiff `c` must
    /// be a GEMM's output, whose gradient comes in the GEMM's operand type).
    pub fn forward_add(&self, x: Tensor<B, 2>, c: Tensor<B, 2>) -> Tensor<B, 2> {
        let y = nsactor_kernels::matmul_add(x.clone(), self.weight_operand(&x), c);
        self.add_bias(y)
    }

    /// `x @ Wᵀ (+ b)` over the rows of `x` `[rows, in]`, in the backend's GEMM precision.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let y = nsactor_kernels::matmul(x.clone(), self.weight_operand(&x));
        self.add_bias(y)
    }

    /// [`forward`](Self::forward) with the product stored in the backend's storage type
    /// ([`nsactor_kernels::matmul_stored`]): for an output read only by a scan kernel.
    pub fn forward_stored(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        if self.bias.is_some() {
            return self.forward(x);
        }
        nsactor_kernels::matmul_stored(x.clone(), self.weight_operand(&x))
    }

    /// `Wᵀ` as the GEMM reads it: the weight's transposed view under autodiff (so gradients
    /// reach it), the cached rounded operand otherwise.
    fn weight_operand(&self, x: &Tensor<B, 2>) -> Tensor<B, 2> {
        if B::ad_enabled(&x.device()) {
            self.weight.clone().transpose()
        } else {
            self.untracked_operand()
        }
    }

    fn add_bias(&self, y: Tensor<B, 2>) -> Tensor<B, 2> {
        match &self.bias {
            Some(b) => y + b.clone().unsqueeze::<2>(),
            None => y,
        }
    }
}

impl<B: Backend> Params<B> for Linear<B> {
    fn visit_params<V: ParamVisitor<B>>(&self, prefix: &str, v: &mut V) {
        v.visit(&format!("{prefix}weight"), &self.weight);
        if let Some(b) = &self.bias {
            v.visit(&format!("{prefix}bias"), b);
        }
    }
    fn map_params<M: ParamMapper<B>>(&mut self, prefix: &str, m: &mut M) {
        self.weight = m.map(&format!("{prefix}weight"), self.weight.clone());
        if let Some(b) = self.bias.take() {
            self.bias = Some(m.map(&format!("{prefix}bias"), b));
        }
        self.operand = Derived::default();
    }
}

impl<B: Backend, T: Params<B>> Params<B> for Vec<T> {
    fn visit_params<V: ParamVisitor<B>>(&self, prefix: &str, v: &mut V) {
        for (i, item) in self.iter().enumerate() {
            item.visit_params(&format!("{prefix}{i}."), v);
        }
    }
    fn map_params<M: ParamMapper<B>>(&mut self, prefix: &str, m: &mut M) {
        for (i, item) in self.iter_mut().enumerate() {
            item.map_params(&format!("{prefix}{i}."), m);
        }
    }
}

/// Parameter names and shapes of any module, in order.
pub fn param_shapes<B: Backend, P: Params<B>>(module: &P) -> Vec<(String, Vec<usize>)> {
    struct Shapes(Vec<(String, Vec<usize>)>);
    impl<B: Backend> ParamVisitor<B> for Shapes {
        fn visit<const D: usize>(&mut self, name: &str, p: &Tensor<B, D>) {
            self.0.push((name.to_string(), p.dims().to_vec()));
        }
    }
    let mut s = Shapes(Vec::new());
    module.visit_params("", &mut s);
    s.0
}

/// Whether a parameter belongs to the neuron group trained at `neuron_lr_mult ×` the base LR
/// (SPEC §7.1): PLIF `w`/`v_th` of the input, FFN and output neurons, and the SNNBlock
/// modulation biases. Everything else — halts, norms, decode_proj bias, embedding — is base LR.
pub fn is_neuron_param(name: &str) -> bool {
    const NEURONS: [&str; 4] = [
        "input_neuron1.",
        "input_neuron2.",
        "gate_neuron.",
        "up_neuron.",
    ];
    const BIASES: [&str; 3] = ["snn_block.b_beta", "snn_block.b_alpha", "snn_block.b_th"];
    name.starts_with("output_neuron.")
        || NEURONS.iter().any(|n| name.contains(n))
        || BIASES.iter().any(|b| name.ends_with(b))
}
