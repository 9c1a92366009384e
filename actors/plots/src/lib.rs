//! The pictures nsactor draws, with [plotters]: a run's training curves (`loss.png`, see
//! [`training`]) and the charts of `nsactor analyze`. Text is set in DejaVu Sans, embedded in
//! the binary (its licence is `fonts/DejaVuSans.LICENSE`), so a picture reads the same on a
//! machine without fonts; pictures come back as PNG bytes for the caller to write atomically.

pub mod analysis;
pub mod canvas;
pub mod training;

pub use canvas::{Area, FONT, PlotError, decode_png, render_png};
pub use training::{KStats, TrainingCurves};
