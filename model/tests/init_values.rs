//! The initial values a seed gives are part of the format: a run resumed or repeated from its
//! seed must start from the same weights whatever the build. These digests were taken from the
//! draws as they stood before the projections' scalings were folded into parallel draws
//! (session 58); any change to the order or arithmetic of a draw changes them.

use burn_ndarray::NdArray;
use nsactor_model::init::Rng;
use nsactor_model::io::param_values;
use nsactor_model::{Edge, SnnDecoderLayer};

/// FNV-1a over every parameter's name, shape and value bits, in visiting order.
fn digest(params: Vec<(String, Vec<usize>, Vec<f32>)>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= *b as u64;
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    };
    for (name, shape, values) in params {
        eat(name.as_bytes());
        for s in shape {
            eat(&(s as u64).to_le_bytes());
        }
        for v in values {
            eat(&v.to_bits().to_le_bytes());
        }
    }
    h
}

/// `configs/small.toml`'s model: its projections are large enough to be drawn on several
/// threads (D·N × D = 2²⁰ values, D × D = 2¹⁸).
fn small() -> nsactor_model::ModelConfig {
    nsactor_model_config::from_toml_str(
        "[model]\nvocab_size = 2048\nD = 512\nN = 4\nK = 8\nnum_layers = 8\nD_ff = 1536\n\
         v_th_min = 0.1\nplif_out = \"leak\"\n",
    )
    .expect("config")
}

#[test]
fn a_seed_gives_the_same_initial_values_as_before() {
    let cfg = small();
    let device = Default::default();
    let layer = SnnDecoderLayer::<NdArray>::init(&cfg, &mut Rng::new(7), &device);
    let edge = Edge::<NdArray>::init(&cfg, &mut Rng::new(8), &device);
    let (l, e) = (digest(param_values(&layer)), digest(param_values(&edge)));
    assert_eq!(l, 0xfdaf_dcaa_d04a_980b, "layer");
    assert_eq!(e, 0x1dc0_6199_95f3_6239, "edge");
}
