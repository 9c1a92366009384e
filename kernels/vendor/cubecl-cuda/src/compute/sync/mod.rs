mod fence;
// nsactor patch: fences on a captured stream.
pub mod capture;

pub use fence::*;
