//! What every chart shares: the font (checked once), the drawing area, the crate's error, and
//! rendering a chart into PNG bytes (and reading one back, for the tests).

use plotters::coord::Shift;
use plotters::prelude::{BitMapBackend, DrawingArea, IntoDrawingArea};
use std::sync::OnceLock;

/// The one font family every chart names.
pub const FONT: &str = "sans-serif";

/// Why a picture could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("the embedded font did not load")]
    Font,
    #[error("drawing failed: {0}")]
    Draw(String),
    #[error("PNG encoding failed: {0}")]
    Encode(#[from] png::EncodingError),
    #[error("nothing to draw: {0}")]
    Empty(&'static str),
}

/// Registers the embedded font under [`FONT`] once per process.
fn font() -> Result<(), PlotError> {
    static LOADED: OnceLock<bool> = OnceLock::new();
    let ok = *LOADED.get_or_init(|| {
        let bytes: &'static [u8] = include_bytes!("../fonts/DejaVuSans.ttf");
        plotters::style::register_font(FONT, plotters::style::FontStyle::Normal, bytes).is_ok()
    });
    ok.then_some(()).ok_or(PlotError::Font)
}

/// A region of a picture being drawn.
pub type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// Maps a plotters error (generic over the backend) to [`PlotError::Draw`].
pub(crate) fn draw_err(e: impl std::fmt::Display) -> PlotError {
    PlotError::Draw(e.to_string())
}

/// Draws on a white `width × height` RGB canvas with `draw`, then encodes it as PNG.
pub fn render_png(
    (width, height): (u32, u32),
    draw: impl FnOnce(&Area<'_>) -> Result<(), PlotError>,
) -> Result<Vec<u8>, PlotError> {
    font()?;
    let mut rgb = vec![255u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area();
        draw(&root)?;
        root.present().map_err(draw_err)?;
    }
    let mut out = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut out, width, height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(&rgb)?;
    }
    Ok(out)
}

/// Decodes a PNG made by [`render_png`] into `(width, height, rgb)`: for tests that look at
/// the pixels of a picture.
pub fn decode_png(bytes: &[u8]) -> Option<(u32, u32, Vec<u8>)> {
    let mut reader = png::Decoder::new(std::io::Cursor::new(bytes))
        .read_info()
        .ok()?;
    let mut rgb = vec![0; reader.output_buffer_size()?];
    let info = reader.next_frame(&mut rgb).ok()?;
    (info.color_type == png::ColorType::Rgb).then_some(())?;
    rgb.truncate(info.buffer_size());
    Some((info.width, info.height, rgb))
}
