//! The loss-curve picture a run leaves behind (`loss.png`): raw loss per step in light grey, an
//! exponential moving average in blue, a frame with horizontal grid lines at round loss values,
//! and the y-range and step count written in a 3×5 pixel font. Dependency-free: a minimal PNG
//! encoder (zlib stored blocks, CRC-32, Adler-32) is enough for a small RGB image.

/// An RGB canvas.
pub struct Canvas {
    pub width: usize,
    pub height: usize,
    pixels: Vec<[u8; 3]>,
}

impl Canvas {
    pub fn new(width: usize, height: usize, background: [u8; 3]) -> Self {
        Canvas {
            width,
            height,
            pixels: vec![background; width * height],
        }
    }

    pub fn get(&self, x: usize, y: usize) -> [u8; 3] {
        self.pixels[y * self.width + x]
    }

    fn set(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < self.width && (y as usize) < self.height {
            self.pixels[y as usize * self.width + x as usize] = c;
        }
    }

    /// A line from `(x0, y0)` to `(x1, y1)` (Bresenham).
    fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), c: [u8; 3]) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            self.set(x, y, c);
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// Text in a 3×5 font scaled by `s`; digits, `.`, `-`, space and a few letters.
    fn text(&mut self, x: i64, y: i64, s: i64, text: &str, c: [u8; 3]) {
        for (i, ch) in text.chars().enumerate() {
            let glyph = glyph(ch);
            for (row, bits) in glyph.iter().enumerate() {
                for col in 0..3 {
                    if bits >> (2 - col) & 1 == 1 {
                        for dy in 0..s {
                            for dx in 0..s {
                                let gx = x + (i as i64 * 4 + col) * s + dx;
                                self.set(gx, y + row as i64 * s + dy, c);
                            }
                        }
                    }
                }
            }
        }
    }

    /// PNG bytes (8-bit RGB, no interlace, zlib stored blocks).
    pub fn to_png(&self) -> Vec<u8> {
        let mut raw = Vec::with_capacity(self.height * (1 + 3 * self.width));
        for y in 0..self.height {
            raw.push(0); // filter: none
            for x in 0..self.width {
                raw.extend_from_slice(&self.get(x, y));
            }
        }
        let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
        let mut ihdr = Vec::new();
        ihdr.extend_from_slice(&(self.width as u32).to_be_bytes());
        ihdr.extend_from_slice(&(self.height as u32).to_be_bytes());
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
        chunk(&mut png, b"IHDR", &ihdr);
        chunk(&mut png, b"IDAT", &zlib_stored(&raw));
        chunk(&mut png, b"IEND", &[]);
        png
    }
}

/// Rows of a 3-wide glyph, most significant of the low three bits leftmost.
fn glyph(c: char) -> [u8; 5] {
    match c {
        '0' => [7, 5, 5, 5, 7],
        '1' => [2, 6, 2, 2, 7],
        '2' => [7, 1, 7, 4, 7],
        '3' => [7, 1, 3, 1, 7],
        '4' => [5, 5, 7, 1, 1],
        '5' => [7, 4, 7, 1, 7],
        '6' => [7, 4, 7, 5, 7],
        '7' => [7, 1, 2, 2, 2],
        '8' => [7, 5, 7, 5, 7],
        '9' => [7, 5, 7, 1, 7],
        '.' => [0, 0, 0, 0, 2],
        '-' => [0, 0, 7, 0, 0],
        's' => [3, 4, 2, 1, 6],
        't' => [2, 7, 2, 2, 1],
        'e' => [2, 5, 7, 4, 3],
        'p' => [6, 5, 6, 4, 4],
        'l' => [6, 2, 2, 2, 7],
        'o' => [0, 2, 5, 5, 2],
        _ => [0; 5],
    }
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// A zlib stream of stored (uncompressed) deflate blocks.
fn zlib_stored(data: &[u8]) -> Vec<u8> {
    let mut out = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = if data.is_empty() {
        vec![&[][..]]
    } else {
        data.chunks(65_535).collect()
    };
    for (i, block) in blocks.iter().enumerate() {
        out.push((i + 1 == blocks.len()) as u8);
        let len = block.len() as u16;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(block);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &x in data {
        a = (a + x as u32) % 65_521;
        b = (b + a) % 65_521;
    }
    out.extend_from_slice(&((b << 16) | a).to_be_bytes());
    out
}

/// Round step for about `n` grid lines over `span`.
fn nice_step(span: f64, n: f64) -> f64 {
    let raw = (span / n).max(1e-12);
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag)
}

/// The loss curve of `losses` (one per step) as a `width × height` picture.
pub fn loss_curve(losses: &[f64], width: usize, height: usize) -> Canvas {
    const GRID: [u8; 3] = [225, 225, 225];
    const RAW: [u8; 3] = [185, 185, 185];
    const EMA: [u8; 3] = [31, 90, 180];
    const INK: [u8; 3] = [40, 40, 40];
    let mut c = Canvas::new(width, height, [255, 255, 255]);
    let finite: Vec<f64> = losses.iter().copied().filter(|v| v.is_finite()).collect();
    let (left, right, top, bottom) = (44i64, width as i64 - 10, 10i64, height as i64 - 24);
    if finite.is_empty() || right <= left || bottom <= top {
        return c;
    }
    let lo = finite.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = finite.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (lo, hi) = if hi - lo < 1e-9 {
        (lo - 0.5, hi + 0.5)
    } else {
        (lo, hi)
    };
    let step = nice_step(hi - lo, 5.0);
    let (lo, hi) = ((lo / step).floor() * step, (hi / step).ceil() * step);
    let y_of = |v: f64| bottom - ((v - lo) / (hi - lo) * (bottom - top) as f64).round() as i64;
    let n = losses.len().max(2);
    let x_of = |i: usize| left + (i as f64 / (n - 1) as f64 * (right - left) as f64).round() as i64;
    let mut g = lo;
    while g <= hi + step * 0.5 {
        let y = y_of(g);
        c.line((left, y), (right, y), GRID);
        let label = if step >= 1.0 {
            format!("{g:.0}")
        } else {
            format!("{g:.1}")
        };
        c.text(2, y - 4, 2, &label, INK);
        g += step;
    }
    let mut prev: Option<(i64, i64)> = None;
    for (i, v) in losses.iter().enumerate() {
        if !v.is_finite() {
            prev = None;
            continue;
        }
        let p = (x_of(i), y_of(*v));
        if let Some(q) = prev {
            c.line(q, p, RAW);
        }
        prev = Some(p);
    }
    let alpha = 2.0 / (1.0 + (losses.len() as f64 / 20.0).max(1.0));
    let mut ema: Option<f64> = None;
    let mut prev: Option<(i64, i64)> = None;
    for (i, v) in losses.iter().enumerate() {
        if !v.is_finite() {
            continue;
        }
        let e = ema.map_or(*v, |e| e + alpha * (v - e));
        ema = Some(e);
        let p = (x_of(i), y_of(e));
        if let Some(q) = prev {
            c.line(q, p, EMA);
            c.line((q.0, q.1 + 1), (p.0, p.1 + 1), EMA);
        }
        prev = Some(p);
    }
    c.line((left, top), (left, bottom), INK);
    c.line((left, bottom), (right, bottom), INK);
    c.line((left, top), (right, top), INK);
    c.line((right, top), (right, bottom), INK);
    c.text(left, bottom + 8, 2, "step 1", INK);
    let last = format!("{}", losses.len());
    c.text(right - 8 * last.len() as i64, bottom + 8, 2, &last, INK);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_match_known_values() {
        assert_eq!(crc32(b"IEND"), 0xae42_6082);
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
        let z = zlib_stored(b"Wikipedia");
        assert_eq!(&z[z.len() - 4..], &0x11e6_0398u32.to_be_bytes());
    }

    #[test]
    fn a_falling_loss_is_drawn_falling() {
        let losses: Vec<f64> = (0..200).map(|i| 8.0 - 3.0 * (i as f64 / 199.0)).collect();
        let c = loss_curve(&losses, 320, 200);
        let png = c.to_png();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&png[png.len() - 12..png.len() - 4], b"\0\0\0\0IEND");
        // The EMA line is high on the left and low on the right of the plot area.
        let blue_rows = |x: usize| {
            (0..c.height)
                .filter(|&y| c.get(x, y) == [31, 90, 180])
                .collect::<Vec<_>>()
        };
        let (l, r) = (blue_rows(60), blue_rows(300));
        assert!(!l.is_empty() && !r.is_empty());
        assert!(l[0] < r[0], "left {l:?} should be above right {r:?}");
    }
}
