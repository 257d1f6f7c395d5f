//! Row-wise CPU ops: RMSNorm, RoPE, head gate, GEGLU. Each rounds its result to the compute
//! dtype exactly where the reference casts.

use spark_core::config::GateAct;
use spark_core::rope::RopeTable;
use spark_core::DType;

use crate::kernels::Simd;

/// `o = round(x * rsqrt(mean(x^2) + eps) * w)`, in f32.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, o: &mut [f32], round: DType) {
    let ss: f32 = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ss + eps).sqrt();
    for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
        *o = round.round(w * (x * r));
    }
}

/// NeoX rotation of the first `table.rot_dims` dims of one head at position `pos`.
pub fn rope_head(head: &mut [f32], pos: usize, table: &RopeTable, round: DType) {
    let half = table.rot_dims / 2;
    let cos = &table.cos[pos * half..(pos + 1) * half];
    let sin = &table.sin[pos * half..(pos + 1) * half];
    for j in 0..half {
        let a = head[j];
        let b = head[j + half];
        head[j] = round.round(a * cos[j] - b * sin[j]);
        head[j + half] = round.round(b * cos[j] + a * sin[j]);
    }
}

/// `a[h*d..(h+1)*d] = round(a * round(act(g[h])))`.
pub fn head_gate(a: &mut [f32], g: &[f32], act: GateAct, head_dim: usize, round: DType) {
    for (h, &gv) in g.iter().enumerate() {
        let s = match act {
            GateAct::Sigmoid => 1.0 / (1.0 + (-gv).exp()),
            GateAct::Silu => gv / (1.0 + (-gv).exp()),
        };
        let s = round.round(s);
        for v in &mut a[h * head_dim..(h + 1) * head_dim] {
            *v = round.round(*v * s);
        }
    }
}

/// `o = round(round(gelu_erf(g)) * u)` (vectorized: [`crate::kernels::gelu`]).
pub fn geglu(g: &[f32], u: &[f32], o: &mut [f32], round: DType) {
    crate::kernels::gelu::geglu(Simd::detect(), g, u, o, round);
}
