/// Types representing the quantization scheme
pub mod scheme;
