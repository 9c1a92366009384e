//! Where a model's stages live: the device of the edge stage and of each layer.

/// Where each stage lives.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// Device of the edge stage.
    pub edge: usize,
    /// Device of each layer.
    pub layers: Vec<usize>,
}

impl Placement {
    /// Every stage on device 0.
    pub fn single(num_layers: usize) -> Self {
        Placement {
            edge: 0,
            layers: vec![0; num_layers],
        }
    }
}
