//! A writer for NumPy `.npy` files (format 1.0, little-endian float32, C order).

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

/// Write `data` with `shape` as a float32 `.npy` file.
pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    anyhow::ensure!(
        shape.iter().product::<usize>() == data.len(),
        "npy: shape {shape:?} does not match {} values",
        data.len()
    );
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_str = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_str}, }}");
    // Magic (6) + version (2) + header length (2) + header + '\n' is a multiple of 64.
    let pad = (64 - (10 + header.len() + 1) % 64) % 64;
    header.push_str(&" ".repeat(pad));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len() * 4);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    let mut f = std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(&out).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// Read back a float32 `.npy` written by [`write_f32`] (used by tests): shape and data.
#[cfg(test)]
pub fn read_f32(path: &Path) -> Result<(Vec<usize>, Vec<f32>)> {
    let b = std::fs::read(path)?;
    anyhow::ensure!(b.starts_with(b"\x93NUMPY"), "not an npy file");
    let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
    let header = std::str::from_utf8(&b[10..10 + hl])?;
    let s = header.split("'shape': (").nth(1).and_then(|s| s.split(')').next()).unwrap_or("");
    let shape =
        s.split(',').filter(|x| !x.trim().is_empty()).map(|x| x.trim().parse()).collect::<Result<Vec<usize>, _>>()?;
    let data = b[10 + hl..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Ok((shape, data))
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip() {
        let dir = std::env::temp_dir().join(format!("spark-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("x.npy");
        let data: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
        super::write_f32(&p, &[2, 3], &data).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!((bytes.len() - 24) % 4, 0);
        assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
        let hl = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!((10 + hl) % 64, 0);
        let (shape, back) = super::read_f32(&p).unwrap();
        assert_eq!(shape, vec![2, 3]);
        assert_eq!(back, data);
        std::fs::remove_dir_all(&dir).ok();
    }
}
